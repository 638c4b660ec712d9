"""LoopFormer: k shared transformer blocks looped along a trajectory of M steps, each step conditioned on its
normalised time t and step size Δ (Jeddi et al., ICLR 2026). Baselines are configurations of the same model: TMLT
(conditioned on the loop index), Base-Loop (no conditioning), Base (not looped).

The file reads in the order a token travels: norm → rotary → attention → MLP → the t/Δ conditioning → the block →
the loop (embed → M steps of the k blocks → norm) → the causal LM and its loss. Per-token halting (`halt_eps`) runs
its own loop, in halting_loopformer.py; the shortcut-consistency objective's loss is loss_loopformer.py's.

Cache slots: loop step i (0-based) runs block j as cache layer `layer_idx + step_offset`, `step_offset = i * k`, as
HrmText offsets its cycles. A trajectory of M steps fills M·k layers of a plain transformers cache: `DynamicCache`
(layers appended as they are first written) or the preallocated `LoopFormerStaticCache`. Every slot holds the same
tokens, so layer 0 gives the cached length.
"""

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, StaticCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging

from .cache_loopformer import LoopFormerCache, bind_cache
from .configuration_loopformer import LoopFormerConfig
from .generation_loopformer import GENERATION_LOOP_KNOBS, LoopFormerGenerationMixin, check_generation_knobs
from .looped_common import DEFAULT_RMS_NORM_EPS, CheckpointLoadersMixin, eager_attention_forward, rotate_half
from .loss_loopformer import SHORTCUT_FORWARD_KWARGS as SHORTCUT_KWARGS
from .loss_loopformer import check_labels, check_shortcut_consistency, shortcut_consistency_loss
from .trajectory_loopformer import resolve_call

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache argument and output field `past_key_values` -> `cache`; both releases work.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

# what a call with the arguments of the halting plugin API (removed; docs/loopformer.md, "Changed in this version") gets
REMOVED_HALTING_ARGUMENTS = (
    "`halt_criterion` and `halt_head` are no arguments of LoopFormer any more: with `halt_eps` it halts on the state "
    "change. The lab's other exit rules run on `LabLoopFormerForCausalLM` (benchmarks/halting_rules.py), whose forward "
    "and generate take `halt_criterion`."
)


class LoopFormerRMSNorm(nn.Module):
    """RMSNorm computed in float32 and returned in the input's dtype, with a learnable weight (the final norm; the
    block norms with `block_norm_weight`) or without one. `eps=None`: torch's float32 eps whatever the dtype, as the
    authors' norms see it (float32 weights, also under autocast)."""

    def __init__(self, hidden_size, eps=None, weight=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if weight else None
        self.eps = DEFAULT_RMS_NORM_EPS if eps is None else eps

    def modulated_weight(self, scale):
        """The weight of RMSNorm(x)·(1 + `scale`): adaLN's scale is one vector per loop step, shared by every token,
        so it folds into the norm's weight (one fused norm instead of a norm and two elementwise ops)."""
        return 1 + scale if self.weight is None else self.weight * (1 + scale)

    def forward(self, x, weight=None):
        """RMSNorm(x) with the norm's own weight, or with `weight` (a loop step's `modulated_weight`; one per row
        under per-row trajectories, applied after the norm)."""
        weight = self.weight if weight is None else weight
        if weight is not None and weight.dim() > 1:
            return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * weight.to(x.dtype)
        if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), self.eps).to(x.dtype)


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


def apply_rotary_pos_emb(q, k, cos, sin):
    """RoPE on the first `cos.shape[-1]` channels of each head of `q` and `k` (either may be None); the rest
    (partial_rotary_factor < 1) pass unrotated."""
    rotary = cos.shape[-1]
    rotated = []
    for x in (q, k):
        if x is None or rotary == x.shape[-1]:
            rotated.append(None if x is None else x * cos + rotate_half(x) * sin)
        else:
            part = x[..., :rotary]
            rotated.append(torch.cat((part * cos + rotate_half(part) * sin, x[..., rotary:]), dim=-1))
    return rotated


class LoopFormerAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
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
            k = apply_rotary_pos_emb(None, k, *position_embeddings)[1]
        return k, v

    def forward(
        self,
        hidden_states,
        attention_mask,
        position_embeddings,
        cache=None,
        step_offset=0,
        output_attentions=False,
        halting=None,
    ):
        """Returns the attention output and its weights (eager only), as Llama's; keys and values go to cache layer
        `layer_idx + step_offset`. With `halting` (halting_loopformer's `LoopFormerHaltingStep`, only under
        `halt_eps`), only the tokens it computes query; every token still gets its keys and values, which `halting`
        keeps for the halting rule."""
        queries, query_positions = hidden_states, position_embeddings
        if halting is not None:
            queries, query_positions = halting.gather(hidden_states), halting.gather_positions(position_embeddings)
        input_shape = queries.shape[:-1]
        q = self.q_proj(queries).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if halting is None:
            hidden_shape = (*input_shape, -1, self.head_dim)
            k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            if position_embeddings is not None:
                q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        else:
            if query_positions is not None:
                q = apply_rotary_pos_emb(q, None, *query_positions)[0]
            k, v = halting.keys_values(self.project_kv, hidden_states, position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx + step_offset)
        if halting is not None:
            k, v, attention_mask = halting.attended(k, v, attention_mask, hidden_states.shape[1])

        interface = eager_attention_forward
        if self.config._attn_implementation not in (None, "eager") and not output_attentions:
            interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
        out, weights = interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=self.is_causal,
        )
        return self.o_proj(out.reshape(*input_shape, -1)), weights


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
        dt = (
            trajectory.to(device=device, dtype=torch.float64)
            if isinstance(trajectory, torch.Tensor)
            else torch.tensor(trajectory, device=device, dtype=torch.float64)
        )
        if self.mode == "timestep":
            return self.time_embedder(torch.arange(dt.shape[-1], device=device, dtype=torch.float32), dtype)
        t = torch.cumsum(dt, -1) - dt  # each row's time at the start of each of its steps
        return (self.time_embedder(t.flatten().float(), dtype) + self.dt_embedder(dt.flatten().float(), dtype)).view(
            *dt.shape, -1
        )


