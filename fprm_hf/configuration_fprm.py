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

TRM, the paper's baseline (their models/recursive_reasoning/trm.py), is `recursion="trm"` of this configuration: the
same block stack, recursed over two states z_H, z_L instead of solved to a fixed point (fprm_hf/recursion_trm.py).
Their TRM block is `norm_type="post", residual_scaling="none", conv_type="none"`.
"""

import math
import numbers
from typing import Literal

from huggingface_hub.dataclasses import strict, validated_field
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils.type_validators import positive_int_field

from .looped_common import LoopedConfigMixin, check_positive_number, check_rope_parameters, is_real_number

RESIDUAL_SCALINGS = ("input_independent", "fixed", "input_dependent", "none")
NORM_TYPES = ("pre", "post", "peri")
NORM_PLACEMENTS = ("none", "input", "output")
CONV_TYPES = ("2d", "causal_1d", "none")
POSITION_EMBEDDING_TYPES = ("rope", "learned", "none")
DEFAULT_CONV_KERNEL = {"2d": 3, "causal_1d": 4, "none": None}
# Options of earlier versions of this package (all numbered 0.1.0): a config.json that still sets them computed
# something else, so it is refused rather than loaded with the key ignored, naming the commit of this package's
# repository whose code reads it. `norm_position` was saved by every version before the authors' layout (05bdf19:
# fused q|k|v and gate|up, no final norm, a fresh z0), e.g. b160b8c; the other two were options until 8db7780.
REMOVED_OPTIONS = {"conv_placement": "state", "final_norm": False, "norm_position": None}
READS_REMOVED = {
    "norm_position": "ffb16f3 (the last commit before 05bdf19 changed the layout)",
    "conv_placement": "7688b05 (the last commit before 8db7780 removed it)",
    "final_norm": "7688b05 (the last commit before 8db7780 removed it)",
}


def swiglu_width(hidden_size, expansion):
    """The authors' SwiGLU width: expansion · d · 2/3, rounded to an integer, then up to a multiple of 256."""
    width = round(expansion * hidden_size * 2 / 3)
    return -(width // -256) * 256


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# ---- the solver's knobs, checked alike as config fields and as a forward's arguments (`SolverSettings`) -------------


def check_halt_eps(value, name="halt_eps"):
    """τ must be a positive finite number: the solver halts a sample when its relative residual drops below it."""
    if not is_real_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive finite number (e.g. 0.1 or 1e-3), got {value!r}.")
    return float(value)


def check_max_loops(value, name="max_loops"):
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r} ({type(value).__name__}).")
    return int(value)


def check_unit_interval(value, name="value", closed_low=False):
    """A number in (0, 1] (or [0, 1] with closed_low): the damping step η or the decay γ."""
    ok = is_real_number(value) and math.isfinite(value) and (value >= 0 if closed_low else value > 0) and value <= 1
    if not ok:
        raise ValueError(f"`{name}` must be a number in {'[0' if closed_low else '(0'}, 1], got {value!r}.")
    return float(value)


def check_min_eta(value, name="min_eta"):
    return check_unit_interval(value, name, closed_low=True)


HALT_SCOPES = ("sample", "batch")
RECURSIONS = ("fixed_point", "trm")


def check_halt_scope(value, name="halt_scope"):
    """ "sample" (each row halts on its own) or "batch" (the authors' evaluation: every row at once)."""
    if value not in HALT_SCOPES:
        raise ValueError(f"`{name}` must be one of {HALT_SCOPES}, got {value!r}.")
    return value


def check_patience(value, name="patience"):
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return int(value)


# ---- the other field rules transformers does not provide (and `check_positive_number`, `check_rope_parameters`,
# LoopFormer's too: looped_common.py): check(value) raises ValueError


def _open_unit(value):
    if not 0 < value < 1:
        raise ValueError(f"Value must lie strictly between 0 and 1, got {value!r}.")


def _dropout(value):
    if not 0 <= value < 1:
        raise ValueError(f"Value must be in [0, 1), got {value!r}.")


def _probability(value):
    if not 0 <= value <= 1:
        raise ValueError(f"Value must be a probability in [0, 1], got {value!r}.")


def _non_negative_int(value):
    if value < 0:
        raise ValueError(f"Value must be an integer >= 0, got {value!r}.")


def _seed(value):
    if not -(2**63) <= value < 2**64:
        raise ValueError(f"Value must be an integer in [-2**63, 2**64) (a torch seed), got {value!r}.")


def _grid_size(value):
    """None, a positive int (a square grid) or [height, width]."""
    if (
        isinstance(value, (list, tuple))
        and not (len(value) == 2 and all(_is_int(s) and s >= 1 for s in value))
        or (_is_int(value) and value < 1)
    ):
        raise ValueError(f"Value must be None, a positive int or [height, width], got {value!r}.")


