"""Configuration of FPRM, the Fixed-Point Reasoning Model ("Fixed-Point Reasoners: Stable and Adaptive Deep Looped
Transformers", arXiv 2606.18206).

The defaults compute what the authors' code computes with their `config/arch/fprm.yaml` (GitHub
nilskiKonjIzDunava/fprm): one loop step f(y) is

    y' = [prefix rows of y ; DWConv(grid rows of y)]      the conv acts on the raw state and replaces it
    h  = α2·y' + β2·x                                     re-inject the input x
    h  = α1·h + β1·F(RMSNorm(h))                          for each of the 2N sub-layers F (pre-norm)

with a causal kernel-4 conv, RoPE, 16 prefix rows, α1 = α2 = 0.5 at init and z0 drawn fresh (truncated normal,
std `init_std`) for every sample and token. Their task configs differ from it (docs/fprm.md lists them): state
tracking uses `causal=True, position_embedding_type="none", num_prefix_tokens=0, init_std=6.0`; Sudoku uses
`conv_type="2d"` with a 3×3 kernel and α1/α2 = 0.75/0.25; the maze uses `norm_placement="output"`.

Ablations and variants of the paper, all options of this one configuration:

- residual scaling: `residual_scaling` = "input_independent" (default) | "fixed" | "input_dependent" | "none",
  and `outer_only=True` (β2 = 1 − α2, α1 = β1 = 1);
- norms: `norm_type` = "pre" | "post" (TRM style) | "peri", `norm_placement` = "none" | "input" | "output",
  `normalize_input_injection`;
- the initial state: `fixed_init=True` (one stored z0 vector, their `L_optimizer.init_vec`).
"""

import math
import numbers

try:  # transformers >= 5.x spells it PreTrainedConfig; keep the old alias working
    from transformers.configuration_utils import PreTrainedConfig
except ImportError:  # pragma: no cover
    from transformers.configuration_utils import PretrainedConfig as PreTrainedConfig


RESIDUAL_SCALINGS = ("input_independent", "fixed", "input_dependent", "none")
NORM_TYPES = ("pre", "post", "peri")
NORM_PLACEMENTS = ("none", "input", "output")
CONV_TYPES = ("2d", "causal_1d", "none")
POSITION_EMBEDDING_TYPES = ("rope", "learned", "none")
DEFAULT_CONV_KERNEL = {"2d": 3, "causal_1d": 4, "none": None}
# Options of earlier versions of this package, removed in 0.1.0: a config.json that still sets them computed
# something else, so it is refused rather than loaded with the key ignored.
REMOVED_OPTIONS = {"conv_placement": "state", "final_norm": False, "norm_position": None}


def swiglu_width(hidden_size, expansion):
    """The authors' SwiGLU width: expansion · d · 2/3, rounded to an integer, then up to a multiple of 256."""
    width = round(expansion * hidden_size * 2 / 3)
    return -(width // -256) * 256


def _is_real_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# ---- the rules a field's value must follow: check(value, name) returns the value or raises ValueError ----------------

def check_halt_eps(value, name="halt_eps"):
    """τ must be a positive finite number: the solver halts a sample when its relative residual drops below it."""
    if not _is_real_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive finite number (e.g. 0.1 or 1e-3), got {value!r}.")
    return float(value)


def check_max_loops(value, name="max_loops"):
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r} ({type(value).__name__}).")
    return int(value)


def check_unit_interval(value, name, closed_low=False):
    """A number in (0, 1] (or [0, 1] with closed_low): the damping step η or the decay γ."""
    ok = _is_real_number(value) and math.isfinite(value) and (value >= 0 if closed_low else value > 0) and value <= 1
    if not ok:
        low = "[0" if closed_low else "(0"
        raise ValueError(f"`{name}` must be a number in {low}, 1], got {value!r}.")
    return float(value)


def check_min_eta(value, name="min_eta"):
    return check_unit_interval(value, name, closed_low=True)


def check_patience(value, name="patience"):
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return int(value)


def _positive_int(value, name):
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return value


def _boolean(value, name):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")
    return value


def _one_of(choices):
    def check(value, name):
        if value not in choices:
            raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")
        return value
    return check


def _positive_float(value, name):
    if not (_is_real_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"`{name}` must be a positive finite number, got {value!r}.")
    return value


