"""LoopFormer: k shared transformer blocks looped along a trajectory of M steps, each step conditioned on its
normalised time t and step size Δ (Jeddi et al., ICLR 2026). Reads top to bottom in the order a token travels:
norm → positions → attention → MLP → loop conditioning (t, Δ) → modulated block → the loop → head.

KV cache: every (loop step i, block j) pair attends to its own keys and values; [`LoopFormerCache`] (or the
preallocated [`LoopFormerStaticCache`], cache_loopformer.py) holds one slot per pair and refuses a trajectory other
than the one that filled it.
"""

import math
import numbers
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils import logging

from .cache_loopformer import LoopFormerCache, LoopFormerCacheSpec, LoopFormerPlan
from .configuration_loopformer import LoopFormerConfig, check_halt_eps
from .generation_loopformer import GENERATION_LOOP_KNOBS, LoopFormerGenerationMixin
from .halting_loopformer import LoopFormerHaltingState, _halt_criterion


logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache field `past_key_values` -> `cache`; support both releases.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _cache_argument(cache, past_key_values, owner):
    """`cache`, or its pre-5.24 name `past_key_values` (deprecated, as in transformers, where the field is `cache`)."""
    if past_key_values is None:
        return cache
    if CACHE_FIELD == "cache":
        warnings.warn(
            f"`past_key_values` is deprecated for `{owner}.forward`. Use `cache` instead.", FutureWarning, stacklevel=3
        )
    return cache if cache is not None else past_key_values


# `rms_norm_eps=None`: torch's default eps for a float32 input, which the reference's norms see (float32 weights and
# residual stream, also under its bf16 autocast). Taken from the input dtype instead, a bf16 model would add 7.8e-3
# (fp16: 9.8e-4) to the mean square and compute another function.
DEFAULT_RMS_NORM_EPS = torch.finfo(torch.float32).eps