class LoopFormerBlock(GradientCheckpointingLayer):
    """x = x + gate_attn·Attn(RMSNorm(x)·(1 + scale_attn)); x = x + gate_mlp·MLP(RMSNorm(x)·(1 + scale_mlp)).

    Without conditioning (Base-Loop) there is no adaLN: gates are 1 and scales 0, i.e. a plain pre-norm block.
    The two norms carry a learnable weight only with `config.block_norm_weight` (the reference's Base-Loop and Base).
    """

    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = LoopFormerRMSNorm(config.hidden_size, config.rms_norm_eps, config.block_norm_weight)
        self.self_attn = LoopFormerAttention(config, layer_idx)
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
        return (
            gate_attn,
            gate_mlp,
            self.input_layernorm.modulated_weight(scale_attn),
            self.post_attention_layernorm.modulated_weight(scale_mlp),
        )

    def forward(
        self,
        hidden_states,
        conditioning=None,
        attention_mask=None,
        position_embeddings=None,
        cache=None,
        step_offset=0,
        output_attentions=False,
        adaln=None,
        halting=None,
    ):
        """One block at the loop step whose conditioning vector is `conditioning` (d,), or whose adaLN vectors
        (`self.adaln` of that step) the loop computed already (`adaln`, at inference). With gradients on, the
        vectors are computed here, so that FSDP gathers and checkpointing recomputes them with the block's weights.
        `halting`: halting's per-block step (which tokens are frozen), only under `halt_eps`."""
        if adaln is None and conditioning is not None:  # (d,) as a (1, d) row: a quantised Linear takes no 1-D input
            one = conditioning.dim() == 1
            modulation = self.adaLN_modulation(conditioning[None] if one else conditioning)
            adaln = self.adaln((modulation[0] if one else modulation).to(hidden_states.dtype))
        weight_attn = weight_mlp = None
        if adaln is not None:
            gate_attn, gate_mlp, weight_attn, weight_mlp = adaln
        attn_out, _ = self.self_attn(
            self.input_layernorm(hidden_states, weight_attn),
            attention_mask,
            position_embeddings,
            cache=cache,
            step_offset=step_offset,
            output_attentions=output_attentions,
            halting=halting,
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
        return hidden_states


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


# ---- what a forward accepts (transformers' conventions; anything else a ValueError naming it) ---------------------


def check_inputs(config, embed_tokens, input_ids, inputs_embeds, attention_mask, position_ids, past_len, kv_len=None):
    """Exactly one of `input_ids` (ids in [0, vocab_size)) or `inputs_embeds` ((batch, seq, hidden_size) in the
    embeddings' dtype); a 2-D 0/1 mask (batch, past + new tokens) or a 4-D (batch or 1, 1, q_len, kv_len) bool or
    float one (`kv_len`: the keys attention sees; default past + new tokens); integer position ids (batch or 1,
    q_len) >= 0. Checked on a call's first forward (a prompt); the decode steps of the same cache take what generate
    made from it."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Give exactly one of `input_ids` or `inputs_embeds`.")
    given, name = (input_ids, "input_ids") if input_ids is not None else (inputs_embeds, "inputs_embeds")
    if not isinstance(given, torch.Tensor) or given.dim() < 2 or given.shape[0] == 0 or given.shape[1] == 0:
        raise ValueError(
            f"`{name}` must hold at least one sequence of at least one token, shape (batch >= 1, seq_len >= 1), "
            f"got shape {tuple(getattr(given, 'shape', ()))} ({type(given).__name__})."
        )
    compiling = torch.compiler.is_compiling()  # value checks read the tensor (a graph break): skipped there
    dtype = embed_tokens.weight.dtype
    if input_ids is None:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size or inputs_embeds.dtype != dtype:
            raise ValueError(
                f"`inputs_embeds` must be a {dtype} tensor of shape (batch, seq_len, hidden_size={config.hidden_size})"
                f" (what `get_input_embeddings()(input_ids)` gives), got {inputs_embeds.dtype} "
                f"{tuple(inputs_embeds.shape)}."
            )
    else:
        if (
            input_ids.dim() != 2
            or input_ids.is_floating_point()
            or input_ids.is_complex()
            or input_ids.dtype == torch.bool
        ):
            raise ValueError(
                f"`input_ids` must be a 2-D integer tensor (batch, seq_len), got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}."
            )
        low, high = (0, 0) if compiling else (int(input_ids.min()), int(input_ids.max()))
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"`input_ids` must lie in [0, {config.vocab_size - 1}], got values in [{low}, {high}] "
                f"(vocab_size={config.vocab_size})."
            )
    batch, q_len = given.shape[:2]
    past_and_new = q_len + int(past_len)
    kv_len = past_and_new if kv_len is None else kv_len
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
                    f"A 4-D `attention_mask` must have shape (batch={batch} or 1, 1, q_len={q_len}, kv_len={kv_len}), "
                    f"got {tuple(attention_mask.shape)}."
                )
        else:
            if attention_mask.shape != (batch, past_and_new):
                raise ValueError(
                    f"`attention_mask` must have shape (batch, past + new tokens) = {(batch, past_and_new)}, "
                    f"got {tuple(attention_mask.shape)}."
                )
            if not compiling and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                other = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
                raise ValueError(
                    f"A 2-D `attention_mask` must hold only 0 (padding) and 1 (a token), got "
                    f"{other.unique()[:4].tolist()}: positions are counted from it. Pass a 4-D mask for anything "
                    f"else."
                )
    if position_ids is not None:
        if not (
            torch.is_tensor(position_ids)
            and not position_ids.dtype.is_floating_point
            and not position_ids.dtype.is_complex
            and position_ids.dtype != torch.bool
            and position_ids.dim() == 2
            and position_ids.shape[0] in (1, batch)
            and position_ids.shape[1] == q_len
        ):
            raise ValueError(
                f"`position_ids` must be an integer tensor of shape (batch={batch} or 1, new tokens={q_len}), "
                f"got {type(position_ids).__name__} {tuple(getattr(position_ids, 'shape', ()))} "
                f"{getattr(position_ids, 'dtype', '')}."
            )
        if not compiling and position_ids.numel() and int(position_ids.min()) < 0:
            raise ValueError(f"`position_ids` must be >= 0, got {int(position_ids.min())}.")


# ---- the loop ------------------------------------------------------------------------------------------------------


class LoopFormerModel(LoopFormerPreTrainedModel):
    def __init__(self, config: LoopFormerConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.rotary_emb = LoopFormerRotaryEmbedding(config)
        self.loop_conditioning = LoopFormerLoopConditioning(config)
        self.layers = nn.ModuleList([LoopFormerBlock(config, j) for j in range(config.num_hidden_layers)])
        self.norm = LoopFormerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        # memos of `_loop_inputs`: a request's trajectory, and a trajectory's adaLN vectors
        self._trajectories, self._adaln_memo = {}, {}
        self.post_init()

    def train(self, mode=True):
        self._adaln_memo = {}
        return super().train(mode)

    def _apply(self, *args, **kwargs):
        self._adaln_memo = {}  # to(), half(), cuda(), ...: new weight tensors
        return super()._apply(*args, **kwargs)

    def _loop_inputs(self, loop_budget, step_schedule, batch_size, dtype, device):
        """(trajectory, per-row trajectories or None, per-block adaLN vectors of every step or None) of a call.

        A request (budget, schedule) is resolved and checked once (`config.resolve_trajectory`) and remembered;
        one given as a tensor is resolved at every call. `loop_adaln[j][i]` holds block j's vectors at step i
        ((batch, 1, d) each for per-row trajectories), computed only at inference: with gradients, each block makes
        its own. They depend on the trajectory and the conditioning weights alone, so they are remembered per
        trajectory until one of those weights changes (its version counter moves)."""
        request = (
            tuple(loop_budget) if isinstance(loop_budget, list) else loop_budget,
            tuple(step_schedule) if isinstance(step_schedule, list) else step_schedule,
            batch_size,
        )
        # tensors are values to read (outside a compiled graph: `resolve_call`), not to remember; a compiled forward
        # resolves as it traces (the memo would be a guard that changes after the first call)
        tensors = isinstance(loop_budget, torch.Tensor) or isinstance(step_schedule, torch.Tensor)
        try:
            if tensors or torch.compiler.is_compiling():
                raise KeyError
            trajectory, rows = self._trajectories[request]
        except (KeyError, TypeError):  # new, or not hashable (per-row schedules)
            trajectory, rows = resolve_call(self.config, loop_budget, step_schedule, batch_size)
            if not tensors and not torch.compiler.is_compiling():
                try:
                    self._trajectories[request] = trajectory, rows
                except TypeError:
                    pass
        if torch.is_grad_enabled() or self.config.loop_conditioning == "none":
            return trajectory, rows, None
        key = (trajectory if rows is None else rows.trajectories, dtype, device)
        memo = None if torch.compiler.is_compiling() else self._adaln_memo.get(key)
        if memo is not None:
            changed = False
            for weight, version in memo[0]:
                changed |= weight._version != version
            if not changed:
                return trajectory, rows, memo[1]
        loop_adaln = self.adaln_vectors(trajectory if rows is None else rows.steps, dtype, device)
        if not torch.compiler.is_compiling():
            weights = [*self.loop_conditioning.parameters()]
            for block in self.layers:
                weights += block.adaLN_modulation.parameters()
            self._adaln_memo[key] = ([(w, w._version) for w in weights], loop_adaln)
        return trajectory, rows, loop_adaln

    def adaln_vectors(self, steps, dtype, device):
        """`loop_adaln[j][i]`: block j's adaLN vectors at loop step i of the step sizes `steps` (a trajectory, or a
        (batch, M) tensor of per-row step sizes, whose vectors are (batch, 1, d)); None without conditioning."""
        conditioning = self.loop_conditioning(steps, device, dtype)
        if conditioning is None:
            return None
        per_row = conditioning.dim() == 3
        loop_adaln = []
        for block in self.layers:
            vectors = block.adaln(block.adaLN_modulation(conditioning).to(dtype))
            steps = range(conditioning.shape[-2])
            loop_adaln.append([tuple(v[:, i, None] if per_row else v[i] for v in vectors) for i in steps])
        return loop_adaln

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
        past_key_values=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        r"""
        loop_budget (`int`, list of `int` or 1-D integer tensor, *optional*): loop steps M (default: the config's), or
            one per row (a row's state stays as it is after its last step).
        step_schedule (`str` or list of `float`, *optional*): Δ_1..Δ_M summing to 1, a preset ("uniform",
            "coarse_to_fine", "fine_to_coarse"), or one per row.
        halt_eps (`float`, *optional*): a token stops looping once its relative state change
            ‖h_i − h_{i−1}‖∞ / (‖h_i‖∞ + 1e-8) falls below halt_eps (the loop of halting_loopformer.py).
        past_key_values: the cache under its name before transformers 5.24 (`cache` since).

        `hidden_states` (`output_hidden_states=True`): the embeddings and the state after each loop step (M + 1
        tensors); `attentions` (`output_attentions=True`): one per (loop step, block), in the order they run.
        """
        if "halt_criterion" in kwargs or "halt_head" in kwargs:
            raise TypeError(REMOVED_HALTING_ARGUMENTS)
        if halt_eps is not None:
            halt_eps = self.config.check_halt_eps(halt_eps)
        output_attentions = kwargs.get("output_attentions")
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = kwargs.get("output_hidden_states")
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if past_key_values is not None:
            if CACHE_FIELD == "cache":  # transformers 5.24 renamed it, and deprecates the old name as here
                warnings.warn(
                    f"`past_key_values` is deprecated for `{type(self).__name__}.forward`. Use `cache` instead.",
                    FutureWarning,
                    stacklevel=2,
                )
            cache = past_key_values if cache is None else cache
        if self.gradient_checkpointing and self.training:
            cache = None
        elif cache is None and (self.config.use_cache if use_cache is None else use_cache):
            cache = LoopFormerCache()
        # a call's first forward on this cache (or one without): its inputs are checked
        fresh = cache is None or getattr(cache, "loop_key", None) is None
        fresh = fresh or not cache.layers or not cache.layers[0].is_initialized
        if fresh:
            if cache is not None and not isinstance(cache, Cache):
                raise ValueError(f"`cache` must be a transformers Cache instance, got {type(cache).__name__}.")
            past_len = 0 if cache is None else cache.get_seq_length()
            kv_len = cache.layers[0].max_cache_len if isinstance(cache, StaticCache) else None
            check_inputs(
                self.config,
                self.embed_tokens,
                input_ids,
                inputs_embeds,
                attention_mask,
                position_ids,
                past_len,
                kv_len,
            )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, q_len = inputs_embeds.shape[:2]
        trajectory, rows, loop_adaln = self._loop_inputs(
            loop_budget, step_schedule, batch_size, inputs_embeds.dtype, inputs_embeds.device
        )
        num_steps = len(trajectory) if rows is None else rows.num_steps
        if cache is not None and not torch.compiler.is_compiling():
            key = (trajectory if rows is None else rows.trajectories, halt_eps)
            if halt_eps is not None and getattr(self, "halting_rule", None) is not None:
                key += (self.halting_rule.__name__,)  # a subclass's rule halts other tokens, filling other slots
            if getattr(cache, "loop_key", None) != key or (not fresh and cache.layers[0].keys.shape[0] != batch_size):
                bind_cache(cache, key, num_steps, len(self.layers), batch_size)
            if isinstance(cache, StaticCache) and int(cache.get_seq_length()) + q_len > cache.layers[0].max_cache_len:
                raise ValueError(
                    f"This {type(cache).__name__} holds max_cache_len={cache.layers[0].max_cache_len} tokens; it has "
                    f"{int(cache.get_seq_length())} and this call adds {q_len}. Build it with a larger `max_cache_len`."
                )

        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:  # left padding: counted from the mask
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -q_len:]
            else:
                past_len = 0 if cache is None else cache.get_seq_length()
                position_ids = (torch.arange(q_len, device=inputs_embeds.device) + past_len)[None]
        position_ids = position_ids.expand(batch_size, q_len)  # (1, q_len) is shared by the batch, as in Llama
        mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(inputs_embeds.dtype)  # additive: sdpa needs the queries' dtype
        hidden_states, position_embeddings = inputs_embeds, None
        if self.config.position_embedding_type == "learned":
            if not torch.compiler.is_compiling() and int(position_ids.max()) >= self.config.max_position_embeddings:
                raise ValueError(
                    f"Position {int(position_ids.max())} is beyond max_position_embeddings="
                    f"{self.config.max_position_embeddings} (learned positions cannot extrapolate)."
                )
            hidden_states = hidden_states + self.embed_positions(position_ids)
        else:
            cos, sin = self.rotary_emb(hidden_states, position_ids)
            position_embeddings = cos[:, None], sin[:, None]  # shared by the heads

        if output_attentions:  # recorded as transformers records Llama's: a hook on each attention module
            attentions = []
            hooks = [
                block.self_attn.register_forward_hook(lambda module, args, out: attentions.append(out[1]))
                for block in self.layers
            ]
        if halt_eps is not None:  # per-token halting runs its own loop, with its own cache layer
            from .halting_loopformer import halting_loop

            hidden_states, all_hidden_states, loop_counts = halting_loop(
                self,
                halt_eps,
                trajectory,
                rows,
                loop_adaln,
                hidden_states,
                mask,
                position_embeddings,
                cache,
                output_attentions,
                output_hidden_states,
            )
        else:
            # The loop: step i runs the k blocks, block j on cache layer j + i·k. With gradients on, each block makes
            # its adaLN vectors from its step's c inside its own forward (FSDP gathers a block's weights only there,
            # and checkpointing recomputes them). Per-row trajectories run the largest budget; a row keeps its state
            # after its own last step.
            k, loop_counts = len(self.layers), None
            conditioning = None
            if loop_adaln is None and self.config.loop_conditioning != "none":
                steps = trajectory if rows is None else rows.steps
                conditioning = self.loop_conditioning(steps, hidden_states.device, hidden_states.dtype)
                if conditioning.dim() == 3:  # per row: (batch, 1, d) at each step
                    conditioning = conditioning[:, :, None].transpose(0, 1)
            # Rows sorted by budget (largest first, as generate sorts them): step i computes only the rows still
            # looping, a prefix of the batch, and cache layers of step i hold those rows alone. Otherwise every row
            # computes every step and a row past its budget keeps its state.
            # (a static cache, which a compiled decode step may fill, keeps every row in every layer)
            sliced = rows is not None and not torch.compiler.is_compiling() and not isinstance(cache, StaticCache)
            live = rows.live_counts if sliced else None
            budgets = (
                None if rows is None or live is not None else rows.budgets.to(hidden_states.device)[:, None, None]
            )
            all_hidden_states = (hidden_states,) if output_hidden_states else None
            for i in range(num_steps):
                n = batch_size if live is None else live[i]
                h, step_mask, step_positions = hidden_states, mask, position_embeddings
                if n < batch_size:
                    h = hidden_states[:n]
                    step_mask = mask if mask is None or mask.shape[0] == 1 else mask[:n]
                    step_positions = None if position_embeddings is None else tuple(p[:n] for p in position_embeddings)
                for j, block in enumerate(self.layers):
                    c = None if conditioning is None else conditioning[i]
                    adaln = None if loop_adaln is None else loop_adaln[j][i]
                    if n < batch_size and rows is not None:  # per-row vectors: those of the rows computed
                        c = None if c is None or c.dim() == 1 else c[:n]
                        adaln = None if adaln is None else tuple(v[:n] if v.dim() == 3 else v for v in adaln)
                    h = block(
                        h,
                        c,
                        attention_mask=step_mask,
                        position_embeddings=step_positions,
                        cache=cache,
                        step_offset=i * k,
                        output_attentions=output_attentions,
                        adaln=adaln,
                    )
                if n < batch_size:
                    hidden_states = torch.cat((h, hidden_states[n:]))
                elif budgets is not None:  # rows past their budget keep their state
                    hidden_states = torch.where(budgets > i, h, hidden_states)
                else:
                    hidden_states = h
                if output_hidden_states:
                    all_hidden_states += (hidden_states,)
        if output_attentions:
            for hook in hooks:
                hook.remove()
        output = LoopFormerModelOutput(
            last_hidden_state=self.norm(hidden_states),
            hidden_states=all_hidden_states,
            attentions=tuple(attentions) if output_attentions else None,
            loop_counts=loop_counts,
            **{CACHE_FIELD: cache},
        )
        return output if kwargs.get("return_dict", self.config.return_dict) is not False else output.to_tuple()


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
        past_key_values=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        r"""
        labels (`torch.LongTensor`, *optional*): next-token targets (shifted inside), -100 is ignored; as Llama's,
            of the input's length (T − 1 targets), or one longer: the whole window `data[s:s+T+1]` of the input
            `data[s:s+T]`, whose T targets `data[s+1:s+T+1]` are the authors' (a stock `Trainer` keeps a `labels`
            column, not a `shift_labels` one). `shift_labels` (a keyword, as for Llama): targets already aligned.
        loop_budget, step_schedule, halt_eps: as for [`LoopFormerModel.forward`], also as `generate` kwargs;
            `output_attentions`, `output_hidden_states`, `return_dict` as Llama's.
        shortcut_consistency ([`ShortcutConsistency`], *optional*): with `labels`, the same inputs also run its short
            trajectory: `loss = CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)`, its terms in `ce_full`,
            `ce_short`, `consistency` (in a Trainer, looped_training's ShortcutConsistencyCallback passes it).
        """
        shift_labels = kwargs.pop("shift_labels", None)
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if shift_labels is None and isinstance(labels, torch.Tensor) and labels.dim() == 2:
            if labels.shape[1] == length + 1:  # the whole window: its last T tokens are the targets
                shift_labels = labels[:, 1:].contiguous()
        if labels is None and shift_labels is not None:
            labels = shift_labels  # the targets are given aligned: `_loss` reads them as such
        old_arguments = kwargs and not torch.compiler.is_compiling() and not kwargs.keys().isdisjoint(SHORTCUT_KWARGS)
        if labels is not None or shortcut_consistency is not None or old_arguments:
            shortcut_consistency = check_shortcut_consistency(shortcut_consistency, kwargs, labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
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
            inputs = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask)
            inputs.update(position_ids=position_ids, loop_budget=loop_budget)
            loss, terms = self._loss(logits, hidden_states, inputs, labels, shift_labels, shortcut_consistency, kwargs)
        output = LoopFormerCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            loop_counts=outputs.loop_counts,
            **terms,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )
        return output if kwargs.get("return_dict", self.config.return_dict) is not False else output.to_tuple()

    def _loss(self, logits, hidden_states, inputs, labels, shift_labels, shortcut_consistency, kwargs):
        """(loss, the objective's terms): transformers' causal-LM loss, or with `shortcut_consistency` the
        shortcut-consistency loss of the full and the short trajectory (the same inputs, the short schedule)."""
        check_labels(labels if shift_labels is None else None, shift_labels, logits.shape[:2], self.config.vocab_size)
        num_items_in_batch = kwargs.get("num_items_in_batch")
        if shortcut_consistency is None:
            extra = {"ignore_index": kwargs["ignore_index"]} if "ignore_index" in kwargs else {}
            if shift_labels is not None:
                extra["shift_labels"] = shift_labels.contiguous()  # transformers' loss views it flat
            loss = self.loss_function(
                logits=logits,
                labels=None if shift_labels is not None else labels,
                vocab_size=self.config.vocab_size,
                num_items_in_batch=num_items_in_batch,
                **extra,
            )
            return loss, {}
        objective = shortcut_consistency
        inputs.pop("loop_budget")
        short = self.model(
            **inputs, step_schedule=list(objective.short_step_schedule), use_cache=False, return_dict=True
        )
        loss, terms, _ = shortcut_consistency_loss(
            logits,
            hidden_states,
            self.lm_head(short.last_hidden_state),
            short.last_hidden_state,
            labels if shift_labels is None else None,
            objective.lambda_short,
            objective.lambda_consistency,
            objective.consistency_loss,
            num_items_in_batch,
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
