"""LoopFormer's layers, in the order a token travels through one loop step: norm → positions → attention → MLP →
loop conditioning (t, Δ) → the modulated block. The model that loops them is modeling_loopformer.py.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
`rms_norm`, `rotate_half` and `eager_attention_forward` are FPRM's too: their home is looped_common.py.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from .looped_common import attend, rms_norm, rotate_half


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


def apply_rotary(x, cos, sin):
    """RoPE on the first `cos.shape[-1]` channels of each head; the rest (partial_rotary_factor < 1) pass."""
    if cos.shape[-1] == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    return torch.cat((apply_rotary(x[..., : cos.shape[-1]], cos, sin), x[..., cos.shape[-1] :]), dim=-1)


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

    def forward(
        self,
        hidden_states,
        attention_mask,
        position_embeddings,
        cache=None,
        cache_slot=0,
        output_attentions=False,
        halting=None,
    ):
        """Returns the attention output and its weights (eager only), as Llama's. With `halting` (a
        [`LoopFormerHaltingStep`]), only the tokens it computes query (the output is theirs); every token still gets
        its keys and values, which `halting` keeps for the halting rule."""
        queries = hidden_states if halting is None else halting.gather(hidden_states)
        query_positions = position_embeddings if halting is None else halting.gather_positions(position_embeddings)
        input_shape = queries.shape[:-1]
        q = self.q_proj(queries).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if query_positions is not None:
            q = apply_rotary(q, *query_positions)
        if halting is None:
            k, v = self.project_kv(hidden_states, position_embeddings)
        else:
            k, v = halting.keys_values(self.project_kv, hidden_states, position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, cache_slot)
        if halting is not None:
            k, v, attention_mask = halting.attended(k, v, attention_mask, hidden_states.shape[1])

        out, weights = attend(self, q, k, v, attention_mask, output_attentions)
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
        cache_slot=0,
        output_attentions=False,
        adaln=None,
        halting=None,
    ):
        """One block at the loop step whose conditioning vector is `conditioning` (d,). `adaln` is `self.adaln` of
        that step when the caller has it already (at inference the loop computes every step's once). With per-token
        halting, `halting` (a [`LoopFormerHaltingStep`]) says which tokens are frozen: they keep their state, and
        only the others are computed.

        Returns the new hidden states, as Llama's decoder layer (the attention weights, with `output_attentions`, are
        the attention module's output, which the loop records).
        """
        if adaln is None and conditioning is not None:  # as a (1, d) row: a quantised Linear takes no 1-D input
            adaln = self.adaln(self.adaLN_modulation(conditioning[None])[0].to(hidden_states.dtype))
        weight_attn = weight_mlp = None
        if adaln is not None:
            gate_attn, gate_mlp, weight_attn, weight_mlp = adaln
        normed = self.input_layernorm(hidden_states, weight_attn)
        attn_out, _ = self.self_attn(
            normed,
            attention_mask,
            position_embeddings,
            cache=cache,
            cache_slot=cache_slot,
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
