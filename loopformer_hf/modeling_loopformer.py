"""LoopFormer: k shared transformer blocks looped along a trajectory of M steps, each step conditioned on its
normalised time t and step size Δ (Jeddi et al., ICLR 2026). The blocks are layers_loopformer.py's; this file embeds,
runs the loop and reads out: embeddings → positions and mask → the loop → final norm → head.

KV cache: every (loop step i, block j) pair attends to its own keys and values; [`LoopFormerCache`] (or the
preallocated [`LoopFormerStaticCache`], cache_loopformer.py) holds one slot per pair and refuses a trajectory other
than the one that filled it.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .cache_loopformer import CACHE_FIELD, LoopFormerCache, cache_argument
from .configuration_loopformer import LoopFormerConfig
from .generation_loopformer import GENERATION_LOOP_KNOBS, LoopFormerGenerationMixin, check_generation_knobs
from .halting_loopformer import LoopFormerHaltingState
from .inputs_loopformer import call_inputs, default_position_ids
from .layers_loopformer import (
    LoopFormerBlock,
    LoopFormerLoopConditioning,
    LoopFormerRMSNorm,
    LoopFormerRotaryEmbedding,
)
from .looped_common import CheckpointLoadersMixin
from .loss_loopformer import check_labels, check_shortcut_consistency, shortcut_consistency_loss
from .plan_loopformer import LoopFormerPlan


# what a call with the arguments of the halting plugin API (removed; docs/loopformer.md, "Changed in this version") gets
REMOVED_HALTING_ARGUMENTS = (
    "`halt_criterion` and `halt_head` are no arguments of LoopFormer any more: with `halt_eps` it halts on the state "
    "change. The lab's other exit rules run on `LabLoopFormerForCausalLM` (benchmarks/halting_rules.py), whose forward "
    "and generate take `halt_criterion`."
)


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
            cos, sin = self.rotary_emb(inputs_embeds, position_ids)
            return inputs_embeds, (cos[:, None], sin[:, None])  # shared by the heads
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
        cache (`adaln_memo`, under the plan, which the later decode steps of an inference run share) for them."""
        keep = cache is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        rows, trajectory = plan.rows, plan.spec.trajectory
        memo = cache.adaln_memo if keep else None
        if memo is not None and memo[0] is plan and memo[1] == dtype:
            return memo[2]
        conditioning = self.loop_conditioning(trajectory if rows is None else rows.steps, device, dtype)
        loop_adaln = None
        if conditioning is not None:
            per_block = [block.adaln(block.adaLN_modulation(conditioning).to(dtype)) for block in self.layers]
            per_row = conditioning.dim() == 3  # then (batch, 1, d) for each step
            loop_adaln = [
                [
                    tuple(v[:, i, None] if per_row else v[i] for v in vectors)
                    for i in range(len(trajectory) if rows is None else rows.num_steps)
                ]
                for vectors in per_block
            ]
        if keep:
            cache.adaln_memo = (plan, dtype, loop_adaln)
        return loop_adaln

    def _loop(self, plan, hidden_states, mask, position_embeddings, cache, output_attentions, output_hidden_states):
        """The loop along `plan.trajectory`: every loop step runs the k blocks, as Llama's forward runs its layers.
        Returns (final state, the states after each step or None, None, None); per-token halting and per-row
        trajectories run `_halting_loop`, whose third item is the loop steps each token ran."""
        if plan.spec.halt_eps is not None or plan.rows is not None:
            return self._halting_loop(
                plan,
                hidden_states,
                mask,
                position_embeddings,
                cache,
                output_attentions,
                output_hidden_states,
            )
        # With gradients on, each block computes its adaLN vectors inside its own forward from the step's conditioning,
        # passed positionally: FSDP gathers a block's weights only there, and reentrant checkpointing tracks only
        # positional tensors. At inference they are computed once for every step (kept on the cache).
        dtype, device, trajectory = hidden_states.dtype, hidden_states.device, plan.spec.trajectory
        conditioning = self.loop_conditioning(trajectory, device, dtype) if torch.is_grad_enabled() else None
        loop_adaln = None
        memo = cache.adaln_memo if cache is not None and not torch.compiler.is_compiling() else None
        if conditioning is None and memo is not None and memo[0] is plan and memo[1] == dtype:
            loop_adaln = memo[2]  # the decode steps of an inference run: kept for their plan by `_loop_adaln`
        elif conditioning is None:
            loop_adaln = self._loop_adaln(plan, dtype, device, cache)
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for step in range(len(trajectory)):
            c = None if conditioning is None else conditioning[step]
            for j, block in enumerate(self.layers):
                hidden_states = block(
                    hidden_states,
                    c,
                    adaln=None if loop_adaln is None else loop_adaln[j][step],
                    attention_mask=mask,
                    position_embeddings=position_embeddings,
                    cache=cache,
                    cache_slot=cache.slot(step, j) if cache is not None else 0,
                    output_attentions=output_attentions,
                )
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        return hidden_states, all_hidden_states, None, None

    def _halting_loop(
        self, plan, hidden_states, mask, position_embeddings, cache, output_attentions, output_hidden_states
    ):
        """`_loop` under per-token halting (`halt_eps`) or per-row trajectories (a row halts after its last step):
        the halting state (`halting_loopformer`, the plan's `halting` class) says, before each step, which tokens each
        block computes, and reads the step's result and keys and values after it. Returns (final state, states after
        each step or None, the loop steps each token ran or None (without `halt_eps`))."""
        dtype, device = hidden_states.dtype, hidden_states.device
        conditioning = None  # as in `_loop`; per-row trajectories have per-row vectors, computed once
        if torch.is_grad_enabled() and plan.rows is None:
            conditioning = self.loop_conditioning(plan.trajectory, device, dtype)
        loop_adaln = self._loop_adaln(plan, dtype, device, cache)  # halting fills skipped slots from them
        rule = plan.halting or LoopFormerHaltingState
        early_exit, hidden_states = rule.begin(self, plan, hidden_states, loop_adaln, cache, mask, position_embeddings)
        num_steps = plan.spec.loop_steps
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for step in range(num_steps):
            # halted tokens are left out of the step's computation unless the attention maps are returned
            exit_step = early_exit.for_step(step, hidden_states, gather=not output_attentions)
            if exit_step is None:  # every token has halted (the rule filled the slots of the steps left)
                if output_hidden_states:
                    all_hidden_states += (hidden_states,) * (num_steps - step)
                break
            previous, block_kv = hidden_states, []
            c = None if conditioning is None else conditioning[step]
            for j, block in enumerate(self.layers):
                adaln = None if loop_adaln is None or c is not None else loop_adaln[j][step]
                adaln, halting = exit_step.block(j, adaln)
                hidden_states = block(
                    hidden_states,
                    c,
                    adaln=adaln,
                    attention_mask=mask,
                    position_embeddings=position_embeddings,
                    cache=cache,
                    cache_slot=cache.slot(step, j) if cache is not None else 0,
                    output_attentions=output_attentions,
                    halting=halting,
                )
                block_kv.append(halting.kv)
            early_exit.observe(previous, hidden_states, block_kv, final=step == num_steps - 1)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        hidden_states, loop_counts = early_exit.finish(hidden_states)  # a rule may keep other states for some tokens
        return hidden_states, all_hidden_states, loop_counts, None

    def _cache_for_call(self, cache, use_cache, plan):
        """As Llama's: `use_cache` starts a cache, one passed in is filled; none under gradient checkpointing."""
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if (self.gradient_checkpointing and self.training) or not (use_cache or cache is not None):
            return None
        return LoopFormerCache.for_call(cache, plan)

    def _plan(self, cache, batch_size=None, loop_budget=None, step_schedule=None, halt_eps=None):
        """The [`LoopFormerPlan`] of a call (of `forward`, or of `generate` for the cache it makes) with these loop
        knobs: the one `cache` holds if the call asks the same. A subclass that runs another halting rule (a
        `LoopFormerHaltingState` subclass, as the lab's: benchmarks/halting_rules.py) overrides this method."""
        return LoopFormerPlan.for_call(self.config, cache, loop_budget, step_schedule, halt_eps, batch_size)

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
        **kwargs: Unpack[TransformersKwargs],
    ):
        r"""
        loop_budget (`int`, list of `int` or 1-D integer tensor, *optional*): loop steps M (default: the config's), or
            one per row (a row's tokens freeze after its last step). step_schedule (`str` or list of `float`):
            Δ_1..Δ_M summing to 1, a preset ("uniform", "coarse_to_fine", "fine_to_coarse"), or one per row.
        halt_eps (`float`, *optional*): a token stops looping once its relative state change
            ‖h_i − h_{i−1}‖∞ / (‖h_i‖∞ + 1e-8) falls below halt_eps.
        `loop_plan` (a keyword): what `generate` hands its decode steps, the plan bound to its cache: the step then
        reads no loop knob and checks no input (generate made them). `hidden_states` (`output_hidden_states=True`):
        the embeddings and the state after each loop step (M + 1 tensors); `attentions`: one per (loop step, block).
        """
        output_attentions = a if (a := kwargs.get("output_attentions")) is not None else self.config.output_attentions
        output_hidden_states = (
            h if (h := kwargs.get("output_hidden_states")) is not None else self.config.output_hidden_states
        )
        plan = kwargs.get("loop_plan")
        if plan is None:  # a call of its own: its knobs resolved and checked, its cache bound, its inputs checked
            if "halt_criterion" in kwargs or "halt_head" in kwargs:
                raise TypeError(REMOVED_HALTING_ARGUMENTS)
            cache = cache_argument(cache, kwargs.get("past_key_values"), type(self).__name__)  # cache_loopformer.py
            knobs = (loop_budget, step_schedule, halt_eps)
            plan, cache, inputs_embeds, position_ids, mask = self._call_inputs(
                input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, *knobs
            )
        else:  # a decode step of `generate`: the plan of its cache, and the inputs generate made from a checked prompt
            cache = cache if cache is not None else kwargs.get("past_key_values")
            inputs_embeds, position_ids, mask = self._step_inputs(
                input_ids, inputs_embeds, attention_mask, position_ids, cache
            )
        hidden_states, position_embeddings = self._add_positions(inputs_embeds, position_ids)
        loop = self._loop_recording_attentions if output_attentions else self._loop
        hidden_states, all_hidden_states, loop_counts, attentions = loop(
            plan, hidden_states, mask, position_embeddings, cache, output_attentions, output_hidden_states
        )
        output = LoopFormerModelOutput(
            last_hidden_state=self.norm(hidden_states),
            hidden_states=all_hidden_states,
            attentions=attentions,
            loop_counts=loop_counts,
            **{CACHE_FIELD: cache},
        )
        return as_requested(output, kwargs.get("return_dict"), self.config)

    def _call_inputs(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, *knobs):
        """(plan, cache, embeddings, position ids, mask) of a call of its own: its loop knobs (`loop_budget`,
        `step_schedule`, `halt_eps`) resolved and checked, its cache made or checked against the
        plan, its inputs checked."""
        given = input_ids if input_ids is not None else inputs_embeds  # checked in `call_inputs`
        batch_size = given.shape[0] if isinstance(given, torch.Tensor) and given.dim() >= 2 else None
        plan = self._plan(cache, batch_size, *knobs)
        cache = self._cache_for_call(cache, use_cache, plan)
        inputs_embeds, position_ids, mask = call_inputs(
            self.config, self.embed_tokens, input_ids, inputs_embeds, attention_mask, position_ids, cache
        )
        return plan, cache, inputs_embeds, position_ids, mask

    def _step_inputs(self, input_ids, inputs_embeds, attention_mask, position_ids, cache):
        """(embeddings, position ids, mask) of a decode step of `generate`, as Llama's forward makes them: generate
        made the inputs (from a prompt checked at the prefill) and gives the positions."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = default_position_ids(
                attention_mask, *inputs_embeds.shape[:2], cache.get_seq_length(), inputs_embeds.device
            )
        mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(inputs_embeds.dtype)  # additive: sdpa needs the queries' dtype
        return inputs_embeds, position_ids, mask

    def _loop_recording_attentions(self, *args):
        """`_loop(*args)` and the weights of each attention call, one per (loop step, block) in the order they run,
        recorded by a forward hook on each attention module, as transformers records Llama's."""
        weights = []
        hooks = [
            block.self_attn.register_forward_hook(lambda module, inputs, output: weights.append(output[1]))
            for block in self.layers
        ]
        try:
            return *self._loop(*args)[:3], tuple(weights)
        finally:
            for hook in hooks:
                hook.remove()


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
        shortcut_consistency=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        r"""
        labels (`torch.LongTensor`, *optional*): next-token targets (shifted inside), -100 is ignored; `shift_labels`
            (a keyword, as for Llama): targets already aligned with the positions (the authors' windows).
        loop_budget, step_schedule, halt_eps (and `loop_plan`): as for [`LoopFormerModel.forward`],
            also as `generate` kwargs; `output_attentions`, `output_hidden_states`, `return_dict` as Llama's.
        shortcut_consistency ([`ShortcutConsistency`], *optional*): with `labels`, the same inputs also run its short
            trajectory: `loss = CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)`, its terms in `ce_full`,
            `ce_short`, `consistency` (in a Trainer, looped_training's ShortcutConsistencyCallback passes it).
        """
        if kwargs.get("loop_plan") is None:  # not a decode step of `generate`, which computes no loss
            shortcut_consistency = check_shortcut_consistency(shortcut_consistency, kwargs, labels)
        model_inputs = {"input_ids": input_ids, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask}
        model_inputs["position_ids"] = position_ids  # the short trajectory of the objective runs the same inputs
        outputs = self.model(
            **model_inputs,
            cache=cache,
            use_cache=use_cache,
            loop_budget=loop_budget,
            step_schedule=step_schedule,
            halt_eps=halt_eps,
            **{**kwargs, "return_dict": True},
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep  # as Llama
        logits = self.lm_head(hidden_states[:, keep, :])
        loss, terms = None, {}
        if labels is not None:
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
