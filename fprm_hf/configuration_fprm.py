"""Configuration of FPRM, the Fixed-Point Reasoning Model ("Fixed-Point Reasoners: Stable and Adaptive Deep Looped
Transformers", arXiv 2606.18206).

One configuration covers the paper's model and its ablations:

- FPRM (default):   ``residual_scaling="input_independent"`` (α = sigmoid(param) per channel, β tied)
- fixed scalars:    ``residual_scaling="fixed"``
- input-dependent:  ``residual_scaling="input_dependent"`` (α = sigmoid(Linear(RMSNorm(h))))
- outer only:       ``residual_scaling="outer_only"`` (β2 = 1 − α2, α1 = β1 = 1)
- plain pre-norm:   ``residual_scaling="none"`` (diverges as loops grow)
- TRM-style:        ``norm_position="post", residual_scaling="none"`` (post-norm, saturates)

The defaults are the paper's Sudoku-Extreme model (9×9 grid, 3×3 depthwise conv, bidirectional attention, RoPE,
16 learned prefix tokens). For state tracking use ``grid_size=None, conv_type="causal_1d", causal=True,
position_embedding_type="none", num_prefix_tokens=0``.
"""

import math
import numbers

try:  # transformers >= 5.x spells it PreTrainedConfig; keep the old alias working
    from transformers.configuration_utils import PreTrainedConfig
except ImportError:  # pragma: no cover
    from transformers.configuration_utils import PretrainedConfig as PreTrainedConfig


