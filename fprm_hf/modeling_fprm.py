"""FPRM: a looped transformer whose loop is a fixed-point iteration that halts per sample when it has converged
("Fixed-Point Reasoners: Stable and Adaptive Deep Looped Transformers", arXiv 2606.18206).

Reads top to bottom in the order a token travels: norm → positions → attention → SwiGLU → depthwise conv and input
re-injection → residual scaling (α, β) → block → one loop step f → the solver (Algorithm 1) → head.

One loop step f(y) of the default (input-independent, pre-norm) model, with N blocks = 2N sub-layers F_k:

    u = x + DWConv(RMSNorm(y))                 re-injected input (the conv mixes neighbouring states)
    h = α2·y + β2·u
    h = α1·h + β1·F_k(RMSNorm(h))              for k = 1..2N
    β2 = 1 − α2·α1^(2N),  β1 = β2·(1 − α1) / (1 − α1^(2N) + 1e-5)

so every channel of f(y) is a convex-like combination of y, u and the sub-layer outputs, and the iterates stay
bounded (Theorem 1) however many loops run.
"""

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils import logging

from .configuration_fprm import (
    FPRMConfig,
    check_halt_eps,
    check_max_loops,
    check_patience,
    check_unit_interval,
)


logger = logging.get_logger(__name__)

RESIDUAL_DENOM_EPS = 1e-8  # r = ‖y − f(y)‖∞ / (‖f(y)‖∞ + 1e-8)
BETA1_EPS = 1e-5  # β1 = β2·(1 − α1) / (1 − α1^(2N) + 1e-5)


def rms_norm(x, eps, weight=None):
    return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps).to(x.dtype)


class FPRMRMSNorm(nn.Module):
    """The final norm before the head (with weight); the norms inside the loop are weightless `rms_norm` calls."""

    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.eps, self.weight)


