"""LoopFormer: k shared transformer blocks looped along a trajectory of M steps, each step conditioned on its
normalised time t and step size Δ (Jeddi et al., ICLR 2026). Reads top to bottom in the order a token travels:
norm → positions → attention → MLP → loop conditioning (t, Δ) → modulated block → the loop → head.

KV cache: every (loop step i, block j) pair attends to its own keys and values; [`LoopFormerCache`] (or the
preallocated [`LoopFormerStaticCache`], cache_loopformer.py) holds one slot per pair and refuses a trajectory other
than the one that filled it.
"""

import glob
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .cache_loopformer import CACHE_FIELD, LoopFormerCache, LoopFormerPlan, cache_argument
from .configuration_loopformer import LoopFormerConfig
from .generation_loopformer import GENERATION_LOOP_KNOBS, LoopFormerGenerationMixin
from .loss_loopformer import check_labels, check_shortcut_consistency, shortcut_consistency_loss
from .masks_loopformer import attention_mask_for, check_mask_and_positions, check_token_inputs, default_position_ids
from .halting_loopformer import LoopFormerHaltingState
from .hub import LoopFormerHubMixin


# `rms_norm_eps=None`: torch's default eps for a float32 input, which the reference's norms see (float32 weights and
# residual stream, also under its bf16 autocast). Taken from the input dtype instead, a bf16 model would add 7.8e-3
# (fp16: 9.8e-4) to the mean square and compute another function.
DEFAULT_RMS_NORM_EPS = torch.finfo(torch.float32).eps


def rms_norm(x, weight=None, eps=None):
    """RMSNorm in float32; `eps=None` is `DEFAULT_RMS_NORM_EPS` whatever the dtype of `x`."""
    eps = DEFAULT_RMS_NORM_EPS if eps is None else eps
    if weight is not None and weight.dim() > 1:  # one weight per token (a halting rule's exit step): norm, then weight
        return rms_norm(x, None, eps) * weight.to(x.dtype)
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # no casts: each is a dispatch per block and token
    return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps).to(x.dtype)


