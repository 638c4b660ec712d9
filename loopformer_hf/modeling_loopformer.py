"""LoopFormer: k shared transformer blocks looped along a trajectory of M steps, each step conditioned on its
normalised time t and step size Δ (Jeddi et al., ICLR 2026). The blocks are layers_loopformer.py's; this file embeds,
runs the loop and reads out: embeddings → positions and mask → the loop → final norm → head.

KV cache: every (loop step i, block j) pair attends to its own keys and values; [`LoopFormerCache`] (or the
preallocated [`LoopFormerStaticCache`], cache_loopformer.py) holds one slot per pair and refuses a trajectory other
than the one that filled it.
"""

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .cache_loopformer import CACHE_FIELD, LoopFormerCache
from .configuration_loopformer import LoopFormerConfig
from .generation_loopformer import GENERATION_LOOP_KNOBS, LoopFormerGenerationMixin, check_generation_knobs
from .halting_loopformer import LoopFormerHaltingState, halting_rule
from .layers_loopformer import (
    LoopFormerBlock,
    LoopFormerLoopConditioning,
    LoopFormerRMSNorm,
    LoopFormerRotaryEmbedding,
)
from .looped_common import CheckpointLoadersMixin
from .loss_loopformer import check_labels, check_shortcut_consistency, shortcut_consistency_loss
from .inputs_loopformer import call_inputs
from .plan_loopformer import LoopFormerPlan


class LoopFormerPreTrainedModel(CheckpointLoadersMixin, PreTrainedModel):  # the mixin: from_pretrained's other layouts
    config_class = LoopFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LoopFormerBlock"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # A fixed trajectory (no `halt_eps`, whose halting reads tensor values) traces as one graph per trajectory.
    _can_compile_fullgraph = True

    checkpoint_loaders = []  # the authors' Hub repos (`loopformer_hf/__init__.py`; `CheckpointLoadersMixin`)

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        adjusted = super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)
        # Paged attention reads a paged cache (continuous batching), which has no slot per (loop step, block).
        if isinstance(adjusted, str) and adjusted.startswith("paged"):
            raise ValueError(
                f"LoopFormer does not support attn_implementation={attn_implementation!r}: paged attention needs a "
                f'paged cache, which has no slot per (loop step, block). Use "sdpa" or "eager".'
            )
        return adjusted

    @torch.no_grad()
    def _init_weights(self, module):
        """`config.initializer_scheme`: "reference" (the authors' effective init) or "zero_adaln" (adaLN zeroed)."""
        from transformers import initialization as init

        reference = self.config.initializer_scheme == "reference"
        if getattr(module, "zero_init", False) and not reference:  # adaLN-zero: every residual branch starts closed
            init.zeros_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, LoopFormerRotaryEmbedding):  # non-persistent: rebuilt when loading from meta
            for buffer in (module.inv_freq, module.original_inv_freq):
                init.copy_(buffer, module.frequencies(self.config)[0])
        elif getattr(module, "residual_projection", False) and reference:
            # GPT-2's scaled init, N(0, σ/√(2k)) with k = shared blocks (the reference's n_layer)
            init.normal_(
                module.weight,
                mean=0.0,
                std=self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers),
            )
            if module.bias is not None:
                init.zeros_(module.bias)
        else:
            super()._init_weights(module)


class LoopInputs(NamedTuple):
    """What every loop step of one call reads besides the state: the steps' conditioning (with gradients) or
    per-block adaLN vectors, the attention mask, rotary (cos, sin), the cache and whether to return attention maps."""

    conditioning: torch.Tensor | None
    loop_adaln: list | None
    mask: torch.Tensor | None
    position_embeddings: tuple | None
    cache: object
    output_attentions: bool


@dataclass
class LoopFormerModelOutput(BaseModelOutputWithPast):
    """`loop_counts` (batch, seq): loop steps each token ran (only with `halt_eps`; otherwise every token runs M)."""

    loop_counts: torch.LongTensor | None = None


@dataclass
class LoopFormerCausalLMOutput(CausalLMOutputWithPast):
    """loop_counts (batch, seq): loop steps each token ran (only with `halt_eps`). ce_full, ce_short, consistency:
    with `labels` and `shortcut_consistency`, the objective's terms: per-token CE of the full and of the short
    trajectory, and the consistency distance D (detached; `loss` combines them)."""

    loop_counts: torch.LongTensor | None = None
    ce_full: torch.FloatTensor | None = None
    ce_short: torch.FloatTensor | None = None
    consistency: torch.FloatTensor | None = None