def rms_norm(x, weight=None, eps=None):
    """RMSNorm in float32; `eps=None` is `DEFAULT_RMS_NORM_EPS` whatever the dtype of `x`."""
    if eps is None:
        eps = DEFAULT_RMS_NORM_EPS
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
    def __init__(self, config):
        super().__init__()
        self.register_buffer("inv_freq", self.compute_inv_freq(config), persistent=False)

    @staticmethod
    def compute_inv_freq(config):
        dim = config.head_dim
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def forward(self, x, position_ids):
        """(cos, sin), each (batch, 1, seq, head_dim): broadcast over the heads, shaped once per forward."""
        freqs = position_ids[:, None, :, None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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
            cos, sin = position_embeddings
            k = k * cos + rotate_half(k) * sin
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
            cos, sin = query_positions
            q = q * cos + rotate_half(q) * sin
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
        """(M, d) conditioning vectors (in `dtype`) for the step sizes `trajectory`, or None without conditioning."""
        if self.mode == "none":
            return None
        if self.mode == "timestep":
            return self.time_embedder(torch.arange(len(trajectory), device=device, dtype=torch.float32), dtype)
        dt = torch.tensor(trajectory, device=device, dtype=torch.float64)
        t = torch.cumsum(dt, 0) - dt  # time at the start of each step
        return self.time_embedder(t.float(), dtype) + self.dt_embedder(dt.float(), dtype)


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
        if adaln is None and conditioning is not None:
            adaln = self.adaln(self.adaLN_modulation(conditioning).to(hidden_states.dtype))
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


class LoopFormerPreTrainedModel(PreTrainedModel):
    config_class = LoopFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LoopFormerBlock"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # A fixed trajectory (no `halt_eps`, whose halting reads tensor values) traces as one graph per trajectory.
    _can_compile_fullgraph = True

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
            init.copy_(module.inv_freq, module.compute_inv_freq(self.config))
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
    """
    loop_counts (batch, seq): loop steps each token ran (only with `halt_eps`).
    ce_full, ce_short, consistency: with `labels` and `short_step_schedule`, the three terms of the shortcut-consistency
        objective: per-token CE of the full and of the short trajectory, and the consistency distance D (detached;
        `loss` combines them).
    """

    loop_counts: torch.LongTensor | None = None
    ce_full: torch.FloatTensor | None = None
    ce_short: torch.FloatTensor | None = None
    consistency: torch.FloatTensor | None = None


def _plan_request(config, loop_budget, step_schedule, halt_eps, halt_criterion):
    """A call's loop knobs, with the config fields they default to, as a tuple of plain values that a later call
    can be compared with (None when a knob is not such a value, e.g. a tensor: that call resolves its own plan)."""
    if step_schedule is not None and not isinstance(step_schedule, str):
        if not isinstance(step_schedule, (list, tuple)) or not all(type(s) in (int, float) for s in step_schedule):
            return None
        step_schedule = tuple(step_schedule)
    knobs = (loop_budget, halt_eps)
    if not all(k is None or type(k) in (int, float) for k in knobs) or not isinstance(halt_criterion, (str, type(None))):
        return None
    return (loop_budget, step_schedule, halt_eps, halt_criterion, config.num_loops, config.default_loop_budget,
            config.default_step_schedule, config.halt_criterion, config.halt_kv_fill, config.cache_sharing,
            config.cache_share_n, config.loop_conditioning, config.max_loop_budget_factor)


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

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # ---- masks and positions -------------------------------------------------------------------------------------

    def _attention_mask(self, attention_mask, batch, q_len, past_len, kv_len, device):
        """Boolean (batch, 1, q_len, kv_len) mask, True = may attend; None = plain causal. `kv_len` is past_len +
        q_len, or more with a static cache (its rows beyond are empty), whose `past_len` is a tensor."""
        static = isinstance(past_len, torch.Tensor)
        if attention_mask is not None and attention_mask.dim() == 4:
            return attention_mask
        if attention_mask is not None:
            if not torch.compiler.is_compiling() and attention_mask.shape != (batch, int(past_len) + q_len):
                raise ValueError(
                    f"`attention_mask` must have shape (batch, past + new tokens) = {(batch, int(past_len) + q_len)}, "
                    f"got {tuple(attention_mask.shape)}."
                )
            if not torch.compiler.is_compiling() and bool(attention_mask.all()):
                attention_mask = None
        if attention_mask is None and not static and (q_len == 1 or past_len == 0) and (
            self.config._attn_implementation == "sdpa"
        ):
            return None
        # query i sits at position past_len + i and sees keys 0..past_len + i
        causal = torch.arange(kv_len, device=device)[None] <= (torch.arange(q_len, device=device) + past_len)[:, None]
        mask = causal[None, None].expand(batch, 1, q_len, kv_len)
        if attention_mask is not None:
            padding = attention_mask.bool()
            if static:
                padding = torch.cat([padding, padding.new_zeros(batch, kv_len - padding.shape[1])], dim=1)
            mask = mask & padding[:, None, None, :]
            # Rows of pure padding would attend to nothing (NaN in sdpa): let them see everything; no real token
            # ever reads their output, since their keys are masked for all real queries.
            mask = mask | ~mask.any(dim=-1, keepdim=True)
        return mask

    @staticmethod
    def _check_mask_and_positions(attention_mask, position_ids, batch, q_len, kv_len):
        """transformers' conventions: a 2-D mask (batch, past + new tokens) of 0/1 (its shape is checked with the
        cache's length), a 4-D mask (batch or 1, 1, q_len, kv_len) bool (True = may attend) or float (added to the
        scores); position_ids integer (batch or 1, q_len), >= 0. Anything else raises `ValueError` here instead of
        running with shifted positions, adding an int 0/1 mask as if additive, or failing deep in torch."""
        compiling = torch.compiler.is_compiling()  # value checks read the tensor (a graph break): skipped there
        if attention_mask is not None:
            if not torch.is_tensor(attention_mask) or attention_mask.dim() not in (2, 4):
                raise ValueError(
                    f"`attention_mask` must be a 2-D (batch, tokens) 0/1 tensor or a 4-D (batch, 1, q_len, kv_len) "
                    f"bool or float tensor, got {type(attention_mask).__name__} "
                    f"{tuple(getattr(attention_mask, 'shape', ()))}."
                )
            if attention_mask.dim() == 4:
                if not (attention_mask.dtype == torch.bool or attention_mask.dtype.is_floating_point):
                    raise ValueError(
                        f"A 4-D `attention_mask` must be bool (True = may attend) or float (added to the attention "
                        f"scores: 0 to attend, a large negative such as torch.finfo(dtype).min not to), got "
                        f"{attention_mask.dtype}: an integer 0/1 mask would be added to the scores, not masked. Pass "
                        f"`mask.bool()`."
                    )
                if attention_mask.shape[0] not in (1, batch) or tuple(attention_mask.shape[1:]) != (1, q_len, kv_len):
                    raise ValueError(
                        f"A 4-D `attention_mask` must have shape (batch={batch} or 1, 1, q_len={q_len}, "
                        f"kv_len={kv_len}), got {tuple(attention_mask.shape)}."
                    )
            elif not compiling and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                other = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
                raise ValueError(
                    f"A 2-D `attention_mask` must hold only 0 (padding) and 1 (a token), got "
                    f"{other.unique()[:4].tolist()}: positions are counted from it. Pass a 4-D mask for anything else."
                )
        if position_ids is not None:
            if not (torch.is_tensor(position_ids) and not position_ids.dtype.is_floating_point
                    and not position_ids.dtype.is_complex and position_ids.dtype != torch.bool
                    and position_ids.dim() == 2 and position_ids.shape[0] in (1, batch)
                    and position_ids.shape[1] == q_len):
                raise ValueError(
                    f"`position_ids` must be an integer tensor of shape (batch={batch} or 1, new tokens={q_len}), "
                    f"got {type(position_ids).__name__} {tuple(getattr(position_ids, 'shape', ()))} "
                    f"{getattr(position_ids, 'dtype', '')}."
                )
            if not compiling and position_ids.numel() and int(position_ids.min()) < 0:
                raise ValueError(f"`position_ids` must be >= 0, got {int(position_ids.min())}.")

    def _position_ids(self, attention_mask, batch, q_len, past_len, device):
        if attention_mask is not None and attention_mask.dim() == 2:
            positions = attention_mask.long().cumsum(-1) - 1
            return positions.clamp(min=0)[:, -q_len:]
        return (torch.arange(q_len, device=device) + past_len)[None].expand(batch, q_len)

    def _embed(self, input_ids, inputs_embeds):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Give exactly one of `input_ids` or `inputs_embeds`.")
        given = input_ids if input_ids is not None else inputs_embeds
        if given.dim() < 2 or given.shape[0] == 0 or given.shape[1] == 0:
            name = "input_ids" if input_ids is not None else "inputs_embeds"
            raise ValueError(
                f"`{name}` must hold at least one sequence of at least one token, shape (batch >= 1, seq_len >= 1), "
                f"got shape {tuple(given.shape)}."
            )
        if input_ids is None:
            hidden, dtype = self.config.hidden_size, self.embed_tokens.weight.dtype
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden or inputs_embeds.dtype != dtype:
                raise ValueError(
                    f"`inputs_embeds` must be a {dtype} tensor of shape (batch, seq_len, hidden_size={hidden}) (what "
                    f"`get_input_embeddings()(input_ids)` gives), got {inputs_embeds.dtype} "
                    f"{tuple(inputs_embeds.shape)}."
                )
            return inputs_embeds
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"`input_ids` must be an integer tensor of token ids, got {input_ids.dtype}.")
        # checks read values (a graph break), so compiled graphs skip them
        if not torch.compiler.is_compiling() and input_ids.numel():
            low, high = (int(v) for v in torch.aminmax(input_ids))
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(
                    f"`input_ids` must lie in [0, {self.config.vocab_size - 1}], got values in [{low}, {high}]."
                )
        return self.embed_tokens(input_ids)

    def _add_positions(self, inputs_embeds, position_ids):
        """(hidden states, rotary (cos, sin) or None): learned positions are added, RoPE is applied in attention."""
        if self.config.position_embedding_type != "learned":
            return inputs_embeds, self.rotary_emb(inputs_embeds, position_ids)
        if not torch.compiler.is_compiling() and int(position_ids.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"Position {int(position_ids.max())} is beyond max_position_embeddings="
                f"{self.config.max_position_embeddings} (learned positions cannot extrapolate)."
            )
        return inputs_embeds + self.embed_positions(position_ids), None

    def _plan(self, cache, loop_budget, step_schedule, halt_eps, halt_criterion):
        """The call's [`LoopFormerPlan`]: the one `cache` holds if this call asks the same (a decode step of the
        call that filled it), else the knobs resolved and validated here."""
        request = _plan_request(self.config, loop_budget, step_schedule, halt_eps, halt_criterion)
        kept = getattr(cache, "plan", None)
        if request is not None and kept is not None and kept.request == request:
            return kept
        trajectory = self.config.resolve_trajectory(loop_budget, step_schedule)
        halt_eps = check_halt_eps(halt_eps)
        halt_criterion = _halt_criterion(self.config.halt_criterion if halt_criterion is None else halt_criterion)
        halting = halt_eps is not None
        share_n = self.config.cache_share_n if self.config.cache_sharing == "modulo" else None
        spec = LoopFormerCacheSpec(tuple(trajectory), len(self.layers), halt_eps,
                                   self.config.halt_kv_fill if halting else None, share_n,
                                   halt_criterion if halting else None)
        return LoopFormerPlan(request, spec)

    def _loop_adaln(self, trajectory, dtype, device, cache):
        """`loop_adaln[j][i]`: block j's `adaln` vectors at loop step i (None without conditioning). They depend on
        the trajectory alone (c_i is a function of t and Δ), so they are computed once per call, for all steps at
        once, and kept on the cache (`adaln_memo`) for the later decode steps of an inference run."""
        keep = cache is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        key = (tuple(trajectory), dtype, str(device))
        kept = cache.kept_adaln(key) if keep else None
        if kept is not None:
            return kept
        conditioning = self.loop_conditioning(trajectory, device, dtype)
        loop_adaln = None
        if conditioning is not None:
            per_block = [block.adaln(block.adaLN_modulation(conditioning).to(dtype)) for block in self.layers]
            loop_adaln = [[tuple(v[i] for v in vectors) for i in range(len(trajectory))] for vectors in per_block]
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
            hidden_states, weights, kv = block(
                hidden_states, c,
                adaln=None if loop_adaln is None or c is not None else loop_adaln[j][step],
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
        self._check_mask_and_positions(attention_mask, position_ids, batch, q_len, kv_len)
        if position_ids is None:
            position_ids = self._position_ids(attention_mask, batch, q_len, past_len, device)
        position_ids = position_ids.expand(batch, q_len)  # (1, q_len) is shared by the batch, as in Llama
        mask = self._attention_mask(attention_mask, batch, q_len, past_len, kv_len, device)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(inputs_embeds.dtype)  # additive: sdpa needs the queries' dtype
        hidden_states, position_embeddings = self._add_positions(inputs_embeds, position_ids)
        return hidden_states, position_embeddings, mask

    def _loop(self, plan, hidden_states, mask, position_embeddings, cache, halting, output_attentions,
              output_hidden_states):
        """The loop along `plan.trajectory`: (final state, states after each step or None, attentions or None)."""
        trajectory = plan.trajectory
        # With gradients on, each block computes its adaLN vectors inside its own forward from the step's conditioning,
        # passed positionally: FSDP gathers a block's weights only there, and reentrant checkpointing tracks only
        # positional tensors. At inference they are computed once for every step (and kept on the cache).
        dtype, device = hidden_states.dtype, hidden_states.device
        conditioning = self.loop_conditioning(trajectory, device, dtype) if torch.is_grad_enabled() else None
        loop_adaln = None
        if conditioning is None or halting is not None:  # halting fills skipped slots from the per-block vectors
            loop_adaln = self._loop_adaln(trajectory, dtype, device, cache)
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for step in range(len(trajectory)):
            if halting is not None and halting.all_halted():  # no block runs any more
                halting.fill_skipped_slots(cache, self.layers, hidden_states, position_embeddings, loop_adaln, step)
                if output_hidden_states:
                    all_hidden_states += (hidden_states,) * (len(trajectory) - step)
                break
            hidden_states, attentions, halting = self._loop_step(
                step, hidden_states, conditioning, loop_adaln, mask, position_embeddings, cache, halting,
                output_attentions, final=step == len(trajectory) - 1,
            )
            if output_attentions:
                all_attentions += attentions
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        return hidden_states, all_hidden_states, all_attentions

    # ---- forward -------------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        loop_budget=None,
        step_schedule=None,
        halt_eps=None,
        past_key_values=None,
        halt_criterion=None,
        halt_head=None,
        **kwargs,
    ):
        r"""
        loop_budget (`int`, *optional*): number of loop steps M (defaults to the config's).
        step_schedule (`str` or list of `float`, *optional*): step sizes Δ_1..Δ_M summing to 1, or a preset name
            ("uniform", "coarse_to_fine", "fine_to_coarse").
        halt_eps (`float`, *optional*): adaptive depth per token: a token stops looping once its `halt_criterion`
            score falls below halt_eps, never beyond the budget; `loop_counts` reports the steps. Halted tokens are
            left out of the later steps' computation (their keys and values are still filled).
        halt_criterion (`str`, *optional*): "state_change" (default: `config.halt_criterion`), "kl" or "entropy";
            see [`LoopFormerConfig`]. The last two need `halt_head`.
        halt_head (`nn.Module`, *optional*): the LM head the "kl" and "entropy" criteria read next-token
            distributions through (after the final norm); [`LoopFormerForCausalLM`] passes its `lm_head`.

        `hidden_states` (with `output_hidden_states=True`) holds the embeddings followed by the residual stream after
        each loop step: M + 1 tensors. `attentions` holds one tensor per (loop step, block).
        """
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = output_hidden_states if output_hidden_states is not None else (
            self.config.output_hidden_states)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        cache = _cache_argument(cache, past_key_values, type(self).__name__)
        plan = self._plan(cache, loop_budget, step_schedule, halt_eps, halt_criterion)
        inputs_embeds = self._embed(input_ids, inputs_embeds)
        # As Llama: `use_cache` decides whether to start a cache; one passed in is filled whatever it says (gradient
        # checkpointing in training uses none: recomputed blocks would write it twice).
        checkpointing = self.gradient_checkpointing and self.training
        cache = None if checkpointing or not (use_cache or cache is not None) else (
            LoopFormerCache.for_call(cache, plan))
        hidden_states, position_embeddings, mask = self._prepare_inputs(inputs_embeds, attention_mask, position_ids,
                                                                        cache)
        halting = None
        if plan.halt_eps is not None:
            readout = None if halt_head is None else (
                lambda h: F.log_softmax(halt_head(self.norm(h)).float(), dim=-1))
            halting = LoopFormerHaltingState.start(plan.halt_eps, self.config, hidden_states, plan.halt_criterion,
                                                   readout)
        hidden_states, all_hidden_states, all_attentions = self._loop(
            plan, hidden_states, mask, position_embeddings, cache, halting, output_attentions, output_hidden_states)
        output = LoopFormerModelOutput(
            last_hidden_state=self.norm(hidden_states), hidden_states=all_hidden_states, attentions=all_attentions,
            loop_counts=None if halting is None else halting.loop_counts, **{CACHE_FIELD: cache},
        )
        return output if return_dict else output.to_tuple()