class FPRMRotaryEmbedding(nn.Module):
    """RoPE over the flattened positions (prefix included). The frequencies are computed per call rather than kept
    in a non-persistent buffer, which from_pretrained would leave uninitialised."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.head_dim
        self.base = config.rope_theta

    def forward(self, seq_len, device, dtype):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float, device=device) / self.dim))
        freqs = torch.arange(seq_len, device=device, dtype=torch.float)[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if module.is_causal:
        q_len, kv_len = scores.shape[-2:]
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril(kv_len - q_len)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class FPRMAttention(nn.Module):
    """Multi-head attention, bidirectional for grids and causal for state tracking (`config.causal`)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = config.causal
        bias = config.attention_bias
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, d, bias=bias)
        self.v_proj = nn.Linear(d, d, bias=bias)
        self.o_proj = nn.Linear(d, d, bias=bias)

    def forward(self, hidden_states, position_embeddings=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None:
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        # get_interface (rather than indexing) lets `set_attn_implementation` switch the kernel on a built model
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, _ = attention_interface(
            self, q, k, v, None,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=self.is_causal,
        )
        return self.o_proj(out.reshape(*input_shape, -1))


class FPRMMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config):
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FPRMInputInjection(nn.Module):
    """u = x + DWConv(RMSNorm(y)): the input re-injected at every loop step, plus a depthwise convolution of the
    (normalised, hence bounded) state over its neighbours: k×k over the grid, or causal kernel-k over the sequence.
    Prefix tokens are outside the grid and get no conv term in 2-D."""

    def __init__(self, config):
        super().__init__()
        self.conv_type = config.conv_type
        self.eps = config.rms_norm_eps
        self.num_prefix_tokens = config.num_prefix_tokens
        self.grid_size = config.grid_size
        d, k = config.hidden_size, config.conv_kernel_size
        if self.conv_type == "2d":
            self.conv = nn.Conv2d(d, d, k, padding=k // 2, groups=d, bias=False)
        elif self.conv_type == "causal_1d":
            self.conv = nn.Conv1d(d, d, k, groups=d, bias=False)

    def forward(self, y, x):
        if self.conv_type == "none":
            return x
        normed = rms_norm(y, self.eps)
        if self.conv_type == "causal_1d":
            seq = F.pad(normed.transpose(1, 2), (self.conv.kernel_size[0] - 1, 0))  # left pad only: causal
            return x + self.conv(seq).transpose(1, 2)
        p = self.num_prefix_tokens
        (h, w), b, d = self.grid_size, y.shape[0], y.shape[-1]
        grid = normed[:, p:].transpose(1, 2).reshape(b, d, h, w)
        mixed = self.conv(grid).reshape(b, d, h * w).transpose(1, 2)
        return x + F.pad(mixed, (0, 0, p, 0))


class FPRMResidualScaling(nn.Module):
    """The coefficients (α1, β1, α2, β2) of one loop step.

    input_independent: α = sigmoid(logit) per channel, learned; β tied (module docstring).
    fixed:             α1, α2 are the config's constants; β tied.
    input_dependent:   α = sigmoid(Linear(RMSNorm(y))) per token and channel; β tied.
    outer_only:        α2 learned per channel, β2 = 1 − α2, α1 = β1 = 1.
    none:              α = β = 1 (plain pre-norm, or post-norm).
    """

    def __init__(self, config):
        super().__init__()
        self.mode = config.residual_scaling
        self.num_sublayers = 2 * config.num_hidden_layers
        self.eps = config.rms_norm_eps
        d = config.hidden_size
        self.alpha1_init, self.alpha2_init = config.alpha1, config.alpha2
        if self.mode in ("input_independent", "outer_only"):
            # stored as logits so that 0 < α < 1 always; excluded from weight decay by name ("alpha")
            self.alpha1_logit = nn.Parameter(torch.empty(d)) if self.mode == "input_independent" else None
            self.alpha2_logit = nn.Parameter(torch.empty(d))
        elif self.mode == "input_dependent":
            self.alpha_proj = nn.Linear(d, 2 * d, bias=True)

    def tied_betas(self, alpha1, alpha2):
        a1_pow = alpha1**self.num_sublayers
        beta2 = 1 - alpha2 * a1_pow
        beta1 = beta2 * (1 - alpha1) / (1 - a1_pow + BETA1_EPS)
        return beta1, beta2

    def forward(self, y):
        if self.mode == "none":
            return 1.0, 1.0, 1.0, 1.0
        if self.mode == "fixed":
            alpha1, alpha2 = torch.tensor(self.alpha1_init), torch.tensor(self.alpha2_init)
        elif self.mode == "input_dependent":
            alpha1, alpha2 = torch.sigmoid(self.alpha_proj(rms_norm(y, self.eps)).float()).chunk(2, dim=-1)
        else:
            alpha2 = torch.sigmoid(self.alpha2_logit.float())
            if self.mode == "outer_only":
                return 1.0, 1.0, alpha2.to(y.dtype), (1 - alpha2).to(y.dtype)
            alpha1 = torch.sigmoid(self.alpha1_logit.float())
        beta1, beta2 = self.tied_betas(alpha1, alpha2)
        return tuple(c.to(device=y.device, dtype=y.dtype) for c in (alpha1, beta1, alpha2, beta2))


class FPRMBlock(nn.Module):
    """Two sub-layers, attention then SwiGLU. Pre-norm: h ← α1·h + β1·F(RMSNorm(h)); post-norm (TRM style):
    h ← RMSNorm(h + F(h))."""

    def __init__(self, config):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.post_norm = config.norm_position == "post"
        self.self_attn = FPRMAttention(config)
        self.mlp = FPRMMLP(config)

    def forward(self, h, alpha1, beta1, position_embeddings=None):
        if self.post_norm:
            h = rms_norm(h + self.self_attn(h, position_embeddings), self.eps)
            return rms_norm(h + self.mlp(h), self.eps)
        h = alpha1 * h + beta1 * self.self_attn(rms_norm(h, self.eps), position_embeddings)
        return alpha1 * h + beta1 * self.mlp(rms_norm(h, self.eps))


class FPRMPreTrainedModel(PreTrainedModel):
    config_class = FPRMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["FPRMBlock"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module):
        # Every module with FPRM-specific parameters is handled here explicitly; the `init` helpers skip tensors that
        # were loaded from a checkpoint, so from_pretrained never overwrites weights.
        from transformers import initialization as init

        config = self.config
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            if getattr(module, "alpha_init", False):  # input-dependent α starts at α1, α2 for every input
                init.zeros_(module.weight)
                d = config.hidden_size
                init.constant_(module.bias[:d], _logit(config.alpha1))
                init.constant_(module.bias[d:], _logit(config.alpha2))
                return
            fan_in = module.weight[0].numel()
            std = config.initializer_range or fan_in**-0.5  # LeCun normal by default, as TRM
            init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            # unit-scale inputs after the sqrt(d) multiplier of FPRMModel.embed
            std = config.hidden_size**-0.5
            init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
        elif isinstance(module, FPRMResidualScaling):
            if module.mode in ("input_independent", "outer_only"):
                if module.alpha1_logit is not None:
                    init.constant_(module.alpha1_logit, _logit(config.alpha1))
                init.constant_(module.alpha2_logit, _logit(config.alpha2))
        elif isinstance(module, FPRMModel):
            std = config.init_std  # z0 ~ truncated normal(0, init_std) on [-2 std, 2 std]
            init.trunc_normal_(module.z_init, std=std, a=-2 * std, b=2 * std)
            if module.prefix is not None:
                s = config.hidden_size**-0.5
                init.trunc_normal_(module.prefix, std=s, a=-2 * s, b=2 * s)
        elif isinstance(module, FPRMRMSNorm):
            init.ones_(module.weight)


def _logit(p):
    return float(torch.logit(torch.tensor(p, dtype=torch.float64)))


@dataclass
class FPRMSolverState:
    """What the solver carries between calls (e.g. between truncated-BPTT segments): the state y and, per sample,
    the damping step η, patience, best residual, iterations so far and the halting flags."""

    hidden: torch.Tensor  # (batch, tokens, hidden) the current iterate y
    eta: torch.Tensor  # (batch,) damping step
    patience: torch.Tensor  # (batch,) iterations left before η decays
    best: torch.Tensor  # (batch,) best residual so far
    residuals: torch.Tensor  # (batch,) latest residual (inf before the first iteration or after a non-finite one)
    iterations: torch.Tensor  # (batch,) iterations of f applied so far
    halted: torch.Tensor  # (batch,) bool, the row is frozen
    converged: torch.Tensor  # (batch,) bool, halted because r < halt_eps
    diverged: torch.Tensor  # (batch,) bool, halted because the residual was not finite

    def detach(self):
        return replace(self, hidden=self.hidden.detach())

    def where(self, rows, other):
        """A state that takes `other`'s rows where `rows` (bool, (batch,)) is True and this one's elsewhere."""
        out = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            mask = rows.view(-1, *([1] * (mine.dim() - 1)))
            out[f.name] = torch.where(mask, theirs, mine)
        return FPRMSolverState(**out)

    def select(self, rows):
        """The state of the rows indexed by `rows` (a LongTensor)."""
        return FPRMSolverState(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


@dataclass
class FPRMModelOutput(ModelOutput):
    """
    last_hidden_state: the final state y after the final RMSNorm, prefix tokens included.
    iterations: (batch,) iterations of f this call applied to each sample.
    residuals: (batch,) final relative ∞-norm residual per sample (inf where it was not finite).
    converged: (batch,) True where the residual fell below `halt_eps`.
    diverged: (batch,) True where a non-finite residual stopped the sample (its last finite state is kept).
    residual_trace: (batch, iterations run) residual after each iteration (with `output_residual_trace=True`);
        a halted row repeats its final residual.
    solver_state: the `FPRMSolverState` to continue from (pass it back as `solver_state=`).
    """

    last_hidden_state: torch.FloatTensor | None = None
    iterations: torch.LongTensor | None = None
    residuals: torch.FloatTensor | None = None
    converged: torch.BoolTensor | None = None
    diverged: torch.BoolTensor | None = None
    residual_trace: torch.FloatTensor | None = None
    solver_state: FPRMSolverState | None = None


@dataclass
class FPRMReasoningOutput(ModelOutput):
    """
    loss: cross-entropy of `logits` against `labels` (-100 ignored), when labels are given.
    logits: (batch, input tokens, vocab_size) prediction for every input token (prefix tokens dropped).
    Other fields as [`FPRMModelOutput`].
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    iterations: torch.LongTensor | None = None
    residuals: torch.FloatTensor | None = None
    converged: torch.BoolTensor | None = None
    diverged: torch.BoolTensor | None = None
    residual_trace: torch.FloatTensor | None = None
    solver_state: FPRMSolverState | None = None


class FPRMModel(FPRMPreTrainedModel):
    """Embeddings, the loop step f and the fixed-point solver. Returns the converged, normalised state."""

    def __init__(self, config: FPRMConfig):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, d) if config.position_embedding_type == "learned" else None
        )
        self.rotary_emb = FPRMRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        # learned prefix tokens, one set per puzzle identifier
        self.prefix = (
            nn.Parameter(torch.empty(config.num_puzzle_identifiers, config.num_prefix_tokens, d))
            if config.num_prefix_tokens else None
        )
        self.register_buffer("z_init", torch.empty(d), persistent=True)  # z0, broadcast to every token
        self.injection = FPRMInputInjection(config)
        self.residual_scaling = FPRMResidualScaling(config)
        if config.residual_scaling == "input_dependent":
            self.residual_scaling.alpha_proj.alpha_init = True
        self.layers = nn.ModuleList([FPRMBlock(config) for _ in range(config.num_hidden_layers)])
        self.norm = FPRMRMSNorm(d, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # ---- inputs -------------------------------------------------------------------------------------------------

    def check_inputs(self, input_ids, puzzle_identifiers=None):
        config = self.config
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(
                f"`input_ids` must be an integer tensor of shape (batch, tokens), got "
                f"{type(input_ids).__name__} {getattr(input_ids, 'shape', '')} {getattr(input_ids, 'dtype', '')}."
            )
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= config.vocab_size):
            raise ValueError(
                f"`input_ids` must lie in [0, {config.vocab_size - 1}] (vocab_size={config.vocab_size}), got values "
                f"in [{int(input_ids.min())}, {int(input_ids.max())}]."
            )
        n = input_ids.shape[1]
        if config.grid_size is not None and n != config.num_grid_tokens:
            h, w = config.grid_size
            raise ValueError(
                f"This model reads {h}x{w} grids, i.e. {h * w} tokens per sample; got {n} tokens "
                f"(input_ids shape {tuple(input_ids.shape)})."
            )
        if n == 0:
            raise ValueError("`input_ids` has no tokens; at least one token per sample is needed.")
        total = n + config.num_prefix_tokens
        if self.embed_positions is not None and total > config.max_position_embeddings:
            raise ValueError(
                f"{n} tokens + {config.num_prefix_tokens} prefix tokens = {total} exceed max_position_embeddings="
                f"{config.max_position_embeddings} (learned positions cannot extrapolate)."
            )
        if puzzle_identifiers is not None:
            if not torch.is_tensor(puzzle_identifiers) or puzzle_identifiers.shape != (input_ids.shape[0],):
                raise ValueError(
                    f"`puzzle_identifiers` must be a tensor of shape (batch,) = ({input_ids.shape[0]},), got "
                    f"{getattr(puzzle_identifiers, 'shape', puzzle_identifiers)!r}."
                )
            if puzzle_identifiers.numel() and (
                int(puzzle_identifiers.min()) < 0 or int(puzzle_identifiers.max()) >= config.num_puzzle_identifiers
            ):
                raise ValueError(
                    f"`puzzle_identifiers` must lie in [0, {config.num_puzzle_identifiers - 1}] "
                    f"(num_puzzle_identifiers={config.num_puzzle_identifiers}), got values in "
                    f"[{int(puzzle_identifiers.min())}, {int(puzzle_identifiers.max())}]."
                )

    def embed(self, input_ids, puzzle_identifiers=None):
        """x: (batch, prefix + tokens, hidden), the input re-injected at every loop step."""
        scale = self.config.hidden_size**0.5  # embeddings are initialised at std 1/sqrt(d): x has unit scale
        x = self.embed_tokens(input_ids)
        if self.prefix is not None:
            if puzzle_identifiers is None:
                puzzle_identifiers = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
            x = torch.cat([self.prefix[puzzle_identifiers].to(x.dtype), x], dim=1)
        if self.embed_positions is not None:
            x = x + self.embed_positions(torch.arange(x.shape[1], device=x.device))[None]
        return scale * x

    def initial_solver_state(self, x, eta=None):
        """A fresh state: y = z0 on every token, η = η0, nothing halted."""
        b, dtype, device = x.shape[0], torch.float32, x.device
        eta = self.config.eta if eta is None else eta
        return FPRMSolverState(
            hidden=self.z_init.to(x.dtype)[None, None].expand_as(x).clone(),
            eta=torch.full((b,), float(eta), dtype=dtype, device=device),
            patience=torch.full((b,), self.config.patience, dtype=torch.long, device=device),
            best=torch.full((b,), float("inf"), dtype=dtype, device=device),
            residuals=torch.full((b,), float("inf"), dtype=dtype, device=device),
            iterations=torch.zeros(b, dtype=torch.long, device=device),
            halted=torch.zeros(b, dtype=torch.bool, device=device),
            converged=torch.zeros(b, dtype=torch.bool, device=device),
            diverged=torch.zeros(b, dtype=torch.bool, device=device),
        )

    def position_embeddings(self, x):
        if self.rotary_emb is None:
            return None
        cos, sin = self.rotary_emb(x.shape[1], x.device, x.dtype)
        return cos[None, None], sin[None, None]

    # ---- one loop step ------------------------------------------------------------------------------------------

    def fixed_point_map(self, y, x, position_embeddings=None):
        """f(y): one loop step with the input x re-injected (module docstring)."""
        alpha1, beta1, alpha2, beta2 = self.residual_scaling(y)
        u = self.injection(y, x)
        if self.config.norm_position == "post":
            h = rms_norm(y + u, self.config.rms_norm_eps)
        else:
            h = alpha2 * y + beta2 * u
        for block in self.layers:
            h = block(h, alpha1, beta1, position_embeddings)
        return h

    # ---- the solver (Algorithm 1) ---------------------------------------------------------------------------------

    def solve(self, x, state, max_loops, halt_eps, gamma, patience, min_eta, halting=True, output_residual_trace=False):
        """Damped fixed-point iteration y ← η·f(y) + (1 − η)·y with per-sample residuals, step decay and halting.

        Only rows still iterating are evaluated; a halted row is frozen. Gradients flow through every iteration run
        here (the Trainer truncates by running short segments and detaching between them).
        """
        y = state.hidden
        eta, pat, best = state.eta.clone(), state.patience.clone(), state.best.clone()
        residuals, iterations = state.residuals.clone(), state.iterations.clone()
        halted, converged, diverged = state.halted.clone(), state.converged.clone(), state.diverged.clone()
        position_embeddings = self.position_embeddings(x)
        start_iterations = iterations.clone()
        trace = []
        for _ in range(max_loops):
            rows = (~halted).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            everyone = rows.numel() == y.shape[0]
            y_a = y if everyone else y[rows]
            f_a = self.fixed_point_map(y_a, x if everyone else x[rows], position_embeddings)
            with torch.no_grad():
                # r = max over tokens of ‖y − f(y)‖∞ / (‖f(y)‖∞ + 1e-8), per sample
                diff = (y_a - f_a).abs().amax(-1).float()
                r = (diff / (f_a.abs().amax(-1).float() + RESIDUAL_DENOM_EPS)).amax(-1)
                finite = torch.isfinite(r)
            e = eta[rows].to(y_a.dtype)[:, None, None]
            new = e * f_a + (1 - e) * y_a
            new = torch.where(finite[:, None, None], new, y_a)  # a non-finite step is discarded: keep the last state
            y = new if everyone else y.index_copy(0, rows, new)
            with torch.no_grad():
                r = torch.where(finite, r, torch.full_like(r, float("inf")))
                iterations[rows] += 1
                residuals[rows] = r
                improved = r < best[rows]
                best[rows] = torch.minimum(best[rows], r)
                p = torch.where(improved, torch.full_like(pat[rows], patience), pat[rows] - 1)
                decay = (p <= 0) & (r >= halt_eps)  # stalled: shrink the step η ← γ·η
                eta[rows] = torch.where(decay, eta[rows] * gamma, eta[rows])
                pat[rows] = torch.where(decay, torch.full_like(p, patience), p)
                now_converged = r < halt_eps
                converged[rows] = now_converged
                diverged[rows] = ~finite
                stop = ~finite
                if halting:
                    stop = stop | now_converged | (eta[rows] < min_eta)
                halted[rows] = stop
                if output_residual_trace:
                    trace.append(residuals.clone())
        new_state = FPRMSolverState(
            hidden=y, eta=eta, patience=pat, best=best, residuals=residuals, iterations=iterations, halted=halted,
            converged=converged, diverged=diverged,
        )
        trace = torch.stack(trace, dim=1) if output_residual_trace and trace else None
        return new_state, iterations - start_iterations, trace

    def _solver_settings(self, halt_eps, max_loops, eta, gamma, patience, min_eta):
        config = self.config
        halt_eps = check_halt_eps(config.halt_eps if halt_eps is None else halt_eps)
        max_loops = check_max_loops(config.max_loops if max_loops is None else max_loops)
        eta = check_unit_interval(config.eta if eta is None else eta, "eta")
        default_gamma = config.gamma_train if self.training else config.gamma_eval
        gamma = check_unit_interval(default_gamma if gamma is None else gamma, "gamma")
        patience = check_patience(config.patience if patience is None else patience)
        min_eta = check_unit_interval(config.min_eta if min_eta is None else min_eta, "min_eta", closed_low=True)
        return halt_eps, max_loops, eta, gamma, patience, min_eta

    def forward(
        self,
        input_ids=None,
        puzzle_identifiers=None,
        halt_eps=None,
        max_loops=None,
        eta=None,
        gamma=None,
        patience=None,
        min_eta=None,
        halting=True,
        solver_state=None,
        output_residual_trace=False,
        return_dict=None,
    ):
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, tokens)`): the puzzle; `tokens` must be height × width of
            `config.grid_size` when a grid is configured.
        puzzle_identifiers (`torch.LongTensor` of shape `(batch,)`, *optional*): row of the prefix table per sample.
        halt_eps (`float`, *optional*): τ; a sample halts when its relative residual is below it (config default).
        max_loops (`int`, *optional*): iteration cap for this call (config default).
        eta (`float`, *optional*): η0 for samples that start here (config default).
        gamma (`float`, *optional*): decay of η; defaults to `gamma_train` in training mode and `gamma_eval` in eval.
        patience (`int`, *optional*): P, iterations without improvement before η decays.
        min_eta (`float`, *optional*): a sample halts when η falls below it.
        halting (`bool`, defaults to `True`): `False` runs every sample for exactly `max_loops` iterations.
        solver_state (`FPRMSolverState`, *optional*): continue from a previous call's `solver_state`.
        output_residual_trace (`bool`, defaults to `False`): also return the residual after every iteration.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        halt_eps, max_loops, eta, gamma, patience, min_eta = self._solver_settings(
            halt_eps, max_loops, eta, gamma, patience, min_eta
        )
        self.check_inputs(input_ids, puzzle_identifiers)
        x = self.embed(input_ids, puzzle_identifiers)
        if solver_state is None:
            solver_state = self.initial_solver_state(x, eta)
        elif not isinstance(solver_state, FPRMSolverState) or solver_state.hidden.shape != x.shape:
            raise ValueError(
                f"`solver_state` must be the FPRMSolverState of a previous call on inputs of this shape "
                f"(state {tuple(x.shape)}), got {type(solver_state).__name__} "
                f"{tuple(getattr(getattr(solver_state, 'hidden', None), 'shape', ()))}."
            )
        state, iterations, trace = self.solve(
            x, solver_state, max_loops, halt_eps, gamma, patience, min_eta, halting, output_residual_trace
        )
        output = FPRMModelOutput(
            last_hidden_state=self.norm(state.hidden),
            iterations=iterations,
            residuals=state.residuals,
            converged=state.converged,
            diverged=state.diverged,
            residual_trace=trace,
            solver_state=state,
        )
        return output if return_dict else output.to_tuple()


class FPRMForReasoning(FPRMPreTrainedModel):
    """FPRM with a per-token classification head: predicts the answer token of every input token (a Sudoku cell,
    a maze cell, the running product of a state-tracking prefix)."""

    def __init__(self, config: FPRMConfig):
        super().__init__(config)
        self.model = FPRMModel(config)
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
        labels=None,
        puzzle_identifiers=None,
        halt_eps=None,
        max_loops=None,
        eta=None,
        gamma=None,
        patience=None,
        min_eta=None,
        halting=True,
        solver_state=None,
        output_residual_trace=False,
        return_dict=None,
    ):
        r"""
        labels (`torch.LongTensor` of shape `(batch, tokens)`, *optional*): target token per input token, -100 ignored.
        The solver knobs are those of [`FPRMModel.forward`].
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labels is not None and torch.is_tensor(input_ids) and labels.shape != input_ids.shape:
            raise ValueError(
                f"`labels` must have the shape of `input_ids` {tuple(input_ids.shape)}, got {tuple(labels.shape)}."
            )
        outputs = self.model(
            input_ids=input_ids,
            puzzle_identifiers=puzzle_identifiers,
            halt_eps=halt_eps,
            max_loops=max_loops,
            eta=eta,
            gamma=gamma,
            patience=patience,
            min_eta=min_eta,
            halting=halting,
            solver_state=solver_state,
            output_residual_trace=output_residual_trace,
            return_dict=True,
        )
        hidden = outputs.last_hidden_state[:, self.config.num_prefix_tokens :]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten().to(logits.device), ignore_index=-100)
        output = FPRMReasoningOutput(
            loss=loss,
            logits=logits,
            iterations=outputs.iterations,
            residuals=outputs.residuals,
            converged=outputs.converged,
            diverged=outputs.diverged,
            residual_trace=outputs.residual_trace,
            solver_state=outputs.solver_state,
        )
        return output if return_dict else output.to_tuple()


__all__ = [
    "FPRMPreTrainedModel",
    "FPRMModel",
    "FPRMForReasoning",
    "FPRMSolverState",
    "FPRMModelOutput",
    "FPRMReasoningOutput",
]