RESIDUAL_SCALINGS = ("input_independent", "fixed", "input_dependent", "outer_only", "none")
NORM_POSITIONS = ("pre", "post")
CONV_TYPES = ("2d", "causal_1d", "none")
POSITION_EMBEDDING_TYPES = ("rope", "learned", "none")
DEFAULT_CONV_KERNEL = {"2d": 3, "causal_1d": 4, "none": None}


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_halt_eps(value, name="halt_eps"):
    """τ must be a positive finite number: the solver halts a sample when its relative residual drops below it."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive finite number (e.g. 0.1 or 1e-3), got {value!r}.")
    return float(value)


def check_max_loops(value, name="max_loops"):
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r} ({type(value).__name__}).")
    return int(value)


def check_unit_interval(value, name, closed_low=False):
    """A number in (0, 1] (or [0, 1] with closed_low): the damping step η or the decay γ."""
    ok = _is_real(value) and math.isfinite(value) and (value >= 0 if closed_low else value > 0) and value <= 1
    if not ok:
        low = "[0" if closed_low else "(0"
        raise ValueError(f"`{name}` must be a number in {low}, 1], got {value!r}.")
    return float(value)


def check_patience(value, name="patience"):
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return int(value)


class FPRMConfig(PreTrainedConfig):
    r"""
    Configuration of an [`FPRMModel`]: `num_hidden_layers` pre-norm blocks (attention + SwiGLU) that define one step
    f of a fixed-point iteration, solved by a damped iteration with adaptive step decay (Algorithm 1).

    Args:
        vocab_size (`int`, defaults to 11): input and output vocabulary (Sudoku: pad, blank, digits 1-9).
        hidden_size (`int`, defaults to 512): width d of the state.
        num_attention_heads (`int`, defaults to 8): attention heads; must divide `hidden_size`.
        intermediate_size (`int`, defaults to 1536): width of the SwiGLU MLP.
        num_hidden_layers (`int`, defaults to 2): N blocks, i.e. 2N residual sub-layers per loop step.
        grid_size (`int` or `[int, int]`, *optional*, defaults to 9): height and width of the input grid; inputs must
            have exactly height × width tokens. `None` accepts sequences of any length (state tracking).
        conv_type (`str`, defaults to `"2d"`): depthwise convolution on the state before the layers: `"2d"` (a
            k×k conv over the grid; needs `grid_size`), `"causal_1d"` (a causal conv over the sequence) or `"none"`.
        conv_kernel_size (`int`, *optional*): kernel size; `None` means 3 for `"2d"` and 4 for `"causal_1d"`.
        causal (`bool`, defaults to `False`): causal attention (state tracking) instead of bidirectional (grids).
        position_embedding_type (`str`, defaults to `"rope"`): `"rope"`, `"learned"` absolute positions, or `"none"`.
        max_position_embeddings (`int`, defaults to 1024): longest sequence (prefix included) with learned positions.
        rope_theta (`float`, defaults to 10000.0): RoPE base.
        num_prefix_tokens (`int`, defaults to 16): learned prefix tokens put before the input (0 disables them).
        num_puzzle_identifiers (`int`, defaults to 1): rows of the prefix table; with more than one, the prefix is
            chosen per sample by `puzzle_identifiers` (a per-puzzle embedding, as for ARC).
        residual_scaling (`str`, defaults to `"input_independent"`): one of `"input_independent"`, `"fixed"`,
            `"input_dependent"`, `"outer_only"`, `"none"` (see the module docstring).
        norm_position (`str`, defaults to `"pre"`): `"pre"` (FPRM) or `"post"` (TRM-style; needs
            `residual_scaling="none"`).
        alpha1 (`float`, defaults to 0.75): initial (or fixed) inner scale α1 in (0, 1).
        alpha2 (`float`, defaults to 0.25): initial (or fixed) outer scale α2 in (0, 1).
        init_std (`float`, defaults to 6.0): std of the truncated normal initial latent z0.
        halt_eps (`float`, defaults to 0.1): τ, a sample halts when its relative ∞-norm residual drops below it.
        max_loops (`int`, defaults to 64): iteration cap of the solver.
        eta (`float`, defaults to 1.0): η0, the initial damping step of y ← η·f(y) + (1 − η)·y.
        patience (`int`, defaults to 5): P, iterations without improvement before η decays.
        gamma_train (`float`, defaults to 0.9): γ, the decay of η in training mode.
        gamma_eval (`float`, defaults to 0.99): γ in evaluation mode.
        min_eta (`float`, defaults to 1e-3): a sample halts when η falls below this.
        rms_norm_eps (`float`, defaults to 1e-5): epsilon of every RMSNorm.
        initializer_range (`float`, *optional*): std of linear weights; `None` uses LeCun (1/sqrt(fan_in)).
        attention_dropout (`float`, defaults to 0.0): dropout on attention probabilities in training.
        attention_bias (`bool`, defaults to `False`): biases in the attention projections.
        mlp_bias (`bool`, defaults to `False`): biases in the MLP projections.
    """

    model_type = "fprm"
    # Trainer.prediction_step drops these from the outputs it gathers across evaluation batches.
    keys_to_ignore_at_inference = ["solver_state", "residual_trace"]

    def __init__(
        self,
        vocab_size=11,
        hidden_size=512,
        num_attention_heads=8,
        intermediate_size=1536,
        num_hidden_layers=2,
        grid_size=9,
        conv_type="2d",
        conv_kernel_size=None,
        causal=False,
        position_embedding_type="rope",
        max_position_embeddings=1024,
        rope_theta=10000.0,
        num_prefix_tokens=16,
        num_puzzle_identifiers=1,
        residual_scaling="input_independent",
        norm_position="pre",
        alpha1=0.75,
        alpha2=0.25,
        init_std=6.0,
        halt_eps=0.1,
        max_loops=64,
        eta=1.0,
        patience=5,
        gamma_train=0.9,
        gamma_eval=0.99,
        min_eta=1e-3,
        rms_norm_eps=1e-5,
        initializer_range=None,
        attention_dropout=0.0,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        if isinstance(grid_size, (tuple, list)) and len(grid_size) == 2:
            grid_size = list(grid_size)
        elif _is_int(grid_size):
            grid_size = [int(grid_size), int(grid_size)]
        self.grid_size = grid_size
        self.conv_type = conv_type
        self.conv_kernel_size = DEFAULT_CONV_KERNEL.get(conv_type) if conv_kernel_size is None else conv_kernel_size
        self.causal = causal
        self.position_embedding_type = position_embedding_type
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.num_prefix_tokens = num_prefix_tokens
        self.num_puzzle_identifiers = num_puzzle_identifiers
        self.residual_scaling = residual_scaling
        self.norm_position = norm_position
        self.alpha1 = alpha1
        self.alpha2 = alpha2
        self.init_std = init_std
        self.halt_eps = halt_eps
        self.max_loops = max_loops
        self.eta = eta
        self.patience = patience
        self.gamma_train = gamma_train
        self.gamma_eval = gamma_eval
        self.min_eta = min_eta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.attention_dropout = attention_dropout
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        super().__init__(tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id, **kwargs)
        self._validate_fields()

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @property
    def num_grid_tokens(self):
        """Tokens an input must have (height × width), or None when any length is accepted."""
        return None if self.grid_size is None else self.grid_size[0] * self.grid_size[1]

    def _validate_fields(self):
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                     "max_position_embeddings", "num_puzzle_identifiers"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if not _is_int(self.num_prefix_tokens) or self.num_prefix_tokens < 0:
            raise ValueError(f"`num_prefix_tokens` must be an integer >= 0, got {self.num_prefix_tokens!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        choices = {
            "residual_scaling": RESIDUAL_SCALINGS,
            "norm_position": NORM_POSITIONS,
            "conv_type": CONV_TYPES,
            "position_embedding_type": POSITION_EMBEDDING_TYPES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)!r}.")
        if self.grid_size is not None and not (
            isinstance(self.grid_size, list) and len(self.grid_size) == 2
            and all(_is_int(s) and s >= 1 for s in self.grid_size)
        ):
            raise ValueError(f"`grid_size` must be None, a positive int or [height, width], got {self.grid_size!r}.")
        if self.conv_type == "2d" and self.grid_size is None:
            raise ValueError("`conv_type='2d'` convolves over a grid and needs `grid_size`; got grid_size=None.")
        if self.conv_type != "none" and (not _is_int(self.conv_kernel_size) or self.conv_kernel_size < 1):
            raise ValueError(f"`conv_kernel_size` must be a positive integer, got {self.conv_kernel_size!r}.")
        if self.conv_type == "2d" and self.conv_kernel_size % 2 == 0:
            raise ValueError(f"A 2-D conv needs an odd `conv_kernel_size` (same padding), got {self.conv_kernel_size}.")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.head_dim}.")
        if not isinstance(self.causal, bool):
            raise ValueError(f"`causal` must be True or False, got {self.causal!r}.")
        if self.norm_position == "post" and self.residual_scaling != "none":
            raise ValueError(
                f"`norm_position='post'` (TRM style) has no residual scaling: it needs residual_scaling='none', "
                f"got {self.residual_scaling!r}."
            )
        for name in ("alpha1", "alpha2"):
            value = getattr(self, name)
            if not (_is_real(value) and 0 < value < 1):
                raise ValueError(f"`{name}` must lie strictly between 0 and 1, got {value!r}.")
        for name in ("init_std", "rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not (_is_real(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"`{name}` must be a positive finite number, got {value!r}.")
        if self.initializer_range is not None and not (_is_real(self.initializer_range) and self.initializer_range > 0):
            raise ValueError(f"`initializer_range` must be None or a positive number, got {self.initializer_range!r}.")
        if not (_is_real(self.attention_dropout) and 0 <= self.attention_dropout < 1):
            raise ValueError(f"`attention_dropout` must be in [0, 1), got {self.attention_dropout!r}.")
        check_halt_eps(self.halt_eps)
        check_max_loops(self.max_loops)
        check_unit_interval(self.eta, "eta")
        check_unit_interval(self.gamma_train, "gamma_train")
        check_unit_interval(self.gamma_eval, "gamma_eval")
        check_unit_interval(self.min_eta, "min_eta", closed_low=True)
        check_patience(self.patience)


__all__ = ["FPRMConfig", "RESIDUAL_SCALINGS", "NORM_POSITIONS", "CONV_TYPES", "POSITION_EMBEDDING_TYPES"]
