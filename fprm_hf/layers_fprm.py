"""FPRM's layers, in the order a token travels through one loop step: weightless RMSNorm → rotary positions →
attention → SwiGLU → depthwise conv → residual scaling (α, β) → block. The loop step that puts them together, f, is
`FPRMModel.fixed_point_map` (modeling_fprm.py, whose docstring writes it out).

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
That is also why `rms_norm`, `rotate_half` and `eager_attention_forward` have a home here and one in LoopFormer's
layers_loopformer.py: a saved FPRM loads without loopformer_hf (tests/test_layout.py keeps the two packages apart and
lists what both define), and torch and transformers have no public function that computes exactly these.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .looped_common import attend, rms_norm, rotate_half

BETA1_EPS = 1e-5  # β1 = β2·(1 − α1) / (1 − α1^(2N) + 1e-5)


def truncated_normal_std(std, bound=2.0):
    """The std of the normal that, cut at ±`bound` of its own std, has std `std` (the authors' and JAX's
    truncated normal: z0 and the weights have exactly the std they are given)."""
    pdf = math.exp(-0.5 * bound**2) / math.sqrt(2 * math.pi)
    mass = math.erf(bound / math.sqrt(2))
    return std / math.sqrt(1 - 2 * bound * pdf / mass)


def sample_truncated_normal(shape, std, generator=None, device=None, dtype=torch.float32, bound=2.0):
    """Draws from the truncated normal of `truncated_normal_std` (inverse-CDF sampling, so one `generator` decides
    every value)."""
    scale = truncated_normal_std(std, bound)
    edge = math.erf(bound / math.sqrt(2))
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32) * (2 * edge) - edge
    return (torch.erfinv(u) * (math.sqrt(2) * scale)).clamp(-bound * scale, bound * scale).to(dtype)


class FPRMRotaryEmbedding(nn.Module):
    """RoPE of `config.rope_parameters` (transformers' RoPE types, as Llama's) over the flattened positions (prefix
    included), in float32. The frequencies are computed per call (the "dynamic" and "longrope" types: for the call's
    length) rather than kept in a non-persistent buffer, which from_pretrained would leave uninitialised."""

    def __init__(self, config):
        super().__init__()
        self.config, self.rope_type = config, config.rope_parameters["rope_type"]

    def frequencies(self, device, seq_len=None):
        """(inverse frequencies, attention scaling)."""
        if self.rope_type != "default":
            return ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device, seq_len=seq_len)
        dim, base = self.config.rotary_dim, self.config.rope_parameters["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)), 1.0

    @property
    def inv_freq(self):
        """The inverse frequencies up to `max_position_embeddings` (what Llama's module keeps as a buffer)."""
        return self.frequencies(None)[0]

    def forward(self, x, position_ids):
        """(cos, sin), each (batch, seq, rotary_dim), as Llama's."""
        length = int(position_ids.max()) + 1 if self.rope_type in ("dynamic", "longrope") else None
        inv_freq, scaling = self.frequencies(x.device, length)
        emb = torch.cat([position_ids[..., None].float() * inv_freq] * 2, dim=-1)
        return emb.cos() * scaling, emb.sin() * scaling


def apply_rotary_pos_emb(q, k, cos, sin):
    """q and k rotated in float32 (cos/sin's dtype), as the authors; with a partial rotation (`cos` narrower than a
    head) only the first channels of each head."""
    dtype, d = q.dtype, cos.shape[-1]
    q, k = q.to(cos.dtype), k.to(cos.dtype)
    if d < q.shape[-1]:
        return tuple(
            torch.cat((t[..., :d] * cos + rotate_half(t[..., :d]) * sin, t[..., d:]), -1).to(dtype) for t in (q, k)
        )
    return (q * cos + rotate_half(q) * sin).to(dtype), (k * cos + rotate_half(k) * sin).to(dtype)


class FPRMAttention(nn.Module):
    """Multi-head attention with a fused q|k|v projection, bidirectional for grids and causal for state tracking."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5 / config.softmax_temperature
        self.is_causal = config.causal
        self.num_key_value_groups = 1  # one key per query head
        d = config.hidden_size
        self.qkv_proj = nn.Linear(d, 3 * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(d, d, bias=config.attention_bias)

    def forward(self, hidden_states, position_embeddings=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in self.qkv_proj(hidden_states).chunk(3, dim=-1))
        if position_embeddings is not None:
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out, _ = attend(self, q, k, v, None)  # no mask: causal by `is_causal`, else every token sees every token
        return self.o_proj(out.reshape(*input_shape, -1))


class FPRMMLP(nn.Module):
    """SwiGLU with a fused gate|up projection: down(silu(gate) * up)."""

    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FPRMDepthwiseConv(nn.Module):
    """Depthwise conv over the grid/sequence rows of a state (the prefix rows are not convolved): a causal kernel-k
    conv over the sequence (k − 1 zeros on the left) or a k×k conv over the height × width grid (zero padding).
    Returns the convolved rows only, (batch, tokens − prefix, hidden)."""

    def __init__(self, config):
        super().__init__()
        self.conv_type = config.conv_type
        self.num_prefix_tokens = config.num_prefix_tokens
        self.grid_size = config.grid_shape
        d, k = config.hidden_size, config.conv_kernel_size
        shape = (d, 1, k) if self.conv_type == "causal_1d" else (d, 1, k, k)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(d)) if config.conv_bias else None

    def forward(self, y):
        rows = y[:, self.num_prefix_tokens :]
        b, n, d = rows.shape
        weight = self.weight.to(rows.dtype)
        bias = None if self.bias is None else self.bias.to(rows.dtype)
        if self.conv_type == "causal_1d":
            seq = F.pad(rows.transpose(1, 2), (self.weight.shape[-1] - 1, 0))  # left pad only: causal
            return F.conv1d(seq, weight, bias, groups=d).transpose(1, 2)
        h, w = self.grid_size
        grid = rows.transpose(1, 2).reshape(b, d, h, w)
        out = F.conv2d(grid, weight, bias, padding=self.weight.shape[-1] // 2, groups=d)
        return out.reshape(b, d, n).transpose(1, 2)


class FPRMResidualScaling(nn.Module):
    """The coefficients (α1, β1, α2, β2) of one loop step, read from the state y' after the conv.

    input_independent: α = sigmoid(logit) per channel, learned; β tied (modeling_fprm.py's docstring).
    fixed:             α1, α2 are the config's constants; β tied.
    input_dependent:   α = sigmoid(Linear(y')) per token and channel, one linear layer per α; β tied.
    none:              α = β = 1 (plain pre-norm, or post-norm).
    outer_only (any of the first three): β2 = 1 − α2 and α1 = β1 = 1.
    """

    def __init__(self, config):
        super().__init__()
        self.mode = config.residual_scaling
        self.outer_only = config.outer_only
        self.num_sublayers = 2 * config.num_hidden_layers
        d = config.hidden_size
        self.alpha1_init, self.alpha2_init = config.alpha1, config.alpha2
        inner = not self.outer_only
        if self.mode == "input_independent":
            # stored as logits so that 0 < α < 1 always; excluded from weight decay by name ("alpha")
            self.alpha2_logit = nn.Parameter(torch.empty(d))
            self.alpha1_logit = nn.Parameter(torch.empty(d)) if inner else None
        elif self.mode == "input_dependent":
            self.alpha2_proj = nn.Linear(d, d, bias=True)
            self.alpha1_proj = nn.Linear(d, d, bias=True) if inner else None

    def tied_betas(self, alpha1, alpha2):
        a1_pow = alpha1**self.num_sublayers
        beta2 = 1 - alpha2 * a1_pow
        beta1 = beta2 * (1 - alpha1) / (1 - a1_pow + BETA1_EPS)
        return beta1, beta2

    def forward(self, y):
        if self.mode == "none":
            return 1.0, 1.0, 1.0, 1.0
        inner = not self.outer_only
        if self.mode == "fixed":
            alpha2 = torch.tensor(self.alpha2_init)
            alpha1 = torch.tensor(self.alpha1_init) if inner else None
        elif self.mode == "input_dependent":
            alpha2 = torch.sigmoid(self.alpha2_proj(y).float())
            alpha1 = torch.sigmoid(self.alpha1_proj(y).float()) if inner else None
        else:
            alpha2 = torch.sigmoid(self.alpha2_logit.float())
            alpha1 = torch.sigmoid(self.alpha1_logit.float()) if inner else None
        if self.outer_only:
            return 1.0, 1.0, alpha2.to(device=y.device, dtype=y.dtype), (1 - alpha2).to(device=y.device, dtype=y.dtype)
        beta1, beta2 = self.tied_betas(alpha1, alpha2)
        return tuple(c.to(device=y.device, dtype=y.dtype) for c in (alpha1, beta1, alpha2, beta2))


class FPRMBlock(nn.Module):
    """Two sub-layers, attention then SwiGLU, each h ← α1·h + β1·F(·) with the norm placed by `norm_type`:
    pre: F(RMSNorm(h)); peri: RMSNorm(F(RMSNorm(h))); post: RMSNorm(α1·h + β1·F(h)) (TRM style)."""

    def __init__(self, config):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.norm_type = config.norm_type
        self.self_attn = FPRMAttention(config)
        self.mlp = FPRMMLP(config)

    def _sublayer(self, h, sublayer, alpha1, beta1, *args):
        out = sublayer(h if self.norm_type == "post" else rms_norm(h, eps=self.eps), *args)
        if self.norm_type == "peri":
            out = rms_norm(out, eps=self.eps)
        h = alpha1 * h + beta1 * out
        return rms_norm(h, eps=self.eps) if self.norm_type == "post" else h

    def forward(self, h, alpha1, beta1, position_embeddings=None):
        h = self._sublayer(h, self.self_attn, alpha1, beta1, position_embeddings)
        return self._sublayer(h, self.mlp, alpha1, beta1)
