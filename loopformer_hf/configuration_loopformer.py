"""Configuration of LoopFormer (Jeddi et al., "LoopFormer: Elastic-Depth Looped Transformers", ICLR 2026).

One configuration covers the paper's model and its baselines:

- LoopFormer:  ``loop_conditioning="shortcut"`` (every loop step is conditioned on its time t and step size Δ)
- TMLT:        ``loop_conditioning="timestep"`` (conditioned on the integer loop index only)
- Base-Loop:   ``loop_conditioning="none", block_norm_weight=True``
- Base (iso-FLOP, not looped): ``num_hidden_layers=k*L, num_loops=1, loop_conditioning="none", block_norm_weight=True``

The trajectory (loop budget M and step schedule Δ_1..Δ_M) is resolved by
[`LoopFormerConfig.resolve_trajectory`], the one place where a budget or schedule is validated.
"""

import math
import numbers
import warnings

try:  # transformers >= 5.x spells it PreTrainedConfig; keep the old alias working
    from transformers.configuration_utils import PreTrainedConfig
except ImportError:  # pragma: no cover
    from transformers.configuration_utils import PretrainedConfig as PreTrainedConfig


STEP_SCHEDULE_PRESETS = ("uniform", "coarse_to_fine", "fine_to_coarse")
LOOP_CONDITIONING_MODES = ("shortcut", "timestep", "none")
POSITION_EMBEDDING_TYPES = ("learned", "rope")
HALT_KV_FILLS = ("recompute", "reuse")
CACHE_SHARING_MODES = ("none", "modulo")
# What `halt_eps` thresholds (LoopFormerHaltingState.update): the relative state change, the KL divergence between
# successive steps' next-token distributions, or the entropy of the current one (both in nats). The "_shortcut" forms
# exit through one step Δ = 1 − t to t = 1 before freezing; "probe_entropy" runs the one-step trajectory first and the
# budget only for the tokens unsure there (models conditioned on Δ only).
HALT_CRITERIA = ("state_change", "kl", "entropy", "state_change_shortcut", "kl_shortcut", "entropy_shortcut",
                 "probe_entropy")
INITIALIZER_SCHEMES = ("reference", "zero_adaln")
SCHEDULE_SUM_TOLERANCE = 1e-6

POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                       "num_hidden_layers", "num_loops", "max_position_embeddings", "frequency_embedding_size",
                       "max_loop_budget_factor", "cache_share_n")
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "block_norm_weight", "use_cache")
CHOICE_FIELDS = {
    "loop_conditioning": LOOP_CONDITIONING_MODES,
    "position_embedding_type": POSITION_EMBEDDING_TYPES,
    "halt_kv_fill": HALT_KV_FILLS,
    "cache_sharing": CACHE_SHARING_MODES,
    "halt_criterion": HALT_CRITERIA,
    "initializer_scheme": INITIALIZER_SCHEMES,
}
# Fields whose bound depends on another field; re-checked together whenever one of them is set.
LOOP_BUDGET_FIELDS = ("num_loops", "default_loop_budget", "max_loop_budget_factor")

# Llama's tensor-parallel plan (`from_pretrained(..., tp_plan="auto")` under torchrun): attention heads and MLP columns
# split across ranks (gate_proj: the SwiGLU MLP's only), the adaLN modulation and the loop conditioning replicated
TP_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
           "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
           "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}

# Extrapolation warnings are shown once per distinct trajectory, not on every decode step.
_warned_trajectories = set()


def _is_real_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_int(name, value):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r} ({type(value).__name__}).")