class LoopFormerRMSNorm(nn.Module):
    """RMSNorm with a learnable weight (the final norm; the block norms with `block_norm_weight`) or without one."""

    def __init__(self, hidden_size, eps=None, weight=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if weight else None
        self.eps = eps

    def modulated_weight(self, scale):
        """The weight of RMSNorm(x)·(1 + `scale`): adaLN's scale is one vector per loop step, shared by every token,
        so it folds into the norm's weight (one fused norm instead of a norm and two elementwise ops)."""
        return 1 + scale if self.weight is None else self.weight * (1 + scale)

    def forward(self, x, weight=None):
        """RMSNorm(x) with the norm's own weight, or with `weight` (a loop step's `modulated_weight`)."""
        return rms_norm(x, self.weight if weight is None else weight, self.eps)


class LoopFormerRotaryEmbedding(nn.Module):
    """Llama's: `config.rope_parameters` gives the frequencies (transformers' RoPE types) and the rotated share."""
    def __init__(self, config):
        super().__init__()
        self.config, self.rope_type = config, config.rope_parameters["rope_type"]
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        inv_freq, self.attention_scaling = self.frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def frequencies(self, config):
        """(inverse frequencies, attention scaling) of `config.rope_parameters`: a scaled RoPE type, or plain RoPE."""
        if self.rope_type != "default":
            return ROPE_INIT_FUNCTIONS[self.rope_type](config)
        dim = config.rotary_dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @dynamic_rope_update  # "dynamic" and "longrope" recompute the frequencies for long inputs
    def forward(self, x, position_ids):
        """(cos, sin), each (batch, seq, rotary_dim), as Llama's."""
        emb = torch.cat([position_ids[..., None].float() * self.inv_freq.to(x.device)] * 2, dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    """RoPE on the first `cos.shape[-1]` channels of each head; the rest (partial_rotary_factor < 1) pass."""
    if cos.shape[-1] == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    return torch.cat((apply_rotary(x[..., : cos.shape[-1]], cos, sin), x[..., cos.shape[-1]:]), dim=-1)


def repeat_kv(hidden_states, n_rep):
    if n_rep == 1:
        return hidden_states
    b, h, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None:
        q_len, kv_len = scores.shape[-2:]
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril(kv_len - q_len)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + attention_mask
    # at least float32 (as Llama) but never below the scores' own precision: float64's min would become -inf
    weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class LoopFormerAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.o_proj.residual_projection = True  # scaled init (see `_init_weights`)

    def project_kv(self, hidden_states, position_embeddings):
        """Keys (rotated) and values of `hidden_states`, (batch, kv heads, seq, head_dim)."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None:
            k = apply_rotary(k, *position_embeddings)
        return k, v

    def forward(self, hidden_states, attention_mask, position_embeddings, cache=None, cache_slot=0,
                output_attentions=False, halting=None):
        """Returns the attention output, its weights (eager only) and this call's own (keys, values). With `halting`
        (a [`LoopFormerHaltingStep`]), only the tokens it computes query (the output is theirs); every token still
        gets its keys and values."""
        queries = hidden_states if halting is None else halting.gather(hidden_states)
        query_positions = position_embeddings if halting is None else halting.gather_positions(position_embeddings)
        input_shape = queries.shape[:-1]
        q = self.q_proj(queries).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if query_positions is not None:
            q = apply_rotary(q, *query_positions)
        if halting is None:
            new_kv = k, v = self.project_kv(hidden_states, position_embeddings)
        else:
            new_kv = k, v = halting.keys_values(self.project_kv, hidden_states, position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, cache_slot)
        if halting is not None:
            k, v, attention_mask = halting.attended(k, v, attention_mask, hidden_states.shape[1])

        attention_interface = eager_attention_forward
        if self.config._attn_implementation not in (None, "eager") and not output_attentions:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
        out, weights = attention_interface(
            self, q, k, v, attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
        )
        return self.o_proj(out.reshape(*input_shape, -1)), weights, new_kv


class LoopFormerMLP(nn.Module):
    """GELU MLP (reference) or, with ``hidden_act="swiglu"``, a gated SiLU MLP."""

    def __init__(self, config):
        super().__init__()
        bias = config.mlp_bias
        self.gated = config.hidden_act == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.down_proj.residual_projection = True  # scaled init (see `_init_weights`)
        self.act_fn = ACT2FN["silu" if self.gated else config.hidden_act]

    def forward(self, x):
        if self.gated:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act_fn(self.up_proj(x)))


class LoopFormerTimestepEmbedder(nn.Module):
    """Sinusoidal features of a scalar (width `frequency_embedding_size`, order [cos, sin]) → Linear → SiLU → Linear."""

    def __init__(self, config):
        super().__init__()
        self.frequency_embedding_size = config.frequency_embedding_size
        self.max_period = config.max_period
        self.mlp = nn.Sequential(
            nn.Linear(config.frequency_embedding_size, config.hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(config.hidden_size, config.hidden_size, bias=True),
        )

    def forward(self, t, dtype):
        half = self.frequency_embedding_size // 2
        freqs = torch.exp(-math.log(self.max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if self.frequency_embedding_size % 2:
            features = F.pad(features, (0, 1))
        # the dtype the model computes in, not the first weight's: a quantised Linear stores int8 (or packs it)
        return self.mlp(features.to(dtype))


class LoopFormerLoopConditioning(nn.Module):
    """The vector c of each loop step, shared by every token and every block of that step.

    shortcut (LoopFormer): c_i = TimeEmb(t_{i-1}) + StepEmb(Δ_i), t_{i-1} = Δ_1 + ... + Δ_{i-1}
    timestep (TMLT):       c_i = TimeEmb(i - 1), the integer loop index
    none (Base-Loop):      no conditioning
    """

    def __init__(self, config):
        super().__init__()
        self.mode = config.loop_conditioning
        if self.mode != "none":
            self.time_embedder = LoopFormerTimestepEmbedder(config)
        if self.mode == "shortcut":
            self.dt_embedder = LoopFormerTimestepEmbedder(config)

    def forward(self, trajectory, device, dtype):
        """(M, d) conditioning vectors (in `dtype`) for the step sizes `trajectory`, or None without conditioning.
        Per-row trajectories, `trajectory` a (batch, M) tensor of step sizes (0 after a row's last step): (batch, M, d)
        for "shortcut"; "timestep" gives (M, d), the loop index being every row's own."""
        if self.mode == "none":
            return None
        dt = (trajectory.to(device=device, dtype=torch.float64) if isinstance(trajectory, torch.Tensor) else
              torch.tensor(trajectory, device=device, dtype=torch.float64))
        if self.mode == "timestep":
            return self.time_embedder(torch.arange(dt.shape[-1], device=device, dtype=torch.float32), dtype)
        t = torch.cumsum(dt, -1) - dt  # each row's time at the start of each of its steps
        return (self.time_embedder(t.flatten().float(), dtype) + self.dt_embedder(dt.flatten().float(), dtype)).view(
            *dt.shape, -1)


class LoopFormerBlock(GradientCheckpointingLayer):
    """x = x + gate_attn·Attn(RMSNorm(x)·(1 + scale_attn)); x = x + gate_mlp·MLP(RMSNorm(x)·(1 + scale_mlp)).

    Without conditioning (Base-Loop) there is no adaLN: gates are 1 and scales 0, i.e. a plain pre-norm block.
    The two norms carry a learnable weight only with `config.block_norm_weight` (the reference's Base-Loop and Base).
    """

    def __init__(self, config):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = LoopFormerRMSNorm(config.hidden_size, config.rms_norm_eps, config.block_norm_weight)
        self.self_attn = LoopFormerAttention(config)
        self.post_attention_layernorm = LoopFormerRMSNorm(
            config.hidden_size, config.rms_norm_eps, config.block_norm_weight
        )
        self.mlp = LoopFormerMLP(config)
        if config.loop_conditioning != "none":
            # order of the chunks: gate_attn, gate_mlp, scale_attn, scale_mlp (no shift), as the reference
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(config.hidden_size, 4 * config.hidden_size))
            self.adaLN_modulation[1].zero_init = True  # zeroed by initializer_scheme="zero_adaln" only

    def adaln(self, modulation):
        """adaLN's vectors as this block applies them, from `modulation` = adaLN_modulation(c) (..., 4d): (gate_attn,
        gate_mlp, the attention norm's weight, the MLP norm's weight), the scales folded into the norms' weights."""
        gate_attn, gate_mlp, scale_attn, scale_mlp = modulation.chunk(4, dim=-1)
        return (gate_attn, gate_mlp, self.input_layernorm.modulated_weight(scale_attn),
                self.post_attention_layernorm.modulated_weight(scale_mlp))

    def forward(self, hidden_states, conditioning=None, attention_mask=None, position_embeddings=None, cache=None,
                cache_slot=0, output_attentions=False, adaln=None, halting=None):
        """One block at the loop step whose conditioning vector is `conditioning` (d,). `adaln` is `self.adaln` of
        that step when the caller has it already (at inference the loop computes every step's once). With per-token
        halting, `halting` (a [`LoopFormerHaltingStep`]) says which tokens are frozen: they keep their state, and
        only the others are computed.

        Returns (hidden_states, attention weights, this call's (keys, values)).
        """
        if adaln is None and conditioning is not None:  # as a (1, d) row: a quantised Linear takes no 1-D input
            adaln = self.adaln(self.adaLN_modulation(conditioning[None])[0].to(hidden_states.dtype))
        weight_attn = weight_mlp = None
        if adaln is not None:
            gate_attn, gate_mlp, weight_attn, weight_mlp = adaln
        normed = self.input_layernorm(hidden_states, weight_attn)
        attn_out, attn_weights, kv = self.self_attn(
            normed, attention_mask, position_embeddings, cache=cache, cache_slot=cache_slot,
            output_attentions=output_attentions, halting=halting,
        )
        residual = hidden_states
        if halting is not None:
            hidden_states = halting.gather(hidden_states)
            if adaln is not None:  # per-row vectors: those of the rows computed
                gate_attn, gate_mlp, weight_mlp = halting.gather_adaln((gate_attn, gate_mlp, weight_mlp))
        # x + gate·f(x) as one addcmul
        hidden_states = hidden_states + attn_out if adaln is None else hidden_states.addcmul(gate_attn, attn_out)
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states, weight_mlp))
        hidden_states = hidden_states + mlp_out if adaln is None else hidden_states.addcmul(gate_mlp, mlp_out)
        if halting is not None:
            hidden_states = halting.merge(residual, hidden_states)
        return hidden_states, attn_weights, kv

    def frozen_kv(self, frozen, position_embeddings, adaln, num_steps):
        """The (keys, values) a frozen (halted) state gives this block's attention at each of `num_steps` loop steps
        whose `self.adaln` vectors are the list `adaln` (None without conditioning, where every step sees the same
        pair). All steps are projected in one batched call."""
        if adaln is None:
            return [self.self_attn.project_kv(self.input_layernorm(frozen), position_embeddings)] * num_steps
        # the block's own modulated norm per step (the same rounding as `forward`), side by side along the sequence:
        # (batch, steps * seq, d)
        x = torch.cat([self.input_layernorm(frozen, weight_attn) for _, _, weight_attn, _ in adaln], dim=1)
        pos = None if position_embeddings is None else tuple(p.repeat(1, 1, num_steps, 1) for p in position_embeddings)
        k, v = self.self_attn.project_kv(x, pos)
        return list(zip(k.chunk(num_steps, dim=2), v.chunk(num_steps, dim=2)))