CONSISTENCY_LOSSES = ("mse", "kl")
LOSS_KWARGS = ("num_items_in_batch", "ignore_index")  # what `forward` hands to `loss_function`


def _next_token_pairs(logits, labels, shift_labels=None):
    """(logits, targets) of next-token prediction: `labels` shifted by one, or `shift_labels` as given (one target
    per position, the last one the token after the window), as transformers' `ForCausalLMLoss` takes them."""
    if shift_labels is not None:
        return logits, shift_labels.to(logits.device)
    return logits[:, :-1], labels[:, 1:].to(logits.device)


def _token_ce_sum(logits, labels, shift_labels=None):
    """Sum of next-token cross-entropies over labelled positions, and their number."""
    logits, labels = _next_token_pairs(logits, labels, shift_labels)
    logits = logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return ce, int((labels != -100).sum())


def _check_consistency_args(lambda_short, lambda_consistency, consistency_loss):
    for name, value in (("lambda_short", lambda_short), ("lambda_consistency", lambda_consistency)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
    if consistency_loss not in CONSISTENCY_LOSSES:
        raise ValueError(f"`consistency_loss` must be one of {CONSISTENCY_LOSSES}, got {consistency_loss!r}.")


class LoopFormerForCausalLM(LoopFormerPreTrainedModel, LoopFormerGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # While a Trainer trains with looped_training's ShortcutConsistencyCallback: what a training forward with labels
    # and no `short_step_schedule` asks for its shortcut-consistency fields, and gives its terms to (for the logs).
    shortcut_objective = None

    def __init__(self, config: LoopFormerConfig):
        super().__init__(config)
        self.model = LoopFormerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep=0,
        loop_budget=None,
        step_schedule=None,
        halt_eps=None,
        short_step_schedule=None,
        lambda_short=0.1,
        lambda_consistency=0.1,
        consistency_loss="mse",
        past_key_values=None,
        halt_criterion=None,
        **kwargs,
    ):
        r"""
        labels (`torch.LongTensor`, *optional*): next-token targets (shifted inside), -100 is ignored.
        shift_labels (`torch.LongTensor`, *optional*, a keyword as for Llama): with `labels`, the targets already
            aligned with the positions (`shift_labels[:, i]` is the target of position i), as transformers' causal-LM
            loss takes them: a window of T tokens then trains T targets, its last one the token after the window
            (the authors' windows). Not a named argument, so that the Trainer's `label_names` stay `["labels"]`.
        loop_budget (`int`, *optional*): number of loop steps M; also a `generate` kwarg.
        step_schedule (`str` or list of `float`, *optional*): Δ_1..Δ_M summing to 1 or a preset name; also a
            `generate` kwarg.
        halt_eps (`float`, *optional*): per-token adaptive depth (see [`LoopFormerModel.forward`]); also a
            `generate` kwarg. The output's `loop_counts` holds the loop steps each token ran.
        halt_criterion (`str`, *optional*): what `halt_eps` thresholds: "state_change", "kl" or "entropy" (default
            `config.halt_criterion`; see [`LoopFormerConfig`]); also a `generate` kwarg.
        short_step_schedule (list of `float`, *optional*): with `labels`, train with LoopFormer's shortcut-consistency
            objective: the same inputs also run this short trajectory (steps summing to 1) and
            `loss = CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)`, its terms in `ce_full`, `ce_short`,
            `consistency`. In training, `shortcut_objective` (looped_training's ShortcutConsistencyCallback) gives
            it, and the λs and D, to each forward with labels that does not.
        lambda_short (`float`, defaults to 0.1): λ1, weight of CE on the short trajectory.
        lambda_consistency (`float`, defaults to 0.1): λ2, weight of the consistency term D.
        consistency_loss (`str`, defaults to `"mse"`): D: `"mse"` between the final normed hidden states (reference,
            mean over every element) or `"kl"`: KL(p_full || p_short) of the next-token distributions on labelled
            positions.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        shift_labels = kwargs.pop("shift_labels", None)
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                        "inputs_embeds": inputs_embeds}
        outputs = self.model(
            **model_inputs, cache=_cache_argument(cache, past_key_values, type(self).__name__), use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            loop_budget=loop_budget, step_schedule=step_schedule, halt_eps=halt_eps, halt_criterion=halt_criterion,
            halt_head=self.lm_head,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss, terms = None, {}
        if short_step_schedule is not None and labels is None:
            raise ValueError(
                "`short_step_schedule` is part of the shortcut-consistency loss and needs `labels` (a Trainer that "
                "computes the loss itself, e.g. with `label_smoothing_factor` or `compute_loss_func`, pops them): "
                "pass labels, or drop short_step_schedule."
            )
        objective = None
        if labels is not None and short_step_schedule is None and self.training:
            objective = self.shortcut_objective
        if objective is not None:
            fields = objective.training_forward_kwargs()
            short_step_schedule, lambda_short = fields["short_step_schedule"], fields["lambda_short"]
            lambda_consistency, consistency_loss = fields["lambda_consistency"], fields["consistency_loss"]
        if labels is not None and short_step_schedule is not None:
            _check_consistency_args(lambda_short, lambda_consistency, consistency_loss)
            short = self.model(**model_inputs, step_schedule=short_step_schedule, use_cache=False, return_dict=True)
            loss, terms, tokens = self._shortcut_consistency_loss(
                logits, hidden_states, self.lm_head(short.last_hidden_state), short.last_hidden_state, labels,
                lambda_short, lambda_consistency, consistency_loss, kwargs.get("num_items_in_batch"), shift_labels,
            )
            if objective is not None:
                objective.record_terms(**terms, tokens=tokens)
        elif labels is not None:
            loss_kwargs = {k: v for k, v in kwargs.items() if k in LOSS_KWARGS}
            if shift_labels is not None:
                loss_kwargs["shift_labels"] = shift_labels
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
        output = LoopFormerCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            loop_counts=outputs.loop_counts,
            **terms,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )
        return output if return_dict else output.to_tuple()

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


    @staticmethod
    def _shortcut_consistency_loss(logits, h_full, short_logits, h_short, labels, lambda_short, lambda_consistency,
                                   consistency_loss, num_items_in_batch=None, shift_labels=None):
        """CE_full + λ1·CE_short + λ2·D, normalised as the Trainer expects of a loss with `num_items_in_batch`: CE sums
        are divided by it (the tokens of the whole accumulated batch), the per-batch D is weighed by this batch's
        share of those tokens. Returns (loss, the three detached terms as per-token means, labelled tokens)."""
        ce_full_sum, n_local = _token_ce_sum(logits, labels, shift_labels)
        ce_short_sum, _ = _token_ce_sum(short_logits, labels, shift_labels)
        denom = n_local if num_items_in_batch is None else num_items_in_batch
        denom = torch.as_tensor(denom, device=ce_full_sum.device, dtype=torch.float32).clamp(min=1)
        if consistency_loss == "mse":
            consistency = F.mse_loss(h_short.float(), h_full.detach().float())
        else:
            short_logits, targets = _next_token_pairs(short_logits, labels, shift_labels)
            full_logits, _ = _next_token_pairs(logits, labels, shift_labels)
            mask = targets != -100
            log_p_short = F.log_softmax(short_logits[mask].float(), dim=-1)
            log_p_full = F.log_softmax(full_logits[mask].detach().float(), dim=-1)
            # mean over labelled positions ("batchmean"), 0 where there are none (batchmean would give 0/0)
            consistency = F.kl_div(log_p_short, log_p_full, log_target=True, reduction="sum") / max(n_local, 1)
        loss = ce_full_sum / denom + lambda_short * ce_short_sum / denom
        loss = loss + lambda_consistency * consistency * (n_local / denom)
        tokens = max(n_local, 1)
        terms = {"ce_full": ce_full_sum.detach() / tokens, "ce_short": ce_short_sum.detach() / tokens,
                 "consistency": consistency.detach()}
        return loss, terms, n_local


__all__ = ["LoopFormerPreTrainedModel", "LoopFormerModel", "LoopFormerForCausalLM"]
