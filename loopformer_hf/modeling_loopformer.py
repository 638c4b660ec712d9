"""LoopFormer: k shared transformer blocks looped along a trajectory of M steps, each step conditioned on its
normalised time t and step size Δ (Jeddi et al., ICLR 2026). Reads top to bottom in the order a token travels:
norm → positions → attention → MLP → loop conditioning (t, Δ) → modulated block → the loop → head.

KV cache: every (loop step i, block j) pair attends to its own keys and values; [`LoopFormerCache`] (or the
preallocated [`LoopFormerStaticCache`], cache_loopformer.py) holds one slot per pair and refuses a trajectory other
than the one that filled it.
"""

import functools
import math
import numbers
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from transformers.activations import ACT2FN
from transformers.generation import (GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput, GenerationMixin,
                                     UnbatchedClassifierFreeGuidanceLogitsProcessor)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils import logging

from .cache_loopformer import LoopFormerCache, LoopFormerCacheSpec
from .configuration_loopformer import HALT_CRITERIA, LoopFormerConfig, check_halt_eps


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

    def project_kv(self, hidden_states, position_embeddings, reuse_kv=None, active=None):
        """Keys and values of `hidden_states`; rows where `reuse_kv=(halted, k, v)` is halted take the given ones
        (with `active`, only the active tokens are projected and written into a copy of those)."""
        if active is not None and reuse_kv is not None:
            k, v = self.project_kv(active.gather(hidden_states), active.gather_positions(position_embeddings))
            return active.scatter_heads(reuse_kv[1], k), active.scatter_heads(reuse_kv[2], v)
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            k = k * cos + rotate_half(k) * sin
        if reuse_kv is not None:
            halted, old_k, old_v = reuse_kv
            k = torch.where(halted[:, None, :, None], old_k, k)
            v = torch.where(halted[:, None, :, None], old_v, v)
        return k, v

    def forward(self, hidden_states, attention_mask, position_embeddings, cache=None, cache_slot=0,
                output_attentions=False, reuse_kv=None, active=None):
        """Returns the attention output, its weights (eager only) and this call's own (keys, values). With `active`
        (a [`LoopFormerActiveTokens`]), only the active tokens query (the output is theirs, gathered); every token
        still gets its keys and values."""
        queries = hidden_states if active is None else active.gather(hidden_states)
        query_positions = position_embeddings if active is None else active.gather_positions(position_embeddings)
        input_shape = queries.shape[:-1]
        q = self.q_proj(queries).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if query_positions is not None:
            cos, sin = query_positions
            q = q * cos + rotate_half(q) * sin
        new_kv = k, v = self.project_kv(hidden_states, position_embeddings, reuse_kv, active)
        if cache is not None:
            k, v = cache.update(k, v, cache_slot)
        if active is not None:
            k, v = active.gather_rows(k), active.gather_rows(v)
            attention_mask = active.gather_mask(attention_mask, hidden_states.shape[1], k.shape[2])

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
                cache_slot=0, output_attentions=False, halted=None, reuse_kv=None, adaln=None, active=None):
        """One block at the loop step whose conditioning vector is `conditioning` (d,). `adaln` is `self.adaln` of
        that step when the caller has it already (at inference the loop computes every step's once). With per-token
        halting (`halted`, a (batch, seq) bool mask), halted tokens keep their state; their keys/values for this slot
        come from that frozen state, or from `reuse_kv` (their last computed slot). With `active` (a
        [`LoopFormerActiveTokens`]), only the active tokens are computed.

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
            output_attentions=output_attentions, reuse_kv=reuse_kv, active=active,
        )
        residual = hidden_states
        if active is not None:
            hidden_states = active.gather(hidden_states)
        # x + gate·f(x) as one addcmul
        hidden_states = hidden_states + attn_out if adaln is None else hidden_states.addcmul(gate_attn, attn_out)
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states, weight_mlp))
        hidden_states = hidden_states + mlp_out if adaln is None else hidden_states.addcmul(gate_mlp, mlp_out)
        if active is not None:
            hidden_states = active.scatter(residual, hidden_states)
        elif halted is not None:
            hidden_states = torch.where(halted[..., None], residual, hidden_states)
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


# Halted tokens are skipped (gathered out) once the active ones fill at most this share of the (batch, seq) grid:
# below it the saved matmuls outweigh the gather/scatter copies (measured on CPU, benchmarks/bench_halting.py).
GATHER_ACTIVE_FRACTION = 0.75
# ... and only in a grid of at least this many (tokens x hidden_size) elements: the gather/scatter adds ~20 tensor
# ops per block and step whatever the size, which small grids do not win back (on CPU, widths 64-1024, it cost
# 5-34 % up to 8192 elements and saved 6-21 % from 16384 on: `python -m benchmarks.bench_halting --gather`).
GATHER_MIN_GRID = 64 * 256


class LoopFormerActiveTokens:
    """The tokens a loop step still computes under halting: row `rows[r]`'s active positions `index[r]`, padded to
    the longest row with halted positions (`valid` False; their results are dropped). Rows without an active token
    are left out, so batched decoding skips halted rows."""

    def __init__(self, active):
        counts = active.sum(-1)
        self.batch_size = active.shape[0]
        self.rows = counts.nonzero().squeeze(-1)
        width = int(counts.max())
        # a stable sort of "halted" puts each row's active positions first, in order
        self.index = torch.argsort((~active[self.rows]).to(torch.uint8), dim=-1, stable=True)[:, :width]
        self.valid = torch.arange(width, device=active.device) < counts[self.rows, None]
        self.flat_rows = self.rows[:, None].expand_as(self.index)[self.valid]
        self.flat_index = self.index[self.valid]

    @classmethod
    def worth_gathering(cls, active, num_active, hidden_size):
        """The gather plan for `active` ((batch, seq) bool, `num_active` of them True, states of width `hidden_size`)
        when it saves work, else None."""
        if active.numel() * hidden_size < GATHER_MIN_GRID:
            return None
        if num_active > GATHER_ACTIVE_FRACTION * active.numel():
            return None  # the padded plan holds at least every active token: not worth building it
        plan = cls(active)
        return plan if plan.index.numel() <= GATHER_ACTIVE_FRACTION * active.numel() else None

    def gather(self, x):
        """(batch, seq, ...) -> (rows, width, ...)."""
        return x[self.rows[:, None], self.index]

    def gather_positions(self, position_embeddings):
        """Rotary (cos, sin), (batch, 1, seq, head_dim) -> (rows, 1, width, head_dim)."""
        return None if position_embeddings is None else tuple(self.gather(p[:, 0])[:, None] for p in position_embeddings)

    def gather_rows(self, x):
        return x if len(self.rows) == self.batch_size else x[self.rows]

    def gather_mask(self, attention_mask, q_len, kv_len):
        """The rows of the (batch, 1, q_len, kv_len) mask the gathered queries use; None stands for plain causal."""
        if attention_mask is None:
            query_positions = kv_len - q_len + self.index  # the queries are the last q_len of the kv positions
            return (torch.arange(kv_len, device=self.index.device) <= query_positions[..., None])[:, None]
        attention_mask = attention_mask.expand(self.batch_size, *attention_mask.shape[1:])  # a 4D mask may broadcast
        return attention_mask[self.rows[:, None], 0, self.index][:, None]

    def scatter(self, x, part):
        """A copy of `x` (batch, seq, ...) with the valid entries of `part` (rows, width, ...) written back."""
        out = x.clone()
        out[self.flat_rows, self.flat_index] = part[self.valid]
        return out

    def scatter_heads(self, x, part):
        """As `scatter` for (batch, heads, seq, head_dim) tensors."""
        out = x.clone()
        out[self.flat_rows, :, self.flat_index] = part.transpose(1, 2)[self.valid]
        return out


def state_change_score(previous, hidden_states):
    """‖h_i − h_{i−1}‖∞ / (‖h_i‖∞ + 1e-8) per token, in float32: the "state_change" halting criterion."""
    delta, norm = (hidden_states - previous).abs().amax(-1), hidden_states.abs().amax(-1)
    if delta.dtype != torch.float32:  # after amax: abs and max are exact in any dtype
        delta, norm = delta.float(), norm.float()
    return delta / (norm + 1e-8)


def _halt_criterion(value):
    if value not in HALT_CRITERIA:
        raise ValueError(f"`halt_criterion` must be one of {HALT_CRITERIA}, got {value!r}.")
    return value


@dataclass
class LoopFormerHaltingState:
    """Per-token halting (`halt_eps`) carried through the loop, as `FPRMSolverState` is for FPRM's solver.

    `active` tokens keep looping; a halted token's state is frozen, and the cache slots it skips are filled
    (`halt_kv_fill`) so that later tokens can still attend to every slot. `criterion` says what `halt_eps`
    thresholds (see `update`). Updated in place, one loop step at a time.
    """

    halt_eps: float
    reuse_kv: bool  # halt_kv_fill == "reuse": skipped slots repeat the token's last computed keys/values
    active: torch.BoolTensor  # (batch, seq)
    num_active: int  # active.sum(), read once per step (one device sync) for every check of that step
    last_kv: list  # per block: the (keys, values) of the last step each token computed
    criterion: str = "state_change"
    readout: object = None  # h -> next-token log-probabilities ("kl", "entropy")
    log_probs: torch.Tensor | None = None  # (batch, seq, vocab) of the current state ("kl")
    # Loop steps every token ran (counted in Python while no token has halted), plus `partial_counts` (batch, seq):
    # the steps run since (decoding one token never needs a tensor for its count).
    steps_all_ran: int = 0
    partial_counts: torch.LongTensor | None = None

    @classmethod
    def start(cls, halt_eps, config, hidden_states, criterion="state_change", readout=None):
        batch_seq, device = hidden_states.shape[:2], hidden_states.device
        if criterion != "state_change" and readout is None:
            raise ValueError(
                f"halt_criterion={criterion!r} reads next-token distributions through the LM head: call "
                f"LoopFormerForCausalLM, or use halt_criterion='state_change' with LoopFormerModel."
            )
        return cls(halt_eps, config.halt_kv_fill == "reuse", torch.ones(batch_seq, dtype=torch.bool, device=device),
                   batch_seq.numel(), [None] * config.num_hidden_layers, criterion, readout,
                   readout(hidden_states) if criterion == "kl" else None)

    @property
    def loop_counts(self):
        """(batch, seq) loop steps each token ran."""
        counts = torch.full(self.active.shape, self.steps_all_ran, dtype=torch.long, device=self.active.device)
        return counts if self.partial_counts is None else counts + self.partial_counts

    def all_active(self):
        return self.num_active == self.active.numel()

    def halted(self):
        """(batch, seq) bool mask of frozen tokens, or None while every token is active."""
        return None if self.all_active() else ~self.active

    def all_halted(self):
        return self.num_active == 0

    def block_kwargs(self, block, halted):
        """What block `block` needs to keep halted tokens frozen at this step."""
        reuse = (halted, *self.last_kv[block]) if self.reuse_kv and halted is not None else None
        return {"halted": halted, "reuse_kv": reuse}

    def update(self, previous, hidden_states, final=False):
        """Advance past loop step i: the step counts for the tokens that ran it, and a token halts once
        - "state_change": ‖h_i − h_{i−1}‖∞ / (‖h_i‖∞ + 1e-8) < halt_eps;
        - "kl": KL(p_i ‖ p_{i−1}) < halt_eps, p the next-token distributions (p_0 from the embeddings);
        - "entropy": H(p_i) < halt_eps.
        After the `final` step of the budget no score is needed: only the counts advance."""
        if final:
            self._count_step()
            return self
        if self.criterion == "state_change":
            score = state_change_score(previous, hidden_states)
        else:
            log_probs = self.readout(hidden_states)
            if self.criterion == "kl":
                score = (log_probs.exp() * (log_probs - self.log_probs)).sum(-1)
                self.log_probs = log_probs
            else:
                score = -(log_probs.exp() * log_probs).sum(-1)
        self._count_step()
        if score.numel() == 1:  # one token (decoding): read its score, one sync, no mask arithmetic
            if score.item() < self.halt_eps:
                self.active, self.num_active = torch.zeros_like(self.active), 0
            return self
        still = ~(score < self.halt_eps)  # a NaN score keeps looping
        if not self.all_active():
            still &= self.active
        self.active = still
        self.num_active = int(still.sum())  # one sync per step
        return self

    def _count_step(self):
        """The active tokens ran one more step."""
        if self.all_active():
            self.steps_all_ran += 1
        else:
            self.partial_counts = self.active.long() if self.partial_counts is None else self.partial_counts + self.active

    def fill_skipped_slots(self, cache, blocks, frozen, position_embeddings, loop_adaln, first_step):
        """Every token has halted: write the cache slots of loop steps `first_step`.. at once (no-op without cache)."""
        if cache is None:
            return
        steps = range(first_step, len(cache.spec.trajectory))
        for j, block in enumerate(blocks):
            if self.reuse_kv:
                per_step = [self.last_kv[j]] * len(steps)
            else:
                adaln = None if loop_adaln is None else loop_adaln[j][first_step:]
                per_step = block.frozen_kv(frozen, position_embeddings, adaln, len(steps))
            for step, (k, v) in zip(steps, per_step):
                cache.write(k, v, cache.slot(step, j))


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


@dataclass
class LoopFormerGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`generate(..., return_dict_in_generate=True)` output; `loop_counts` (batch, length - 1): with `halt_eps`, the
    loop steps spent on each input position (position i produced token i + 1)."""

    loop_counts: torch.LongTensor | None = None