def _safetensors_opens(path):
    try:
        return safe_open(path, framework="pt") is not None
    except SafetensorError:
        return False


class LoopFormerPreTrainedModel(LoopFormerHubMixin, PreTrainedModel):  # the mixin: push_to_hub writes this package's card
    config_class = LoopFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LoopFormerBlock"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # A fixed trajectory (no `halt_eps`, whose halting reads tensor values) traces as one graph per trajectory.
    _can_compile_fullgraph = True

    # Other checkpoint layouts (the authors' Hub repos) register a loader here, `load(cls, path, args, kwargs)` -> a
    # model or None (`loopformer_hf/__init__.py`): this module imports none, so a saved folder's copy carries none.
    checkpoint_loaders = []

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`; weights that are not safetensors (a renamed pickle, a truncated download)
        are an OSError naming the file, not safetensors' bare "Error while deserializing header" (as Llama's). A repo
        in another registered layout (the authors' Hub repos) is loaded by its `checkpoint_loaders` entry."""
        for load in LoopFormerPreTrainedModel.checkpoint_loaders:
            if (model := load(cls, pretrained_model_name_or_path, args, kwargs)) is not None:
                return model
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as e:
            folder = str(pretrained_model_name_or_path)
            bad = [f for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))) if not _safetensors_opens(f)]
            raise OSError(
                f"{', '.join(map(repr, bad)) or f'a weights file of {folder!r}'} is not a safetensors file "
                f"(safetensors: {e}). Nothing was loaded from it, and pickles are never unpickled here: re-save the "
                f"model with `save_pretrained`, or give the folder it was saved to."
            ) from None

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        adjusted = super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)
        # Paged attention reads a paged cache (continuous batching), which has no slot per (loop step, block).
        if isinstance(adjusted, str) and adjusted.startswith("paged"):
            raise ValueError(
                f"LoopFormer does not support attn_implementation={attn_implementation!r}: paged attention needs a "
                f"paged cache, which has no slot per (loop step, block). Use \"sdpa\" or \"eager\"."
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
            init.normal_(module.weight, mean=0.0,
                         std=self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers))
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

    def _embed(self, input_ids, inputs_embeds):
        check_token_inputs(input_ids, inputs_embeds, self.config.vocab_size, self.config.hidden_size,
                           self.embed_tokens.weight.dtype)
        return inputs_embeds if input_ids is None else self.embed_tokens(input_ids)

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
            loop_adaln = [[tuple(v[:, i, None] if per_row else v[i] for v in vectors)
                           for i in range(rows.num_steps if per_row else plan.spec.loop_steps)] for vectors in per_block]
        if keep:
            cache.keep_adaln(key, loop_adaln)
        return loop_adaln

    def _loop_step(self, step, hidden_states, conditioning, loop_adaln, mask, position_embeddings, cache, halting,
                   output_attentions, final=False):
        """Loop step `step` (the budget's last if `final`) through the k blocks: (new state, the step's attention maps,
        halting state after it)."""
        halted, active = (None, None) if halting is None else halting.next_step(
            hidden_states.shape[-1], gather=not output_attentions)
        c = None if conditioning is None else conditioning[step]
        previous, attentions = hidden_states, ()
        for j, block in enumerate(self.layers):
            adaln = None if loop_adaln is None or c is not None else loop_adaln[j][step]
            if halting is not None and halting.exiting is not None:  # tokens taking a halting rule's exit step
                adaln = halting.exit_step_adaln(j, step, loop_adaln[j][step])
            hidden_states, weights, kv = block(
                hidden_states, c,
                adaln=adaln,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                cache=cache,
                cache_slot=cache.slot(step, j) if cache is not None else 0,
                output_attentions=output_attentions,
                halting=None if halting is None else halting.block_step(j, halted, active),
            )
            if halting is not None:
                halting.last_kv[j] = kv
            attentions += (weights,)
        if halting is not None:
            halting = halting.update(previous, hidden_states, final)
        return hidden_states, attentions, halting

    def _prepare_inputs(self, inputs_embeds, attention_mask, position_ids, cache):
        """(hidden states with learned positions added, rotary (cos, sin) or None, attention mask) of a call whose
        inputs and mask are checked against the cache's length."""
        (batch, q_len), device = inputs_embeds.shape[:2], inputs_embeds.device
        if cache is not None and not torch.compiler.is_compiling():
            cache.check_batch_size(batch)
        past_len, kv_len = cache.mask_lengths(q_len) if cache is not None else (0, q_len)
        check_mask_and_positions(attention_mask, position_ids, batch, q_len, kv_len)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, batch, q_len, past_len, device)
        position_ids = position_ids.expand(batch, q_len)  # (1, q_len) is shared by the batch, as in Llama
        mask = attention_mask_for(self.config, inputs_embeds, attention_mask, position_ids, cache, past_len)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(inputs_embeds.dtype)  # additive: sdpa needs the queries' dtype
        hidden_states, position_embeddings = self._add_positions(inputs_embeds, position_ids)
        return hidden_states, position_embeddings, mask

    def _loop(self, plan, hidden_states, mask, position_embeddings, cache, halt_head, output_attentions,
              output_hidden_states):
        """The loop along `plan.trajectory`: (final state, states after each step or None, attentions or None,
        the halting state or None)."""
        trajectory, num_steps, halting = plan.trajectory, plan.spec.loop_steps, None
        if plan.halt_eps is not None or plan.rows is not None:  # per-row budgets halt a row after its last step
            readout = None if halt_head is None else (
                lambda h: F.log_softmax(halt_head(self.norm(h)).float(), dim=-1))
            halting = LoopFormerHaltingState.start(plan.halt_eps, self.config, hidden_states, plan.halt_criterion,
                                                   readout, plan.rows)
        # With gradients on, each block computes its adaLN vectors inside its own forward from the step's conditioning,
        # passed positionally: FSDP gathers a block's weights only there, and reentrant checkpointing tracks only
        # positional tensors. At inference (and per row) they are computed once for every step (kept on the cache).
        dtype, device = hidden_states.dtype, hidden_states.device
        conditioning = None
        if torch.is_grad_enabled() and plan.rows is None:
            conditioning = self.loop_conditioning(trajectory, device, dtype)
        loop_adaln = None
        if conditioning is None or halting is not None:  # halting fills skipped slots from the per-block vectors
            loop_adaln = self._loop_adaln(plan, dtype, device, cache)
        if halting is not None and plan.rows is None:
            halting.prepare_exits(self, trajectory, loop_adaln, cache)
            hidden_states = halting.run_probe(self.layers, hidden_states, mask, position_embeddings, cache)
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for step in range(num_steps):
            if halting is not None and halting.all_halted():  # no block runs any more
                halting.fill_skipped_slots(cache, self.layers, hidden_states, position_embeddings, loop_adaln, step)
                if output_hidden_states:
                    all_hidden_states += (hidden_states,) * (num_steps - step)
                break
            hidden_states, attentions, halting = self._loop_step(
                step, hidden_states, conditioning, loop_adaln, mask, position_embeddings, cache, halting,
                output_attentions, final=step == num_steps - 1,
            )
            if output_attentions:
                all_attentions += attentions
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        if halting is not None:  # "probe_entropy": the tokens sure after the probe step keep its output
            hidden_states = halting.final_states(hidden_states)
        return hidden_states, all_hidden_states, all_attentions, halting

    # ---- forward -------------------------------------------------------------------------------------------------

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, loop_budget=None, step_schedule=None, halt_eps=None, halt_criterion=None,
                halt_head=None, **kwargs: Unpack[TransformersKwargs]):
        r"""
        loop_budget (`int`, list of `int` or 1-D integer tensor, *optional*): number of loop steps M (defaults to the
            config's), or one per row: the loop runs the largest, and a row's tokens freeze after its own last step.
        step_schedule (`str` or list of `float`, *optional*): step sizes Δ_1..Δ_M summing to 1, or a preset name
            ("uniform", "coarse_to_fine", "fine_to_coarse"); or a list of one per row (`None`: that row's default).
        halt_eps (`float`, *optional*): adaptive depth per token: a token stops looping once its `halt_criterion`
            score falls below halt_eps, never beyond the budget; `loop_counts` reports the steps. Halted tokens are
            left out of the later steps' computation (their keys and values are still filled).
        halt_criterion (`str`, *optional*): "state_change" (default: `config.halt_criterion`), "kl" or "entropy";
            see [`LoopFormerConfig`]. The last two need `halt_head`.
        halt_head (`nn.Module`, *optional*): the LM head the "kl" and "entropy" criteria read next-token
            distributions through (after the final norm); [`LoopFormerForCausalLM`] passes its `lm_head`.
        `hidden_states` (with `output_hidden_states=True`, a keyword as for Llama) holds the embeddings followed by the
        residual stream after each loop step: M + 1 tensors. `attentions` (`output_attentions=True`) holds one tensor
        per (loop step, block). `return_dict=False` gives a tuple; `past_key_values` is `cache`'s former name.
        """
        output_attentions, output_hidden_states = (
            kwargs.get(name) if kwargs.get(name) is not None else getattr(self.config, name)
            for name in ("output_attentions", "output_hidden_states"))
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        cache = cache_argument(cache, kwargs.get("past_key_values"), type(self).__name__)
        inputs_embeds = self._embed(input_ids, inputs_embeds)
        plan = LoopFormerPlan.for_call(self.config, cache, loop_budget, step_schedule, halt_eps, halt_criterion,
                                       batch_size=inputs_embeds.shape[0])
        # As Llama: `use_cache` decides whether to start a cache; one passed in is filled whatever it says (gradient
        # checkpointing in training uses none: recomputed blocks would write it twice).
        checkpointing = self.gradient_checkpointing and self.training
        cache = None if checkpointing or not (use_cache or cache is not None) else LoopFormerCache.for_call(cache, plan)
        hidden_states, position_embeddings, mask = self._prepare_inputs(inputs_embeds, attention_mask, position_ids, cache)
        hidden_states, all_hidden_states, all_attentions, halting = self._loop(
            plan, hidden_states, mask, position_embeddings, cache, halt_head, output_attentions, output_hidden_states)
        output = LoopFormerModelOutput(
            last_hidden_state=self.norm(hidden_states), hidden_states=all_hidden_states, attentions=all_attentions,
            loop_counts=None if plan.halt_eps is None else halting.loop_counts, **{CACHE_FIELD: cache},
        )
        return as_requested(output, kwargs.get("return_dict"), self.config)


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

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, loop_budget=None, step_schedule=None, halt_eps=None,
                halt_criterion=None, shortcut_consistency=None, **kwargs: Unpack[TransformersKwargs]):
        r"""
        labels (`torch.LongTensor`, *optional*): next-token targets (shifted inside), -100 is ignored.
        shift_labels (`torch.LongTensor`, *optional*, a keyword as for Llama): targets already aligned with the
            positions (the authors' windows: T tokens train T targets); a keyword, so `label_names` stay `["labels"]`.
        loop_budget, step_schedule, halt_eps, halt_criterion: the loop, as for [`LoopFormerModel.forward`]; also
            `generate` kwargs. With `halt_eps`, the output's `loop_counts` holds the loop steps each token ran.
        shortcut_consistency ([`ShortcutConsistency`], *optional*): with `labels`, train with LoopFormer's
            shortcut-consistency objective: the same inputs also run its short trajectory and
            `loss = CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)`, its terms in `ce_full`, `ce_short`,
            `consistency`. In a Trainer, looped_training's ShortcutConsistencyCallback passes one to each training
            forward with labels.
        `output_attentions`, `output_hidden_states`, `return_dict` and `past_key_values` are keywords, as for Llama.
        """
        shortcut_consistency = check_shortcut_consistency(shortcut_consistency, kwargs, labels)
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                        "inputs_embeds": inputs_embeds}
        outputs = self.model(
            **model_inputs, cache=cache, use_cache=use_cache, loop_budget=loop_budget, step_schedule=step_schedule,
            halt_eps=halt_eps, halt_criterion=halt_criterion, halt_head=self.lm_head, **{**kwargs, "return_dict": True},
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss, terms = self._loss(logits, hidden_states, model_inputs, labels, shortcut_consistency, kwargs)
        output = LoopFormerCausalLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            loop_counts=outputs.loop_counts, **terms, **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)})
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
            return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      **loss_kwargs), {}
        objective = shortcut_consistency
        short = self.model(**model_inputs, step_schedule=list(objective.short_step_schedule), use_cache=False,
                           return_dict=True)
        loss, terms, _ = shortcut_consistency_loss(
            logits, hidden_states, self.lm_head(short.last_hidden_state), short.last_hidden_state, labels,
            objective.lambda_short, objective.lambda_consistency, objective.consistency_loss,
            kwargs.get("num_items_in_batch"), shift_labels,
        )
        return loss, terms

    def save_pretrained(self, *args, **kwargs):
        """As `PreTrainedModel.save_pretrained`; loop knobs set on `generation_config` are written to
        generation_config.json and come back on load."""
        generation_config = getattr(self, "generation_config", None)
        if generation_config is not None and any(
            getattr(generation_config, name, None) is not None for name in GENERATION_LOOP_KNOBS
        ):
            # A generation config marked as derived from the model config loses its custom fields when loaded.
            generation_config._from_model_config = False
        return super().save_pretrained(*args, **kwargs)


__all__ = ["LoopFormerPreTrainedModel", "LoopFormerModel", "LoopFormerForCausalLM"]