def _rope_parameters(value, name):
    """None or transformers' `rope_parameters` dict: a known "rope_type", a positive "rope_theta" and "factor", a
    "partial_rotary_factor" in (0, 1] (the rules transformers' own validation adds run in `__init__`)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if value is None:
        return value
    if not isinstance(value, dict):
        raise ValueError(f"`{name}` must be a dict (rope_type, rope_theta, ...), got {value!r}.")
    if value.get("rope_type", "default") not in (kinds := ("default", *ROPE_INIT_FUNCTIONS)):
        raise ValueError(f"`{name}['rope_type']` must be one of {kinds}, got {value['rope_type']!r}.")
    for key in ("rope_theta", "factor"):
        if key in value:
            _positive_float(value[key], f"{name}['{key}']")
    partial = value.get("partial_rotary_factor", 1.0)
    if not (_is_real_number(partial) and 0 < partial <= 1):
        raise ValueError(f"`{name}['partial_rotary_factor']` must be in (0, 1], got {partial!r}.")
    return value


def _optional(check, allowed=None):
    """None, or what `check` allows (then its message, or "`name` must be {allowed}, got ...")."""
    def optional(value, name):
        if value is None:
            return None
        try:
            return check(value, name)
        except ValueError:
            if allowed is None:
                raise
            raise ValueError(f"`{name}` must be {allowed}, got {value!r}.") from None
    return optional


def _open_unit(value, name):
    if not (_is_real_number(value) and 0 < value < 1):
        raise ValueError(f"`{name}` must lie strictly between 0 and 1, got {value!r}.")
    return value


def _dropout(value, name):
    if not (_is_real_number(value) and 0 <= value < 1):
        raise ValueError(f"`{name}` must be in [0, 1), got {value!r}.")
    return value


def _non_negative_int(value, name):
    if not _is_int(value) or value < 0:
        raise ValueError(f"`{name}` must be an integer >= 0, got {value!r}.")
    return value


def _seed(value, name):
    if not (_is_int(value) and -(2**63) <= value < 2**64):
        raise ValueError(f"`{name}` must be an integer in [-2**63, 2**64) (a torch seed), got {value!r}.")
    return value


def _grid_size(value, name):
    """None, a positive int (a square grid) or [height, width]; returned as [height, width]."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        value = list(value)
    elif _is_int(value):
        value = [int(value), int(value)]
    if value is not None and not (isinstance(value, list) and len(value) == 2 and all(_is_int(s) and s >= 1
                                                                                     for s in value)):
        raise ValueError(f"`{name}` must be None, a positive int or [height, width], got {value!r}.")
    return value


# Every field's rule, declared once. `FPRMConfig.__setattr__` applies it to each value however it arrives (the
# constructor, config.json, `from_pretrained` kwargs, an attribute set); `validate_architecture` then checks the
# fields that constrain one another.
FIELD_CHECKS = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                     "max_position_embeddings", "num_puzzle_identifiers"), _positive_int),
    **dict.fromkeys(("causal", "outer_only", "conv_bias", "normalize_input_injection", "fixed_init", "attention_bias",
                     "mlp_bias", "tie_word_embeddings", "use_q_head"), _boolean),
    **dict.fromkeys(("init_std", "rms_norm_eps", "expansion", "softmax_temperature"), _positive_float),
    "rope_parameters": _rope_parameters,
    "residual_scaling": _one_of(RESIDUAL_SCALINGS),
    "norm_type": _one_of(NORM_TYPES),
    "norm_placement": _one_of(NORM_PLACEMENTS),
    "conv_type": _one_of(CONV_TYPES),
    "position_embedding_type": _one_of(POSITION_EMBEDDING_TYPES),
    "alpha1": _open_unit,
    "alpha2": _open_unit,
    "num_prefix_tokens": _non_negative_int,
    "initial_state_seed": _seed,
    "puzzle_emb_ndim": _optional(_positive_int, "None (all prefix values learned) or an integer >= 1"),
    "grid_size": _grid_size,
    "conv_kernel_size": _optional(_positive_int),
    "initializer_range": _optional(_positive_float, "None or a positive finite number"),
    "attention_dropout": _dropout,
    # the solver's defaults; a forward's own values go through the same rules (`SolverSettings`)
    "halt_eps": check_halt_eps,
    "max_loops": check_max_loops,
    "eta": check_unit_interval,
    "gamma_train": check_unit_interval,
    "gamma_eval": check_unit_interval,
    "min_eta": check_min_eta,
    "patience": check_patience,
}
# The fields `validate_architecture` reads: setting one re-runs it (and a refused value is not kept).
CROSS_CHECKED_FIELDS = ("hidden_size", "num_attention_heads", "grid_size", "conv_type", "conv_kernel_size",
                        "position_embedding_type", "num_prefix_tokens", "puzzle_emb_ndim")