@dataclass
class LoopFormerGenerateBeamDecoderOnlyOutput(GenerateBeamDecoderOnlyOutput):
    """Beam-search `generate(..., return_dict_in_generate=True)` output; `loop_counts` (returned sequences,
    length - 1): with `halt_eps`, the loop steps spent on each position of each returned sequence, taken from the
    beam that held the sequence when the position was processed (position i produced token i + 1); 0 after a
    sequence that finished early."""

    loop_counts: torch.LongTensor | None = None


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

    def _cache_spec(self, trajectory, halt_eps, halt_criterion):
        halting = halt_eps is not None
        share_n = self.config.cache_share_n if self.config.cache_sharing == "modulo" else None
        return LoopFormerCacheSpec(tuple(trajectory), len(self.layers), halt_eps,
                                   self.config.halt_kv_fill if halting else None, share_n,
                                   halt_criterion if halting else None)

    def _loop_adaln(self, trajectory, dtype, device, cache):
        """`loop_adaln[j][i]`: block j's `adaln` vectors at loop step i (None without conditioning). They depend on
        the trajectory alone (c_i is a function of t and Δ), so they are computed once per call, for all steps at
        once, and kept on the cache for the later decode steps of an inference run."""
        keep = cache is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        key = (tuple(trajectory), dtype, str(device))
        kept = getattr(cache, "loop_adaln", None) if keep else None
        if kept is not None and kept[0] == key:
            return kept[1]
        conditioning = self.loop_conditioning(trajectory, device, dtype)
        loop_adaln = None
        if conditioning is not None:
            per_block = [block.adaln(block.adaLN_modulation(conditioning).to(dtype)) for block in self.layers]
            loop_adaln = [[tuple(v[i] for v in vectors) for i in range(len(trajectory))] for vectors in per_block]
        if keep:
            cache.loop_adaln = (key, loop_adaln)
        return loop_adaln

    def _loop_step(self, step, hidden_states, conditioning, loop_adaln, mask, position_embeddings, cache, halting,
                   output_attentions, final=False):
        """Loop step `step` (the budget's last if `final`) through the k blocks: (new state, the step's attention maps,
        halting state after it)."""
        halted = None if halting is None else halting.halted()
        active = None
        if halted is not None and not output_attentions:
            active = LoopFormerActiveTokens.worth_gathering(
                halting.active, halting.num_active, hidden_states.shape[-1])
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
                active=active,
                **(halting.block_kwargs(j, halted) if halting is not None else {}),
            )
            if halting is not None:
                halting.last_kv[j] = kv
            attentions += (weights,)
        if halting is not None:
            halting = halting.update(previous, hidden_states, final)
        return hidden_states, attentions, halting

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
        checkpointing = self.gradient_checkpointing and self.training
        trajectory = self.config.resolve_trajectory(loop_budget, step_schedule)
        halt_eps = check_halt_eps(halt_eps)
        halt_criterion = _halt_criterion(self.config.halt_criterion if halt_criterion is None else halt_criterion)

        inputs_embeds = self._embed(input_ids, inputs_embeds)
        (batch, q_len), device = inputs_embeds.shape[:2], inputs_embeds.device
        cache = _cache_argument(cache, past_key_values, type(self).__name__)
        # As Llama: `use_cache` decides whether to start a cache; one passed in is filled whatever it says (gradient
        # checkpointing in training uses none: recomputed blocks would write it twice).
        cache = None if checkpointing or not (use_cache or cache is not None) else (
            LoopFormerCache.for_call(cache, self._cache_spec(trajectory, halt_eps, halt_criterion)))
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

        # With gradients on, each block computes its adaLN vectors inside its own forward from the step's conditioning,
        # passed positionally: FSDP gathers a block's weights only there, and reentrant checkpointing tracks only
        # positional tensors. At inference they are computed once for every step (and kept on the cache).
        conditioning = self.loop_conditioning(trajectory, device, hidden_states.dtype) if torch.is_grad_enabled() else (
            None)
        loop_adaln = None
        if conditioning is None or halt_eps is not None:  # halting fills skipped slots from the per-block vectors
            loop_adaln = self._loop_adaln(trajectory, hidden_states.dtype, device, cache)
        halting = None
        if halt_eps is not None:
            readout = None if halt_head is None else (
                lambda h: F.log_softmax(halt_head(self.norm(h)).float(), dim=-1))
            halting = LoopFormerHaltingState.start(halt_eps, self.config, hidden_states, halt_criterion, readout)
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

        output = LoopFormerModelOutput(
            last_hidden_state=self.norm(hidden_states), hidden_states=all_hidden_states, attentions=all_attentions,
            loop_counts=None if halting is None else halting.loop_counts, **{CACHE_FIELD: cache},
        )
        return output if return_dict else output.to_tuple()