class LoopFormerModel(LoopFormerPreTrainedModel):
    def __init__(self, config: LoopFormerConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.rotary_emb = LoopFormerRotaryEmbedding(config)
        self.loop_conditioning = LoopFormerLoopConditioning(config)
        self.layers = nn.ModuleList([LoopFormerBlock(config) for _ in range(config.num_hidden_layers)])
        self.norm = LoopFormerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def _add_positions(self, inputs_embeds, position_ids):
        """(hidden states, rotary (cos, sin) or None): learned positions are added, RoPE is applied in attention."""
        if self.config.position_embedding_type != "learned":
            return inputs_embeds, tuple(t[:, None] for t in self.rotary_emb(inputs_embeds, position_ids))  # per head
        if not torch.compiler.is_compiling() and int(position_ids.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"Position {int(position_ids.max())} is beyond max_position_embeddings="
                f"{self.config.max_position_embeddings} (learned positions cannot extrapolate)."
            )
        return inputs_embeds + self.embed_positions(position_ids), None

    def _loop_adaln(self, plan, dtype, device, cache):
        """`loop_adaln[j][i]`: block j's `adaln` vectors at loop step i (None without conditioning); with per-row
        trajectories (`plan.rows`) each is (batch, 1, d), row b's of its step i. They depend on the trajectory alone
        (c_i is a function of t and Δ), so they are computed once per call, for all steps at once, and kept on the
        cache (`adaln_memo`) for the later decode steps of an inference run."""
        keep = cache is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        rows = plan.rows
        # read only in eager code: a compiled forward would guard on the rows' values
        key = (plan.trajectory if rows is None else rows.trajectories, dtype, str(device)) if keep else None
        kept = cache.kept_adaln(key) if keep else None
        if kept is not None:
            return kept
        conditioning = self.loop_conditioning(plan.trajectory if rows is None else rows.steps, device, dtype)
        loop_adaln = None
        if conditioning is not None:
            per_block = [block.adaln(block.adaLN_modulation(conditioning).to(dtype)) for block in self.layers]
            per_row = conditioning.dim() == 3  # then (batch, 1, d) for each step
            loop_adaln = [
                [
                    tuple(v[:, i, None] if per_row else v[i] for v in vectors)
                    for i in range(rows.num_steps if per_row else plan.spec.loop_steps)
                ]
                for vectors in per_block
            ]
        if keep:
            cache.keep_adaln(key, loop_adaln)
        return loop_adaln

    def _loop_step(self, step, hidden_states, inputs, exit_step=None):
        """Loop step `step` through the k blocks, with the call's `inputs` (a `LoopInputs`) and, under early exit,
        the step's `exit_step`: (new state, the step's attention maps, each block's (keys, values))."""
        conditioning, loop_adaln, mask, position_embeddings, cache, output_attentions = inputs
        c = None if conditioning is None else conditioning[step]
        attentions, block_kv = (), ()
        for j, block in enumerate(self.layers):
            adaln, frozen = None if loop_adaln is None or c is not None else loop_adaln[j][step], None
            if exit_step is not None:  # the tokens that sit this step out; a rule may run other steps for some
                adaln, frozen = exit_step.block(j, adaln)
            hidden_states, weights, kv = block(
                hidden_states,
                c,
                adaln=adaln,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                cache=cache,
                cache_slot=cache.slot(step, j) if cache is not None else 0,
                output_attentions=output_attentions,
                halting=frozen,
            )
            attentions += (weights,)
            block_kv += (kv,)
        return hidden_states, attentions, block_kv

    def _loop(
        self, plan, hidden_states, mask, position_embeddings, cache, halt_head, output_attentions, output_hidden_states
    ):
        """The loop along `plan.trajectory`: (final state, states after each step or None, attentions or None,
        the loop steps each token ran or None (without `halt_eps`))."""
        trajectory, num_steps = plan.trajectory, plan.spec.loop_steps
        halts = plan.halt_eps is not None or plan.rows is not None  # per-row budgets halt a row after its last step
        # With gradients on, each block computes its adaLN vectors inside its own forward from the step's conditioning,
        # passed positionally: FSDP gathers a block's weights only there, and reentrant checkpointing tracks only
        # positional tensors. At inference (and per row) they are computed once for every step (kept on the cache).
        dtype, device = hidden_states.dtype, hidden_states.device
        conditioning = None
        if torch.is_grad_enabled() and plan.rows is None:
            conditioning = self.loop_conditioning(trajectory, device, dtype)
        loop_adaln = None
        if conditioning is None or halts:  # halting fills skipped slots from the per-block vectors
            loop_adaln = self._loop_adaln(plan, dtype, device, cache)
        early_exit = None  # the rule's state: the loop calls its begin, for_step, observe and finish
        if halts:
            readout = None if halt_head is None else (lambda h: F.log_softmax(halt_head(self.norm(h)).float(), dim=-1))
            rule = LoopFormerHaltingState if plan.halt_eps is None else halting_rule(plan.halt_criterion)
            early_exit, hidden_states = rule.begin(
                self, plan, hidden_states, readout, loop_adaln, cache, mask, position_embeddings
            )
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        inputs = LoopInputs(conditioning, loop_adaln, mask, position_embeddings, cache, output_attentions)
        for step in range(num_steps):
            exit_step = None
            if early_exit is not None:
                exit_step = early_exit.for_step(step, hidden_states, gather=not output_attentions)
                if exit_step is None:  # every token has halted (the rule filled the slots of the steps left)
                    if output_hidden_states:
                        all_hidden_states += (hidden_states,) * (num_steps - step)
                    break
            previous = hidden_states
            hidden_states, attentions, block_kv = self._loop_step(step, hidden_states, inputs, exit_step)
            if early_exit is not None:
                early_exit.observe(previous, hidden_states, block_kv, final=step == num_steps - 1)
            if output_attentions:
                all_attentions += attentions
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        loop_counts = None
        if early_exit is not None:  # a rule may keep other states for some tokens
            hidden_states, loop_counts = early_exit.finish(hidden_states)
        return hidden_states, all_hidden_states, all_attentions, loop_counts

    def _cache_for_call(self, cache, use_cache, plan):
        """As Llama's: `use_cache` starts a cache, one passed in is filled; none under gradient checkpointing."""
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if (self.gradient_checkpointing and self.training) or not (use_cache or cache is not None):
            return None
        return LoopFormerCache.for_call(cache, plan)

    # ---- forward -------------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        loop_budget=None,
        step_schedule=None,
        halt_eps=None,
        halt_criterion=None,
        halt_head=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        r"""
        loop_budget (`int`, list of `int` or 1-D integer tensor, *optional*): number of loop steps M (defaults to the
            config's), or one per row: the loop runs the largest, and a row's tokens freeze after its own last step.
        step_schedule (`str` or list of `float`, *optional*): step sizes Δ_1..Δ_M summing to 1, or a preset name
            ("uniform", "coarse_to_fine", "fine_to_coarse"); or a list of one per row (`None`: that row's default).
        halt_eps (`float`, *optional*): adaptive depth per token: a token stops looping once its `halt_criterion`
            score falls below halt_eps, never beyond the budget; `loop_counts` reports the steps. Halted tokens are
            left out of the later steps' computation (their keys and values are still filled).
        halt_criterion (`str`, *optional*): "state_change" (default: `config.halt_criterion`), or another registered
            rule (`halting_loopformer.register_halting_rule`; the lab's read next-token distributions: `halt_head`).
        halt_head (`nn.Module`, *optional*): the LM head a registered rule may read next-token distributions through
            (after the final norm); [`LoopFormerForCausalLM`] passes its `lm_head`.
        `hidden_states` (with `output_hidden_states=True`, a keyword as for Llama) holds the embeddings followed by the
        residual stream after each loop step: M + 1 tensors. `attentions` (`output_attentions=True`) holds one tensor
        per (loop step, block). `return_dict=False` gives a tuple; `past_key_values` is `cache`'s former name.
        """
        output_attentions, output_hidden_states = (
            kwargs.get(name) if kwargs.get(name) is not None else getattr(self.config, name)
            for name in ("output_attentions", "output_hidden_states")
        )
        cache = cache_argument(cache, kwargs.get("past_key_values"), type(self).__name__)
        given = input_ids if input_ids is not None else inputs_embeds  # checked in `call_inputs`
        batch_size = given.shape[0] if isinstance(given, torch.Tensor) and given.dim() >= 2 else None
        plan = LoopFormerPlan.for_call(
            self.config, cache, loop_budget, step_schedule, halt_eps, halt_criterion, batch_size=batch_size
        )
        cache = self._cache_for_call(cache, use_cache, plan)
        inputs_embeds, position_ids, mask = call_inputs(
            self.config, self.embed_tokens, input_ids, inputs_embeds, attention_mask, position_ids, cache
        )
        hidden_states, position_embeddings = self._add_positions(inputs_embeds, position_ids)
        hidden_states, all_hidden_states, all_attentions, loop_counts = self._loop(
            plan, hidden_states, mask, position_embeddings, cache, halt_head, output_attentions, output_hidden_states
        )
        output = LoopFormerModelOutput(
            last_hidden_state=self.norm(hidden_states),
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            loop_counts=loop_counts,
            **{CACHE_FIELD: cache},
        )
        return as_requested(output, kwargs.get("return_dict"), self.config)


def cache_argument(cache, past_key_values, owner):
    """`cache`, or its pre-5.24 name `past_key_values` (deprecated, as in transformers, where the field is `cache`)."""
    if past_key_values is None:
        return cache
    if CACHE_FIELD == "cache":
        warnings.warn(
            f"`past_key_values` is deprecated for `{owner}.forward`. Use `cache` instead.", FutureWarning, stacklevel=3
        )
    return cache if cache is not None else past_key_values


def as_requested(output, return_dict, config):
    """`output`, or its tuple with `return_dict=False` (the call's, else the config's), as Llama's `can_return_tuple`
    (inline: a compiled forward stays this file's code object, not a wrapper whose recompile limit all models share)."""
    return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()


LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")  # what `forward` hands to `loss_function`


class LoopFormerForCausalLM(LoopFormerPreTrainedModel, LoopFormerGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # as Llama's (the blocks': LoopFormerConfig.base_model_tp_plan)

    def __init__(self, config: LoopFormerConfig):
        super().__init__(config)
        self.model = LoopFormerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self._keys_to_ignore_on_save |= set(self.all_tied_weights_keys)  # never saved: a resume re-ties, not "missing"

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        loop_budget=None,
        step_schedule=None,
        halt_eps=None,
        halt_criterion=None,
        shortcut_consistency=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        r"""
        labels (`torch.LongTensor`, *optional*): next-token targets (shifted inside), -100 is ignored.
        shift_labels (`torch.LongTensor`, *optional*, a keyword as for Llama, so `label_names` stay `["labels"]`):
            targets already aligned with the positions (the authors' windows: T tokens train T targets).
        loop_budget, step_schedule, halt_eps, halt_criterion: the loop, as for [`LoopFormerModel.forward`], also as
            `generate` kwargs; `output_attentions`, `output_hidden_states`, `return_dict`, `past_key_values` as Llama's.
        shortcut_consistency ([`ShortcutConsistency`], *optional*): with `labels`, train with LoopFormer's
            shortcut-consistency objective: the same inputs also run its short trajectory and
            `loss = CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)`, its terms in `ce_full`, `ce_short`,
            `consistency` (in a Trainer, looped_training's ShortcutConsistencyCallback passes it).
        """
        shortcut_consistency = check_shortcut_consistency(shortcut_consistency, kwargs, labels)
        model_inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "inputs_embeds": inputs_embeds,
        }
        outputs = self.model(
            **model_inputs,
            cache=cache,
            use_cache=use_cache,
            loop_budget=loop_budget,
            step_schedule=step_schedule,
            halt_eps=halt_eps,
            halt_criterion=halt_criterion,
            halt_head=self.lm_head,
            **{**kwargs, "return_dict": True},
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep  # as Llama
        logits = self.lm_head(hidden_states[:, keep, :])
        loss, terms = self._loss(logits, hidden_states, model_inputs, labels, shortcut_consistency, kwargs)
        output = LoopFormerCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            loop_counts=outputs.loop_counts,
            **terms,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )
        return as_requested(output, kwargs.get("return_dict"), self.config)

    def _loss(self, logits, hidden_states, model_inputs, labels, shortcut_consistency, kwargs):
        """(loss, the shortcut objective's terms): plain CE, or with `shortcut_consistency` the shortcut-consistency
        loss of the full and the short trajectory."""
        if labels is None:
            return None, {}
        shift_labels = kwargs.get("shift_labels")
        check_labels(labels, shift_labels, logits.shape[:2], self.config.vocab_size)
        if shortcut_consistency is None:
            loss_kwargs = {k: v for k, v in kwargs.items() if k in LOSS_KWARGS}
            return self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs
            ), {}
        objective = shortcut_consistency
        short = self.model(
            **model_inputs, step_schedule=list(objective.short_step_schedule), use_cache=False, return_dict=True
        )
        loss, terms, _ = shortcut_consistency_loss(
            logits,
            hidden_states,
            self.lm_head(short.last_hidden_state),
            short.last_hidden_state,
            labels,
            objective.lambda_short,
            objective.lambda_consistency,
            objective.consistency_loss,
            kwargs.get("num_items_in_batch"),
            shift_labels,
        )
        return loss, terms

    def save_pretrained(self, *args, **kwargs):
        """As `PreTrainedModel.save_pretrained`; loop knobs set on `generation_config` are written to
        generation_config.json and come back on load. A knob the model refuses is refused here, not at the reload."""
        generation_config = getattr(self, "generation_config", None)
        knobs = {name: getattr(generation_config, name, None) for name in GENERATION_LOOP_KNOBS}
        if generation_config is not None and any(value is not None for value in knobs.values()):
            check_generation_knobs(self.config, knobs, "generation_config")
            # A generation config marked as derived from the model config loses its custom fields when loaded.
            generation_config._from_model_config = False
        return super().save_pretrained(*args, **kwargs)


__all__ = ["LoopFormerPreTrainedModel", "LoopFormerModel", "LoopFormerForCausalLM"]