@strict
class FPRMConfig(LoopedConfigMixin, PreTrainedConfig):
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
        halt_scope (`str`, defaults to `"sample"`): in evaluation mode, `"sample"` halts each row on its own (halted
            rows frozen); `"batch"` halts every row at once, at the first iteration where the batch's largest
            residual is below `halt_eps` or its largest η below `min_eta` (the authors' evaluation). Training mode
            halts per sample, as theirs.
        recursion (`str`, defaults to `"fixed_point"`): how the block stack f is looped. `"fixed_point"`: FPRM's
            solver (the fields above). `"trm"`: TRM's recursion (their trm.py, fprm_hf/recursion_trm.py): states z_H
            and z_L from the stored vectors `H_init`, `L_init`; one ACT step runs `H_cycles` cycles of `L_cycles`
            updates z_L ← f(z_L, z_H + x) then z_H ← f(z_H, z_L), the last cycle with gradient and
            `n_backwards_L` z_L updates; the logits read z_H. A forward runs `halt_max_steps` ACT steps in evaluation
            (theirs) and `max_loops` when given (then counting ACT steps); the solver's other knobs do not apply.
        H_cycles (`int`, defaults to 3): TRM's cycles per ACT step (the first `H_cycles` − 1 without gradient).
        L_cycles (`int`, defaults to 6): TRM's z_L updates per cycle.
        n_backwards_L (`int`, *optional*): z_L updates of the last cycle, with gradient; `None`: `L_cycles` (theirs).
        halt_max_steps (`int`, defaults to 16): TRM's ACT steps: the most a sample trains for, and what an evaluation
            runs.
        halt_exploration_prob (`float`, defaults to 0.1): in training, the probability that a sample draws a minimum
            number of ACT steps (uniform in 2..`halt_max_steps`) before its Q-head may halt it (their exploration).
        rms_norm_eps (`float`, defaults to 1e-5): epsilon of every RMSNorm.
        initializer_range (`float`, *optional*): std of linear weights; `None` uses LeCun (1/sqrt(fan_in)).
        attention_dropout (`float`, defaults to 0.0): dropout on attention probabilities in training.
        attention_bias (`bool`, defaults to `False`): a bias in the attention projections.
        mlp_bias (`bool`, defaults to `False`): a bias in the MLP projections.

    Validated as transformers validates Llama's config (huggingface_hub's `@strict`): each field's type and rule
    whenever it is set (constructor, `config.json`, `from_pretrained` kwargs, attribute set; a refused value is not
    kept), raising `StrictDataclassFieldValidationError`; the rules between fields (`validate_architecture`) at
    construction, after `from_pretrained` kwargs, at `save_pretrained` and on `config.validate()`, raising
    `StrictDataclassClassValidationError`. Both name the field and the value given. The options of earlier
    versions (`conv_placement="injection"`, `final_norm=True`, `norm_position`) are refused (`ValueError`).
    """

    model_type = "fprm"
    # Trainer.prediction_step drops these from the outputs it gathers across evaluation batches.
    keys_to_ignore_at_inference = ["solver_state", "residual_trace"]
    # Folders with no config.json in another layout (the authors' step files) register a derivation here,
    # `derive(path, kwargs)` -> (config dict, unused kwargs) or None (`fprm_hf/__init__.py`): this module imports no
    # loader.
    config_loaders = []

    vocab_size: int = positive_int_field(default=11)
    hidden_size: int = positive_int_field(default=512)
    num_attention_heads: int = positive_int_field(default=8)
    expansion: int | float = validated_field(check_positive_number, default=4.0)
    intermediate_size: int | None = positive_int_field(default=None)
    num_hidden_layers: int = positive_int_field(default=2)
    grid_size: int | list | tuple | None = validated_field(_grid_size, default=None)
    conv_type: Literal[CONV_TYPES] = "causal_1d"
    conv_kernel_size: int | None = positive_int_field(default=None)
    conv_bias: bool = False
    causal: bool = False
    position_embedding_type: Literal[POSITION_EMBEDDING_TYPES] = "rope"
    max_position_embeddings: int = positive_int_field(default=1024)
    rope_parameters: dict | None = validated_field(check_rope_parameters, default=None)
    num_prefix_tokens: int = validated_field(_non_negative_int, default=16)
    num_puzzle_identifiers: int = positive_int_field(default=1)
    puzzle_emb_ndim: int | None = positive_int_field(default=None)
    use_q_head: bool = False
    residual_scaling: Literal[RESIDUAL_SCALINGS] = "input_independent"
    outer_only: bool = False
    alpha1: int | float = validated_field(_open_unit, default=0.5)
    alpha2: int | float = validated_field(_open_unit, default=0.5)
    norm_type: Literal[NORM_TYPES] = "pre"
    norm_placement: Literal[NORM_PLACEMENTS] = "none"
    normalize_input_injection: bool = False
    softmax_temperature: int | float = validated_field(check_positive_number, default=1.0)
    init_std: int | float = validated_field(check_positive_number, default=1.0)
    fixed_init: bool = False
    initial_state_seed: int = validated_field(_seed, default=0)
    halt_eps: int | float = validated_field(check_halt_eps, default=0.1)
    max_loops: int = validated_field(check_max_loops, default=64)
    eta: int | float = validated_field(check_unit_interval, default=1.0)
    patience: int = validated_field(check_patience, default=5)
    gamma_train: int | float = validated_field(check_unit_interval, default=0.9)
    gamma_eval: int | float = validated_field(check_unit_interval, default=0.99)
    min_eta: int | float = validated_field(check_min_eta, default=1e-3)
    halt_scope: Literal[HALT_SCOPES] = "sample"
    recursion: Literal[RECURSIONS] = "fixed_point"
    H_cycles: int = positive_int_field(default=3)
    L_cycles: int = positive_int_field(default=6)
    n_backwards_L: int | None = positive_int_field(default=None)
    halt_max_steps: int = positive_int_field(default=16)
    halt_exploration_prob: int | float = validated_field(_probability, default=0.1)
    rms_norm_eps: int | float = validated_field(check_positive_number, default=1e-5)
    initializer_range: int | float | None = validated_field(check_positive_number, default=None)
    attention_dropout: int | float = validated_field(_dropout, default=0.0)
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 0

    def __post_init__(self, **kwargs):
        for name, kept in REMOVED_OPTIONS.items():
            if name in kwargs and kwargs[name] != kept:
                raise ValueError(
                    f"`{name}={kwargs[name]!r}`: this config.json was saved by an earlier version of this package, "
                    f"whose model computes another step than this one (the authors', docs/fprm.md), so it does not "
                    f"load here. Load it with the package at commit {READS_REMOVED[name]}, or retrain."
                )
            kwargs.pop(name, None)
        self.warn_unknown_kwargs(kwargs, also_allowed=("authors_checkpoint",))
        if self.intermediate_size is None:
            self.intermediate_size = swiglu_width(self.hidden_size, self.expansion)
        if self.conv_kernel_size is None:
            self.conv_kernel_size = DEFAULT_CONV_KERNEL[self.conv_type]
        if self.grid_size is not None:
            self.grid_size = list(self.grid_shape)
        if self.n_backwards_L is None:
            self.n_backwards_L = self.L_cycles
        rope, given = self.position_embedding_type == "rope", self.rope_parameters
        # transformers fills in rope_type and rope_theta (a `rope_theta` kwarg, else 1e4)
        self.rope_parameters = {"partial_rotary_factor": 1.0, **(given or {})} if rope else None
        if not rope:
            kwargs.pop("rope_theta", None)  # saved by earlier versions for every model; these positions have none
        super().__post_init__(**kwargs)
        if not rope:  # transformers gives any config with the field a default RoPE: these positions keep theirs
            self.rope_parameters = given

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """As `PreTrainedConfig.get_config_dict` (what `FPRMConfig.from_pretrained` reads); a folder with no config.json
        that a registered layout knows (the authors' step files:
        `FPRMConfig.from_pretrained("fixed-point-reasoners/fprm", subfolder="sudoku")`) gives the config dict derived
        from its files. `AutoConfig` reads config.json alone (transformers' own `get_config_dict`), so it gives
        transformers' own error for such a folder."""
        try:  # no config.json: an OSError, or (a local folder) an empty dict
            found = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        except OSError as error:
            found, missing = None, error
        if not found or not found[0]:
            for derive in FPRMConfig.config_loaders:
                if (derived := derive(pretrained_model_name_or_path, kwargs)) is not None:
                    return derived
        if found is None:
            raise missing
        return found

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """As `PreTrainedConfig.from_dict`; the rules between fields run again once `from_pretrained`'s kwargs are
        set (transformers sets them one by one after construction)."""
        loaded = super().from_dict(config_dict, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded).validate()
        return loaded

    @property
    def grid_shape(self):
        """(height, width) of the input grid (`grid_size`, an int meaning a square one), or None."""
        size = self.grid_size
        return None if size is None else (size, size) if isinstance(size, int) else tuple(size)

    @property
    def num_grid_tokens(self):
        """Tokens an input must have (height × width), or None when any length is accepted."""
        return None if self.grid_size is None else math.prod(self.grid_shape)

    def validate_architecture(self):
        """The rules between fields (each field's own rule is its validator; `@strict` runs every `validate_*`)."""
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
            raise ValueError(
                f"A 2-D conv needs an odd `conv_kernel_size` (same padding), got {self.conv_kernel_size}."
            )
        if (ndim := self.puzzle_emb_ndim) is not None and ndim > self.num_prefix_tokens * self.hidden_size:
            raise ValueError(
                f"`puzzle_emb_ndim` ({ndim}) must be at most num_prefix_tokens × hidden_size = "
                f"{self.num_prefix_tokens} × {self.hidden_size} = {self.num_prefix_tokens * self.hidden_size} "
                f"(the values of the prefix rows), or None."
            )


__all__ = [
    "FPRMConfig",
    "HALT_SCOPES",
    "RECURSIONS",
    "RESIDUAL_SCALINGS",
    "NORM_TYPES",
    "NORM_PLACEMENTS",
    "CONV_TYPES",
    "POSITION_EMBEDDING_TYPES",
    "swiglu_width",
]