def _boolean(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")


def _one_of(choices):
    def check(name, value):
        if value not in choices:
            raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")
    return check


def _positive_number(name, value):
    if not (_is_real_number(value) and value > 0):
        raise ValueError(f"`{name}` must be a positive number, got {value!r}.")


def _rope_parameters(name, value):
    """transformers' `rope_parameters`: "rope_type" one of its RoPE types ("default", "linear", "dynamic", "yarn",
    ...), a positive "rope_theta", "factor" and "partial_rotary_factor" in (0, 1]; keys left out take the defaults."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"`rope_parameters` must be a dict (rope_type, rope_theta, ...), got {value!r}.")
    kinds = ("default", *ROPE_INIT_FUNCTIONS)
    if value.get("rope_type", "default") not in kinds:
        raise ValueError(f"`rope_parameters['rope_type']` must be one of {kinds}, got {value['rope_type']!r}.")
    for key in ("rope_theta", "factor"):
        if key in value and not (_is_real_number(value[key]) and 0 < value[key] < math.inf):
            raise ValueError(f"`rope_parameters['{key}']` must be a positive number, got {value[key]!r}.")
    partial = value.get("partial_rotary_factor", 1.0)
    if not (_is_real_number(partial) and 0 < partial <= 1):
        raise ValueError(f"`rope_parameters['partial_rotary_factor']` must be in (0, 1], got {partial!r}.")


def _activation(name, value):
    from transformers.activations import ACT2FN

    if value != "swiglu" and (not isinstance(value, str) or value not in ACT2FN):
        raise ValueError(
            f"`hidden_act` must be 'swiglu' or an activation of transformers.activations.ACT2FN, got {value!r}."
        )


def _rms_norm_eps(name, value):
    if value is not None and not (_is_real_number(value) and value > 0):
        raise ValueError(f"`rms_norm_eps` must be None or a positive float, got {value!r}.")


def _dropout(name, value):
    if not (_is_real_number(value) and 0 <= value <= 1):
        raise ValueError(f"`attention_dropout` must be a number in [0, 1], got {value!r}.")


def _initializer_range(name, value):
    if not (_is_real_number(value) and 0 <= value < math.inf):
        raise ValueError(f"`initializer_range` must be a non-negative number, got {value!r}.")


def _optional_budget(name, value):
    if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
        raise ValueError(
            f"`default_loop_budget` must be None or an integer >= 1, got {value!r} ({type(value).__name__})."
        )


def _default_step_schedule(name, value):
    """A preset name, or explicit step sizes summing to 1 (the authors' configs store their trajectory as `steps`)."""
    if isinstance(value, str):
        return _one_of(STEP_SCHEDULE_PRESETS)(name, value)
    try:
        LoopFormerConfig._check_schedule(value)
    except ValueError as error:
        raise ValueError(f"`{name}` must be one of {STEP_SCHEDULE_PRESETS} or a list of positive step sizes summing "
                         f"to 1: {error}") from None


# Every field's own rule, declared once: `__setattr__` applies it however a value arrives (the constructor,
# config.json, `from_pretrained` kwargs, an attribute set), `_validate_fields` to all of them after `__init__`.
FIELD_CHECKS = {
    **dict.fromkeys(POSITIVE_INT_FIELDS, _positive_int),
    **dict.fromkeys(BOOL_FIELDS, _boolean),
    **{name: _one_of(choices) for name, choices in CHOICE_FIELDS.items()},
    "hidden_act": _activation,
    "rms_norm_eps": _rms_norm_eps,
    "rope_parameters": _rope_parameters,
    "max_period": _positive_number,
    "attention_dropout": _dropout,
    "initializer_range": _initializer_range,
    "default_loop_budget": _optional_budget,
    "default_step_schedule": _default_step_schedule,
}


def check_halt_eps(value, name="halt_eps"):
    """`None` (fixed depth) or a positive finite float: the per-token halting threshold."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if not _is_real_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be None or a positive finite float, got {value!r} ({type(value).__name__}).")
    return float(value)


def _ramp_on_grid(budget, num_loops, descending):
    """M positive multiples of 1/L summing to 1, as close as possible to a linear ramp M, M-1, ..., 1."""
    weights = [budget - i for i in range(budget)]
    if budget > num_loops:  # no grid schedule exists: use the continuous ramp
        steps = [w / sum(weights) for w in weights]
    else:
        # Each step gets one grid unit, the L-M spare units follow the ramp (largest remainder rounding).
        spare = num_loops - budget
        shares = [spare * w / sum(weights) for w in weights]
        units = [math.floor(s) for s in shares]
        by_remainder = sorted(range(budget), key=lambda i: (units[i] - shares[i], i))
        for i in by_remainder[: spare - sum(units)]:
            units[i] += 1
        steps = [(1 + u) / num_loops for u in units]
    return steps if descending else steps[::-1]


class LoopFormerConfig(PreTrainedConfig):
    r"""
    Configuration of a [`LoopFormerModel`]: `num_hidden_layers` shared blocks looped `num_loops` times.

    Args:
        vocab_size (`int`, defaults to 50304): size of the token vocabulary.
        hidden_size (`int`, defaults to 768): width d of the residual stream.
        num_attention_heads (`int`, defaults to 12): query heads per attention layer.
        num_key_value_heads (`int`, *optional*): key/value heads (grouped-query attention); defaults to
            `num_attention_heads`. Must divide `num_attention_heads`.
        intermediate_size (`int`, defaults to 3072): width of the MLP.
        hidden_act (`str`, defaults to `"gelu"`): MLP activation. `"gelu"` is the reference (a plain two-layer
            MLP); `"swiglu"` selects a gated SiLU MLP; any other name from `transformers.activations.ACT2FN`
            is used in the plain MLP.
        num_hidden_layers (`int`, defaults to 3): k, the number of distinct (shared) blocks.
        num_loops (`int`, defaults to 8): L, the number of loop steps of the training trajectory.
        loop_conditioning (`str`, defaults to `"shortcut"`): `"shortcut"` (t and Δ, LoopFormer), `"timestep"`
            (integer loop index, TMLT) or `"none"` (Base-Loop, no modulation).
        position_embedding_type (`str`, defaults to `"learned"`): `"learned"` absolute positions (reference) or
            `"rope"`.
        rope_parameters (`dict`, *optional*): transformers' RoPE settings, used when `position_embedding_type="rope"`:
            `{"rope_type": "default", "rope_theta": 10000.0}` unless given; "linear", "dynamic", "yarn", ... scale
            the frequencies as for Llama, and "partial_rotary_factor" < 1 rotates that share of each head. A
            `rope_theta` keyword (configs saved before this field) is read into it.
        max_position_embeddings (`int`, defaults to 1024): longest sequence the model accepts.
        tie_word_embeddings (`bool`, defaults to `True`): share the input embedding with `lm_head`.
        rms_norm_eps (`float`, *optional*): epsilon of every RMSNorm; `None` (the reference) uses torch's default
            for float32 inputs (1.19e-7), also in a bf16/fp16 model, which then computes what the reference computes
            under autocast.
        frequency_embedding_size (`int`, defaults to 256): width of the sinusoidal features of t and Δ.
        max_period (`float`, defaults to 10000.0): longest period of those sinusoidal features.
        default_loop_budget (`int`, *optional*): budget M used when a call gives neither `loop_budget` nor a
            schedule list; `None` means `num_loops`.
        default_step_schedule (`str`, defaults to `"uniform"`): preset used when a call gives no schedule; one of
            `"uniform"`, `"coarse_to_fine"`, `"fine_to_coarse"`.
        halt_kv_fill (`str`, defaults to `"reuse"`): with per-token halting (`halt_eps`), how the cache slots a
            halted token skips are filled: `"reuse"` repeats the keys/values of its last computed step;
            `"recompute"` projects them from its frozen state with each later step's modulation. Measured on the
            trained tiny checkpoints (docs/results.md), both give the same quality and "reuse" decodes faster.
        cache_sharing (`str`, defaults to `"none"`): how the KV cache stores the loop steps. `"none"`: one slot per
            (loop step, block), exact. `"modulo"`: an approximation in the spirit of Huginn's shared recurrent cache:
            loop step i writes the slot of step i mod `cache_share_n`, so the cache holds min(M, n) x k slots
            whatever the budget M; a new token at step i attends to earlier tokens' latest step of the same residue
            (exact within one forward call, approximate across decode steps; see docs/compile.md).
        cache_share_n (`int`, defaults to 4): n, the number of loop-step slots per block kept with
            `cache_sharing="modulo"` (Huginn's default is 4). A budget M <= n is exact.
        halt_criterion (`str`, defaults to `"state_change"`): with `halt_eps`, when a token stops looping (after loop
            step i, never beyond the budget): `"state_change"` once ‖h_i − h_{i−1}‖∞ / (‖h_i‖∞ + 1e-8) < halt_eps;
            `"kl"` once KL(p_i ‖ p_{i−1}) < halt_eps (nats), p_i being the next-token distribution read out of h_i
            through the final norm and `lm_head` (p_0 from the embeddings); `"entropy"` once H(p_i) < halt_eps
            (nats). The two distribution criteria need the causal-LM head; a call can override the field.
            `"state_change_shortcut"`, `"kl_shortcut"`, `"entropy_shortcut"` (LoopFormer only): the same scores, but
            a token whose score falls after step i takes one more step, Δ = 1 − t_i to t = 1, and then stops, so that
            its path is a shortcut trajectory the objective trained (i + 1 steps) rather than a cut uniform one.
            `"probe_entropy"` (LoopFormer only): every token first runs the one-step trajectory; where its next-token
            entropy is below halt_eps it keeps that output (1 step), elsewhere it runs the budget from the
            embeddings (1 + M steps; the probe's keys/values take M + 1-th cache slots of their own).
        attention_dropout (`float`, defaults to 0.0): dropout on attention probabilities during training.
        attention_bias (`bool`, defaults to `False`): biases in the attention projections.
        mlp_bias (`bool`, defaults to `False`): biases in the MLP projections.
        initializer_range (`float`, defaults to 0.02): std σ of the normal initialisation of weights.
        initializer_scheme (`str`, defaults to `"reference"`): how a new model is initialised.
            `"reference"` is what the authors' code effectively does (its model-level init runs after the blocks'
            own zero-init of adaLN and overwrites it): every Linear, adaLN and the t/Δ embedders included, N(0, σ)
            with zero bias; the residual output projections (`self_attn.o_proj`, `mlp.down_proj`) re-drawn
            N(0, σ/√(2k)) with k = `num_hidden_layers`; embeddings N(0, σ); norm weights 1. The gates thus start
            small but open. `"zero_adaln"` is the paper's DiT-style description (the package's init before this
            option): adaLN weight and bias 0, so every residual branch starts closed; every other Linear and the
            embeddings N(0, σ), residual projections not rescaled.
        block_norm_weight (`bool`, defaults to `False`): give the two RMSNorms inside each block a learnable weight
            (torch `nn.RMSNorm` defaults: initialised to 1). The reference's Base-Loop and Base blocks have it; its
            LoopFormer and TMLT blocks (adaLN scales instead) do not.
        use_cache (`bool`, defaults to `True`): return a KV cache (one slot per loop step and block).
        max_loop_budget_factor (`int`, defaults to 8): the largest loop budget a call may ask for is
            `max_loop_budget_factor * num_loops` (`max_loop_budget`); a larger one raises `ValueError` before anything
            is allocated.

    Every field is validated however it arrives (constructor, `config.json`, `from_pretrained` kwargs, attribute
    set): bad values raise `ValueError`, booleans must be `True` or `False`.
    """

    model_type = "loopformer"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size=50304,
        hidden_size=768,
        num_attention_heads=12,
        num_key_value_heads=None,
        intermediate_size=3072,
        hidden_act="gelu",
        num_hidden_layers=3,
        num_loops=8,
        loop_conditioning="shortcut",
        position_embedding_type="learned",
        rope_parameters=None,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=None,
        frequency_embedding_size=256,
        max_period=10000.0,
        default_loop_budget=None,
        default_step_schedule="uniform",
        halt_kv_fill="reuse",
        cache_sharing="none",
        cache_share_n=4,
        halt_criterion="state_change",
        attention_dropout=0.0,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        initializer_scheme="reference",
        block_norm_weight=False,
        use_cache=True,
        max_loop_budget_factor=8,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.num_hidden_layers = num_hidden_layers
        self.num_loops = num_loops
        self.loop_conditioning = loop_conditioning
        self.position_embedding_type = position_embedding_type
        if position_embedding_type == "rope":  # transformers fills in rope_type and rope_theta (kwargs, else 1e4)
            self.rope_parameters = ({"partial_rotary_factor": 1.0, **rope_parameters} if isinstance(rope_parameters, dict)
                                    else rope_parameters or {"partial_rotary_factor": 1.0})
        elif rope_parameters is not None:
            raise ValueError(f"`rope_parameters` apply to position_embedding_type='rope', got {rope_parameters!r} "
                             f"with position_embedding_type={position_embedding_type!r}.")
        else:
            kwargs.pop("rope_theta", None)  # saved by earlier versions for every model; learned positions have none
        self.max_position_embeddings = max_position_embeddings
        # an instance's plan (not saved: transformers leaves it out of config.json)
        self.base_model_tp_plan = {k: v for k, v in TP_PLAN.items() if hidden_act == "swiglu" or "gate" not in k}
        self.rms_norm_eps = rms_norm_eps
        self.frequency_embedding_size = frequency_embedding_size
        self.max_period = max_period
        self.default_loop_budget = default_loop_budget
        self.default_step_schedule = default_step_schedule
        self.halt_kv_fill = halt_kv_fill
        self.cache_sharing = cache_sharing
        self.cache_share_n = cache_share_n
        self.halt_criterion = halt_criterion
        self.attention_dropout = attention_dropout
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.initializer_range = initializer_range
        self.initializer_scheme = initializer_scheme
        self.block_norm_weight = block_norm_weight
        self.use_cache = use_cache
        self.max_loop_budget_factor = max_loop_budget_factor
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        try:  # transformers validates `rope_parameters` per RoPE type here; a missing key is a KeyError
            super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        except KeyError as error:
            if "rope_parameters" not in str(error):
                raise
            raise ValueError(f"`rope_parameters` {self.rope_parameters}: {error.args[0]}") from None
        self._validate_fields()

    # Other layouts of config.json (the authors' Hub repos) register a translation here, `translate(config_dict)` ->
    # constructor kwargs or None (`loopformer_hf/__init__.py`): this module imports no loader.
    config_translators = []

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """As `PretrainedConfig.from_dict`; a config.json in another registered layout (the authors' Hub repos) is
        translated (`config_translators`)."""
        for translate in LoopFormerConfig.config_translators:
            translated = translate(config_dict)
            if translated is not None:  # always a plain LoopFormerConfig, whichever model_type it claimed
                return super(LoopFormerConfig, LoopFormerConfig).from_dict(translated, **kwargs)
        if "num_loops" not in config_dict and "num_loops" not in kwargs:
            # the constructor's default (8) would load silently and change the logits
            raise ValueError("A LoopFormer config.json must give `num_loops`, got none: the loop count a looped model "
                             "was trained with is part of its weights' meaning. Add \"num_loops\": L (the loop steps "
                             "of its training run) to config.json, or pass num_loops=L to from_pretrained.")
        return super().from_dict(config_dict, **kwargs)

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self):
        """The channels of each head that RoPE rotates (all unless `rope_parameters` has partial_rotary_factor < 1)."""
        return int(self.head_dim * (getattr(self, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0))

    @property
    def max_loop_budget(self):
        """The largest loop budget M a call may ask for."""
        return self.max_loop_budget_factor * self.num_loops

    def __setattr__(self, name, value):
        # transformers sets `from_pretrained` kwargs (and users set fields) after `__init__`: check them here too.
        value = self._check_field(name, value)
        if name not in LOOP_BUDGET_FIELDS or not all(f in self.__dict__ for f in LOOP_BUDGET_FIELDS):
            return super().__setattr__(name, value)
        old = self.__dict__[name]
        super().__setattr__(name, value)
        try:
            self._check_loop_budget_fields()
        except ValueError:
            super().__setattr__(name, old)
            raise

    @staticmethod
    def _check_field(name, value):
        """The rule of one field on its own (`FIELD_CHECKS`; cross-field rules are in `_validate_fields`)."""
        check = FIELD_CHECKS.get(name)
        if check is not None:
            check(name, value)
        return value

    def _check_loop_budget_fields(self):
        if self.default_loop_budget is not None:
            self._check_budget(self.default_loop_budget, "default_loop_budget")

    def _validate_fields(self):
        for name, check in FIELD_CHECKS.items():
            check(name, getattr(self, name, None))  # rope_parameters: RoPE models only
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        if self.position_embedding_type == "rope" and self.rotary_dim % 2:
            raise ValueError(f"RoPE needs an even rotary dimension, got {self.rotary_dim} (head_dim {self.head_dim}, "
                             f"rope_parameters {self.rope_parameters}).")
        self._check_loop_budget_fields()

    # ---- trajectories ------------------------------------------------------------------------------------------

    def _check_budget(self, budget, name="loop_budget"):
        """An integer 1 <= M <= `max_loop_budget`, checked before anything is allocated for it."""
        if not isinstance(budget, numbers.Integral) or isinstance(budget, bool) or budget < 1:
            raise ValueError(f"`{name}` must be an integer >= 1, got {budget!r} ({type(budget).__name__}).")
        if budget > self.max_loop_budget:
            raise ValueError(
                f"`{name}`={budget} exceeds the largest loop budget this model allows, max_loop_budget="
                f"{self.max_loop_budget} (max_loop_budget_factor={self.max_loop_budget_factor} x num_loops="
                f"{self.num_loops}); raise `config.max_loop_budget_factor` to allow more loop steps."
            )
        return int(budget)

    def step_schedule_preset(self, name, budget):
        """The step sizes Δ_1..Δ_M of a named schedule for budget M (on the 1/L grid whenever M <= L)."""
        if name == "uniform":
            return [1.0 / budget] * budget
        if name in ("coarse_to_fine", "fine_to_coarse"):
            return _ramp_on_grid(budget, self.num_loops, descending=name == "coarse_to_fine")
        raise ValueError(f"`step_schedule` preset must be one of {STEP_SCHEDULE_PRESETS}, got {name!r}.")

    def resolve_trajectory(self, loop_budget=None, step_schedule=None):
        """Validate a (budget, schedule) request and return the step sizes (Δ_1, ..., Δ_M) as a tuple of floats.

        A schedule list alone sets the budget; a preset name uses `loop_budget` (or the config default). A budget
        that disagrees with the schedule's length, and every malformed value, raises `ValueError`. A budget above
        `num_loops`, or a trajectory the variant was not trained for, is allowed with one warning (`_warn_if_extrapolating`).
        """
        if loop_budget is not None:
            loop_budget = self._check_budget(loop_budget)
        if step_schedule is None:
            step_schedule = self.default_step_schedule
        if isinstance(step_schedule, str):
            budget = loop_budget or self.default_loop_budget or self.num_loops
            steps = self.step_schedule_preset(step_schedule, budget)
            named = step_schedule
        else:
            if hasattr(step_schedule, "__len__") and len(step_schedule) > self.max_loop_budget:
                self._check_budget(len(step_schedule), "len(step_schedule)")
            steps = self._check_schedule(step_schedule)
            if loop_budget is not None and loop_budget != len(steps):
                raise ValueError(
                    f"`loop_budget`={loop_budget} disagrees with `step_schedule` of length {len(steps)} "
                    f"({list(steps)}); give one of them, or a schedule with exactly `loop_budget` steps."
                )
            named = None
        if self.loop_conditioning != "shortcut" and named != "uniform" and any(
            abs(s - steps[0]) > SCHEDULE_SUM_TOLERANCE for s in steps
        ):
            raise ValueError(
                f"`step_schedule`={step_schedule!r} needs loop_conditioning='shortcut'; a model with "
                f"loop_conditioning={self.loop_conditioning!r} only knows the number of steps (use 'uniform')."
            )
        self._warn_if_extrapolating(steps)
        return tuple(float(s) for s in steps)

    check_halt_eps = staticmethod(check_halt_eps)  # the module-level function, also reachable from the config

    @staticmethod
    def _check_schedule(schedule):
        if hasattr(schedule, "tolist"):  # torch / numpy arrays
            schedule = schedule.tolist()
        if not isinstance(schedule, (list, tuple)):
            raise ValueError(
                f"`step_schedule` must be a preset name {STEP_SCHEDULE_PRESETS} or a list of positive floats summing "
                f"to 1, got {schedule!r} ({type(schedule).__name__})."
            )
        if len(schedule) == 0:
            raise ValueError("`step_schedule` is empty; it needs at least one positive step summing to 1.")
        for step in schedule:
            if not _is_real_number(step) or not math.isfinite(step) or step <= 0:
                raise ValueError(
                    f"`step_schedule` must hold positive finite numbers summing to 1, got {list(schedule)!r} "
                    f"(bad entry {step!r})."
                )
        total = math.fsum(schedule)
        if abs(total - 1.0) > SCHEDULE_SUM_TOLERANCE:
            raise ValueError(
                f"`step_schedule` must sum to 1 within {SCHEDULE_SUM_TOLERANCE}, got {list(schedule)!r} "
                f"(sum {total!r})."
            )
        return [float(s) for s in schedule]

    def _warn_if_extrapolating(self, steps):
        """One warning per variant and trajectory that the model was not trained for, saying why for the variant:
        LoopFormer interpolates Δ for a uniform budget M <= L (the paper's elastic budgets, silent) but not beyond L
        or off the grid of a given schedule; TMLT and Base-Loop have no Δ, so every M != L is a count never run."""
        L, M = self.num_loops, len(steps)
        if self.loop_conditioning == "shortcut":
            uniform = all(abs(s - steps[0]) <= SCHEDULE_SUM_TOLERANCE for s in steps)
            off_grid = not uniform and any(abs(s * L - round(s * L)) > 1e-6 for s in steps)
            if M <= L and not off_grid:
                return
            reason = (f"LoopFormer trajectory {[round(s, 6) for s in steps]} extrapolates beyond training (" +
                      (f"budget {M} > num_loops {L})." if M > L else f"steps off the 1/{L} grid it was trained on)."))
        else:
            if M == L:
                return
            variant = "TMLT" if self.loop_conditioning == "timestep" else "Base" if L == 1 else "Base-Loop"
            reason = (f"{variant} was trained at exactly num_loops={L} loop steps and has no step-size conditioning to "
                      f"interpolate: loop_budget={M} is a loop count it never ran.")
        key = (self.loop_conditioning, L, tuple(round(s, 9) for s in steps))
        if key in _warned_trajectories:
            return
        _warned_trajectories.add(key)
        warnings.warn(reason, UserWarning, stacklevel=3)


__all__ = ["LoopFormerConfig", "CACHE_SHARING_MODES", "STEP_SCHEDULE_PRESETS", "INITIALIZER_SCHEMES", "HALT_CRITERIA",
           "check_halt_eps"]