CONSISTENCY_LOSSES = ("mse", "kl")
# Loop knobs `generate` also reads from `generation_config` (call kwargs win), saved in generation_config.json.
GENERATION_LOOP_KNOBS = ("loop_budget", "step_schedule", "halt_eps", "halt_criterion")
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


def _loop_counts_unsupported(kwargs, generation_config):
    """The decoding mode under which per-position loop counts cannot be gathered, or None."""
    config = kwargs.get("generation_config") or generation_config

    def get(name):
        return kwargs[name] if name in kwargs else getattr(config, name, None)

    if get("prefill_chunk_size") is not None:
        return "chunked prefill (prefill_chunk_size)"
    return None


class LoopFormerForCausalLM(LoopFormerPreTrainedModel, GenerationMixin):
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

    # ---- generation ----------------------------------------------------------------------------------------------

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' hook for a model's own cache: `generate` builds a `DynamicCache` (or, with
        `cache_implementation="static"`, a `StaticCache`) with `num_hidden_layers` slots; a looped model needs one per
        (loop step, block), so it gets an empty `LoopFormerCache` (or `LoopFormerStaticCache`) instead."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        steps = len(self.config.resolve_trajectory(model_kwargs.get("loop_budget"), model_kwargs.get("step_schedule")))
        LoopFormerCache.replace_generate_default(model_kwargs, self.config, steps)

    def init_continuous_batching(self, *args, **kwargs):
        """Continuous batching (`generate_batch`, `init_continuous_batching`) is not supported: its paged cache has
        one slot per layer, where a looped model needs one per (loop step, block)."""
        raise NotImplementedError(
            "LoopFormer does not support continuous batching (generate_batch / init_continuous_batching): its paged "
            "cache has no slot per (loop step, block). Use `generate` with a padded batch (and "
            "`cache_implementation=\"static\"` for compiled decoding)."
        )

    def _get_logits_processor(self, *args, **kwargs):
        """transformers' hook that builds the logits processors. Classifier-free guidance (`guidance_scale`) runs a
        second, unconditional forward by calling the model with the ids alone: bind this call's loop knobs to it, so
        that both forwards run the same loop budget, schedule and halting."""
        processors = super()._get_logits_processor(*args, **kwargs)
        knobs = {name: value for name, value in (kwargs.get("model_kwargs") or {}).items()
                 if name in GENERATION_LOOP_KNOBS}
        for processor in processors:
            if isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor) and processor.model is self:
                processor.model = functools.partial(self, **knobs)
        return processors

    def _get_candidate_generator(self, *args, **kwargs):
        """transformers' hook that builds assisted decoding's drafter, which copies the call's model kwargs for an
        assistant model. The loop knobs (and this call's loop-count record) belong to this model: the assistant runs
        under its own `generation_config` (e.g. a LoopFormer draft with `generation_config.loop_budget = 1`)."""
        assistant = kwargs.get("assistant_model")
        if assistant is not None and assistant is not self and kwargs.get("model_kwargs") is not None:
            kwargs["model_kwargs"] = {name: value for name, value in kwargs["model_kwargs"].items()
                                      if name not in GENERATION_LOOP_KNOBS and name != "loop_counts_log"}
        return super()._get_candidate_generator(*args, **kwargs)

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

    def _prepare_generation_config(self, generation_config, *args, **kwargs):
        """transformers' hook that merges `generation_config` (the call's, then `self.generation_config`) with the call
        kwargs. A loop knob set on a `GenerationConfig` is stored there but is no model kwarg, so it would not reach
        `forward`; a call kwarg of the same name is absorbed into the config. Hand the merged value on to `forward`."""
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, *args, **kwargs)
        for name in GENERATION_LOOP_KNOBS:
            value = getattr(generation_config, name, None)
            if name not in model_kwargs and value is not None:
                model_kwargs[name] = value
        return generation_config, model_kwargs

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, loop_counts_log=None, **kwargs):
        """As `GenerationMixin`'s; `loop_counts_log` is this `generate` call's record of loop counts, not a model
        input: each forward adds an entry with the length of the sequence it is asked about (drafted tokens included)
        and, in `_update_model_kwargs_for_generation`, its loop counts and how many tokens were accepted."""
        if loop_counts_log is not None:
            loop_counts_log.append({"length": input_ids.shape[1]})
        return super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, num_new_tokens=1, **kwargs):
        log = model_kwargs.get("loop_counts_log")
        if log and getattr(outputs, "loop_counts", None) is not None:
            log[-1].update(counts=outputs.loop_counts, new_tokens=num_new_tokens)
        return super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, *args, num_new_tokens=num_new_tokens, **kwargs
        )

    @staticmethod
    def _gather_loop_counts(log, out, assisted):
        """(rows, length - 1) loop counts of the returned sequences from the per-forward records of `log`. Positions
        that a cache passed to `generate` already held count 0: this call ran no loop step for them."""
        log = [entry for entry in log if "counts" in entry]
        if not log:
            return None
        # positions before the first forward's first column (none for a prompt given as inputs_embeds: no ids)
        held = max(log[0]["length"] - log[0]["counts"].shape[1], 0)
        counts = LoopFormerForCausalLM._gathered_counts(log, out, assisted, held)
        return torch.cat([counts.new_zeros(counts.shape[0], held), counts], dim=1) if held else counts

    @staticmethod
    def _gathered_counts(log, out, assisted, held):
        """`_gather_loop_counts` from the first forward's first column on."""
        beam_indices = out.get("beam_indices") if not isinstance(out, torch.Tensor) else None
        if beam_indices is not None:
            # Beam search: the forward of step s ran on the beams as reordered after step s - 1; the token of step s
            # of a returned sequence came from beam row beam_indices[:, s] (-1 after the sequence finished).
            rows = beam_indices.long()
            columns = [log[0]["counts"][rows[:, 0].clamp(min=0)]]
            for step in range(1, rows.shape[1]):
                counts = log[step]["counts"][rows[:, step].clamp(min=0), -1]
                columns.append(torch.where(rows[:, step] >= 0, counts, torch.zeros_like(counts))[:, None])
            return torch.cat(columns, dim=1)
        if not assisted:
            # The first forward sees the prompt; every later one adds one position (the last column, cached or not).
            return torch.cat([log[0]["counts"]] + [entry["counts"][:, -1:] for entry in log[1:]], dim=1)
        # Assisted / prompt-lookup decoding: a forward scores the drafted tokens too; keep the columns of the
        # positions whose next token was accepted (the cache is cropped to the same positions).
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        length = sequences.shape[1] - sum(entry["new_tokens"] for entry in log)  # the prompt
        done, columns = held, []
        for entry in log:
            first = entry["length"] - entry["counts"].shape[1]  # position of the forward's first column
            last = length + entry["new_tokens"] - 2  # last position whose next token is now in the sequence
            columns.append(entry["counts"][:, done - first : last - first + 1])
            done, length = last + 1, length + entry["new_tokens"]
        return torch.cat(columns, dim=1)

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, plus `loop_budget`, `step_schedule` and `halt_eps` kwargs. The same three fields
        set on `generation_config` (or on `model.generation_config`, which `save_pretrained` writes to
        generation_config.json) are used when the call does not give them.

        With `halt_eps` and `return_dict_in_generate=True`, the output (a [`LoopFormerGenerateDecoderOnlyOutput`], or
        [`LoopFormerGenerateBeamDecoderOnlyOutput`] for beam search) carries `loop_counts`, a (returned sequences,
        length - 1) tensor: the loop steps spent on each position of each returned sequence (position i produced
        token i + 1). Greedy decoding, sampling, beam search (the counts follow the beams' reordering), assisted and
        prompt-lookup decoding (the counts of accepted tokens only); chunked prefill raises `ValueError` with
        `halt_eps`.
        """
        log = None
        given = kwargs.get("generation_config") or self.generation_config
        halt_eps = kwargs["halt_eps"] if "halt_eps" in kwargs else getattr(given, "halt_eps", None)
        if halt_eps is None and kwargs.get("generation_config") is not None:
            halt_eps = getattr(self.generation_config, "halt_eps", None)
        if halt_eps is not None:
            unsupported = _loop_counts_unsupported(kwargs, self.generation_config)
            if unsupported is not None:
                raise ValueError(
                    f"`halt_eps` with {unsupported} is not supported: the loop counts of each position are gathered "
                    f"for whole-prompt prefills only. Drop `prefill_chunk_size`, or drop `halt_eps`."
                )
            log = []  # local to this call: concurrent generate calls on one model each keep their own counts
        out = super().generate(*args, loop_counts_log=log, **kwargs)
        assisted = kwargs.get("assistant_model") is not None or (
            kwargs["prompt_lookup_num_tokens"] if "prompt_lookup_num_tokens" in kwargs
            else getattr(given, "prompt_lookup_num_tokens", None)
        ) is not None
        counts = self._gather_loop_counts(log, out, assisted) if log else None
        self._last_loop_counts = counts
        if counts is None or isinstance(out, torch.Tensor):
            return out
        if isinstance(out, GenerateBeamDecoderOnlyOutput):
            return LoopFormerGenerateBeamDecoderOnlyOutput(**out, loop_counts=counts)
        return LoopFormerGenerateDecoderOnlyOutput(**out, loop_counts=counts)

    @property
    def last_loop_counts(self):
        """Deprecated: the loop counts of this model's latest `generate` call (shared by every caller of the model).
        Use `generate(..., return_dict_in_generate=True).loop_counts`."""
        warnings.warn(
            "`last_loop_counts` is deprecated: use `generate(..., halt_eps=..., return_dict_in_generate=True)` and "
            "read `.loop_counts` from its output.", FutureWarning, stacklevel=2,
        )
        return getattr(self, "_last_loop_counts", None)


__all__ = [
    "LoopFormerPreTrainedModel",
    "LoopFormerModel",
    "LoopFormerForCausalLM",
    "LoopFormerGenerateDecoderOnlyOutput",
    "LoopFormerGenerateBeamDecoderOnlyOutput",
    "LoopFormerHaltingState",
    "LoopFormerActiveTokens",
]