class FPRMConfig(PreTrainedConfig):
    r"""
    Configuration of an [`FPRMModel`]: `num_hidden_layers` blocks (attention + SwiGLU) that define one step f of a
    fixed-point iteration, solved by a damped iteration with adaptive step decay (Algorithm 1). The defaults are the
    authors' architecture defaults (module docstring).

    Args:
        vocab_size (`int`, defaults to 11): input and output vocabulary.
        hidden_size (`int`, defaults to 512): width d of the state.
        num_attention_heads (`int`, defaults to 8): attention heads; must divide `hidden_size`.
        expansion (`float`, defaults to 4.0): SwiGLU expansion; sets `intermediate_size` when that is not given.
        intermediate_size (`int`, *optional*): SwiGLU width; `None` uses the authors' rule, expansion · d · 2/3
            rounded up to a multiple of 256 (1536 for d = 512).
        num_hidden_layers (`int`, defaults to 2): N blocks, i.e. 2N residual sub-layers per loop step.
        grid_size (`int` or `[int, int]`, *optional*): height and width of an input grid; inputs must then have
            exactly height × width tokens. `None` (default) accepts sequences of any length.
        conv_type (`str`, defaults to `"causal_1d"`): depthwise convolution (no bias) over the grid/sequence rows of
            the state: `"causal_1d"` (kernel k, k − 1 zeros on the left), `"2d"` (k × k over the grid, needs
            `grid_size`) or `"none"`.
        conv_kernel_size (`int`, *optional*): `None` means 4 for `"causal_1d"` and 3 for `"2d"`.
        conv_bias (`bool`, defaults to `False`): a bias in the conv (the authors' `conv_bias`).
        causal (`bool`, defaults to `False`): causal attention (state tracking) instead of bidirectional.
        position_embedding_type (`str`, defaults to `"rope"`): `"rope"` (on q and k), `"learned"` absolute
            positions (x = √d·(emb + pos)/√2), or `"none"`.
        max_position_embeddings (`int`, defaults to 1024): rows of the learned position table (prefix included).
        rope_parameters (`dict`, *optional*): transformers' RoPE settings, with `position_embedding_type="rope"`:
            `{"rope_type": "default", "rope_theta": 10000.0}` (the authors') unless given; "linear", "dynamic",
            "yarn", ... scale the frequencies as for Llama, "partial_rotary_factor" < 1 rotates that share of each
            head. A `rope_theta` keyword (configs saved before this field, the authors' converted configs) is read
            into it.
        num_prefix_tokens (`int`, defaults to 16): learned prefix rows put before the input (their puzzle
            embedding; 0 disables them). The conv leaves them unchanged.
        num_puzzle_identifiers (`int`, defaults to 1): rows of the prefix table, chosen per sample by
            `puzzle_identifiers`.
        puzzle_emb_ndim (`int`, *optional*): how many values of a sample's prefix rows are learned (their
            `puzzle_emb_ndim`, row-major over the `num_prefix_tokens` × `hidden_size` values); the others are zero.
            Their Sudoku/maze configs learn `hidden_size` values, i.e. the first row of 16. `None` (default): all.
        use_q_head (`bool`, defaults to `False`): a Q-head (their `q_head`, d → 2 with bias, weight 0 and bias −5 at
            init) on the first row of the final state; `q_halt_logits` is its first output. It changes no logits; the
            trainer adds their Q-halt loss (BCE(q_halt, sequence correct)) when the model has it.
        residual_scaling (`str`, defaults to `"input_independent"`): `"input_independent"` (α = sigmoid(param) per
            channel), `"fixed"` (the constants `alpha1`, `alpha2`), `"input_dependent"` (α = sigmoid(Linear(y')) per
            token and channel) or `"none"` (α = β = 1). β's are tied: β2 = 1 − α2·α1^(2N),
            β1 = β2·(1 − α1)/(1 − α1^(2N) + 1e-5).
        outer_only (`bool`, defaults to `False`): only the outer mix is scaled: β2 = 1 − α2, α1 = β1 = 1.
        alpha1 (`float`, defaults to 0.5): initial (or fixed) inner scale α1 in (0, 1).
        alpha2 (`float`, defaults to 0.5): initial (or fixed) outer scale α2 in (0, 1).
        norm_type (`str`, defaults to `"pre"`): `"pre"` (h ← α1·h + β1·F(RMSNorm(h))), `"post"`
            (h ← RMSNorm(α1·h + β1·F(h)), TRM style) or `"peri"` (h ← α1·h + β1·RMSNorm(F(RMSNorm(h)))).
        norm_placement (`str`, defaults to `"none"`): an extra weightless RMSNorm of the state, `"input"` (after the
            conv, before the mix) or `"output"` (at the end of f; the authors' maze config).
        normalize_input_injection (`bool`, defaults to `False`): re-inject RMSNorm(x) instead of x.
        softmax_temperature (`float`, defaults to 1.0): attention scores are scaled by 1/(√head_dim · temperature).
        init_std (`float`, defaults to 1.0): std of the truncated normal (cut at ±2 std of the underlying normal,
            rescaled to this std) that z0 is drawn from; their task configs use 6.0.
        fixed_init (`bool`, defaults to `False`): `False`: z0 is drawn fresh for every sample and token at every
            reset. `True`: one stored vector `z_init` (drawn at initialisation, saved with the weights) on every token.
        initial_state_seed (`int`, defaults to 0): seed of the z0 draw in evaluation mode, so that an eval forward
            is deterministic (see [`FPRMModel.initial_solver_state`]).
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
        attention_bias (`bool`, defaults to `False`): a bias in the attention projections.
        mlp_bias (`bool`, defaults to `False`): a bias in the MLP projections.

    Every field is validated however it arrives (constructor, `config.json`, `from_pretrained` kwargs, attribute
    set) by its rule in `FIELD_CHECKS`: bad values raise `ValueError`, booleans must be `True` or `False`. The
    options of earlier versions (`conv_placement="injection"`, `final_norm=True`, `norm_position`) are refused.
    """

    model_type = "fprm"
    # Trainer.prediction_step drops these from the outputs it gathers across evaluation batches.
    keys_to_ignore_at_inference = ["solver_state", "residual_trace"]

    def __init__(
        self,
        vocab_size=11,
        hidden_size=512,
        num_attention_heads=8,
        expansion=4.0,
        intermediate_size=None,
        num_hidden_layers=2,
        grid_size=None,
        conv_type="causal_1d",
        conv_kernel_size=None,
        conv_bias=False,
        causal=False,
        position_embedding_type="rope",
        max_position_embeddings=1024,
        rope_parameters=None,
        num_prefix_tokens=16,
        num_puzzle_identifiers=1,
        puzzle_emb_ndim=None,
        use_q_head=False,
        residual_scaling="input_independent",
        outer_only=False,
        alpha1=0.5,
        alpha2=0.5,
        norm_type="pre",
        norm_placement="none",
        normalize_input_injection=False,
        softmax_temperature=1.0,
        init_std=1.0,
        fixed_init=False,
        initial_state_seed=0,
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
        for name, kept in REMOVED_OPTIONS.items():
            if name in kwargs and kwargs[name] != kept:
                raise ValueError(
                    f"`{name}={kwargs[name]!r}` is an option of earlier versions of this package, removed in 0.1.0 "
                    f"(the model computes the authors' step, docs/fprm.md): their checkpoints do not load here."
                )
            kwargs.pop(name, None)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.expansion = expansion
        if intermediate_size is None and _is_real_number(expansion) and _is_int(hidden_size):
            intermediate_size = swiglu_width(hidden_size, expansion)
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.grid_size = grid_size
        self.conv_type = conv_type
        self.conv_kernel_size = DEFAULT_CONV_KERNEL.get(conv_type) if conv_kernel_size is None else conv_kernel_size
        self.conv_bias = conv_bias
        self.causal = causal
        self.position_embedding_type = position_embedding_type
        self.max_position_embeddings = max_position_embeddings
        if position_embedding_type == "rope":  # transformers fills in rope_type and rope_theta (kwargs, else 1e4)
            self.rope_parameters = ({"partial_rotary_factor": 1.0, **rope_parameters} if isinstance(rope_parameters, dict)
                                    else rope_parameters or {"partial_rotary_factor": 1.0})
        elif rope_parameters is not None:
            raise ValueError(f"`rope_parameters` apply to position_embedding_type='rope', got {rope_parameters!r} "
                             f"with position_embedding_type={position_embedding_type!r}.")
        else:
            kwargs.pop("rope_theta", None)  # saved by earlier versions for every model; these positions have none
        self.num_prefix_tokens = num_prefix_tokens
        self.num_puzzle_identifiers = num_puzzle_identifiers
        self.puzzle_emb_ndim = puzzle_emb_ndim
        self.use_q_head = use_q_head
        self.residual_scaling = residual_scaling
        self.outer_only = outer_only
        self.alpha1 = alpha1
        self.alpha2 = alpha2
        self.norm_type = norm_type
        self.norm_placement = norm_placement
        self.normalize_input_injection = normalize_input_injection
        self.softmax_temperature = softmax_temperature
        self.init_std = init_std
        self.fixed_init = fixed_init
        self.initial_state_seed = initial_state_seed
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
        try:  # transformers validates `rope_parameters` per RoPE type here; a missing key is a KeyError
            super().__init__(tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id, **kwargs)
        except KeyError as error:
            if "rope_parameters" not in str(error):
                raise
            raise ValueError(f"`rope_parameters` {self.rope_parameters}: {error.args[0]}") from None
        self.validate_architecture()

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self):
        """The channels of each head that RoPE rotates (all unless `rope_parameters` has partial_rotary_factor < 1)."""
        return int(self.head_dim * (getattr(self, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0))

    @property
    def num_grid_tokens(self):
        """Tokens an input must have (height × width), or None when any length is accepted."""
        return None if self.grid_size is None else self.grid_size[0] * self.grid_size[1]

    def __setattr__(self, name, value):
        # transformers sets config.json values and `from_pretrained` kwargs as attributes: every path meets the rule
        if name in FIELD_CHECKS:
            value = FIELD_CHECKS[name](value, name)
        if name not in CROSS_CHECKED_FIELDS or not all(f in self.__dict__ for f in CROSS_CHECKED_FIELDS):
            return super().__setattr__(name, value)
        old = self.__dict__[name]
        super().__setattr__(name, value)
        try:
            self.validate_architecture()
        except ValueError:
            super().__setattr__(name, old)  # a refused value is not kept
            raise

    def validate_architecture(self):
        """The rules between fields (each field's own rule is in `FIELD_CHECKS`)."""
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        if self.conv_type == "2d" and self.grid_size is None:
            raise ValueError("`conv_type='2d'` convolves over a grid and needs `grid_size`; got grid_size=None.")
        if self.conv_type != "none" and self.conv_kernel_size is None:
            raise ValueError(f"`conv_type={self.conv_type!r}` needs a `conv_kernel_size`, got None.")
        if self.conv_type == "2d" and self.conv_kernel_size % 2 == 0:
            raise ValueError(f"A 2-D conv needs an odd `conv_kernel_size` (same padding), got {self.conv_kernel_size}.")
        ndim = self.puzzle_emb_ndim
        if ndim is not None and ndim > self.num_prefix_tokens * self.hidden_size:
            raise ValueError(
                f"`puzzle_emb_ndim` ({ndim}) must be at most num_prefix_tokens × hidden_size = "
                f"{self.num_prefix_tokens} × {self.hidden_size} = {self.num_prefix_tokens * self.hidden_size} (the "
                f"values of the prefix rows), or None."
            )
        if self.position_embedding_type == "rope" and self.rotary_dim % 2:
            raise ValueError(f"RoPE needs an even rotary dimension, got {self.rotary_dim} (head_dim {self.head_dim}, "
                             f"rope_parameters {self.rope_parameters}).")


__all__ = [
    "FPRMConfig", "RESIDUAL_SCALINGS", "NORM_TYPES", "NORM_PLACEMENTS", "CONV_TYPES", "POSITION_EMBEDDING_TYPES",
    "FIELD_CHECKS", "swiglu_width",
]
