"""Configuration of LoopFormer (Jeddi et al., "LoopFormer: Elastic-Depth Looped Transformers", ICLR 2026), one
for the paper's model and its baselines:

- LoopFormer:  ``loop_conditioning="shortcut"`` (every loop step is conditioned on its time t and step size Δ)
- TMLT:        ``loop_conditioning="timestep"`` (conditioned on the integer loop index only)
- Base-Loop:   ``loop_conditioning="none", block_norm_weight=True``
- Base (iso-FLOP, not looped): ``num_hidden_layers=k*L, num_loops=1, loop_conditioning="none", block_norm_weight=True``

A strict dataclass, as transformers' LlamaConfig, validated by what transformers and huggingface_hub provide (types,
`Literal` choices, `positive_int_field`, `probability`) and a few rules of its own. The trajectory (budget M, steps
Δ_1..Δ_M) is resolved in `trajectory_loopformer` ([`LoopFormerConfig.resolve_trajectory`]).
"""

import importlib
import math
import numbers
from typing import Literal

from huggingface_hub.dataclasses import strict, validated_field
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import logging
from transformers.utils.type_validators import interval, positive_int_field, probability

from . import trajectory_loopformer as trajectory
from .looped_common import LoopedConfigMixin, check_positive_number, check_rope_parameters
from .trajectory_loopformer import STEP_SCHEDULE_PRESETS, check_halt_eps

logger = logging.get_logger(__name__)


def _authors_layouts():
    """The module that knows the authors' config.json (`loopformer_hf/authors/auto.py`), imported by name: a copy of
    this file saved for `trust_remote_code` ships the model's files alone (transformers copies every module this file
    imports), and there it is None."""
    try:
        return importlib.import_module(f"{__package__}.authors.auto")
    except ImportError:
        return None


# the options of `from_pretrained` that say where its files are
HUB_OPTIONS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
LOOP_CONDITIONING_MODES = ("shortcut", "timestep", "none")
POSITION_EMBEDDING_TYPES = ("learned", "rope")
HALT_KV_FILLS = ("recompute", "reuse")
INITIALIZER_SCHEMES = ("reference", "zero_adaln")

# Llama's tensor-parallel plan (`from_pretrained(..., tp_plan="auto")` under torchrun): attention heads and MLP columns
# split across ranks (gate_proj: the SwiGLU MLP's only), the adaLN modulation and the loop conditioning replicated
TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


# ---- the field rules transformers does not provide (and `check_positive_number`, `check_rope_parameters`, FPRM's too:
# looped_common.py): check(value) raises ValueError


def check_activation(value):  # transformers' `activation_fn_key`, and "swiglu" (the gated MLP)
    from transformers.activations import ACT2FN

    if value != "swiglu" and value not in ACT2FN:
        raise ValueError(f"Value must be 'swiglu' or an activation of transformers.activations.ACT2FN, got {value!r}.")


def drop_removed_fields(kwargs):
    """Pop the fields of earlier versions that a saved config.json may still carry from constructor `kwargs`, with a
    warning where one asked for something this model does not run (docs/loopformer.md, "Changed in this version")."""
    sharing, share_n = kwargs.pop("cache_sharing", None), kwargs.pop("cache_share_n", None)
    if sharing not in (None, "none"):
        logger.warning_once(
            f"LoopFormerConfig: cache_sharing={sharing!r} (cache_share_n={share_n!r}) is no field any more and is "
            f"ignored: this model runs the exact cache. The shared loop cache is a cache object in the lab "
            f"(benchmarks/cache_sharing.py, `ModuloSharedCache(share_n=...)`, passed as `cache=`)."
        )
    criterion = kwargs.pop("halt_criterion", None)
    if criterion not in (None, "state_change"):
        logger.warning_once(
            f"LoopFormerConfig: halt_criterion={criterion!r} is no field any more and is ignored: with `halt_eps` "
            f"this model halts on the state change. The other halting rules are the lab's "
            f"(benchmarks/halting_rules.py, `LabLoopFormerForCausalLM`, whose forward and generate take "
            f"`halt_criterion`)."
        )


def numpy_integers_as_int(cls):
    """Class decorator, placed above `@strict`: numpy integers (`np.arange` sweeps, `df[col]` values) are integers,
    stored as `int` (JSON-serialisable) before `@strict`'s `__setattr__` validates them, which alone refused
    `num_loops=np.int64(4)` as "expected int, got int64". (A `__setattr__` in the class body would run after that
    validation: `@strict` wraps the class's own.)"""
    strict_setattr = cls.__setattr__

    def __setattr__(self, name, value):
        if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
            value = int(value)
        strict_setattr(self, name, value)

    cls.__setattr__ = __setattr__
    return cls


@numpy_integers_as_int
@strict
class LoopFormerConfig(LoopedConfigMixin, PreTrainedConfig):
    r"""
    Configuration of a [`LoopFormerModel`]: `num_hidden_layers` shared blocks looped `num_loops` times.

    Args:
        vocab_size (`int`, defaults to 50304): size of the token vocabulary.
        hidden_size (`int`, defaults to 768): width d of the residual stream.
        num_attention_heads (`int`, defaults to 12): query heads per attention layer.
        num_key_value_heads (`int`, *optional*): key/value heads (grouped-query attention); defaults to
            `num_attention_heads`. Must divide `num_attention_heads`.
        intermediate_size (`int`, defaults to 3072): width of the MLP.
        hidden_act (`str`, defaults to `"gelu"`): MLP activation: `"gelu"` (the reference's plain two-layer MLP),
            `"swiglu"` (a gated SiLU MLP) or any other name of `transformers.activations.ACT2FN` (plain MLP).
        num_hidden_layers (`int`, defaults to 3): k, the number of distinct (shared) blocks.
        num_loops (`int`, defaults to 8): L, the number of loop steps of the training trajectory.
        loop_conditioning (`str`, defaults to `"shortcut"`): `"shortcut"` (t and Δ, LoopFormer), `"timestep"`
            (integer loop index, TMLT) or `"none"` (Base-Loop, no modulation).
        position_embedding_type (`str`, defaults to `"learned"`): `"learned"` absolute positions (reference), `"rope"`.
        rope_parameters (`dict`, *optional*): transformers' RoPE settings (`position_embedding_type="rope"` only),
            `{"rope_type": "default", "rope_theta": 10000.0}` unless given, as for Llama ("linear", "yarn", ...,
            "partial_rotary_factor"); a `rope_theta` keyword (configs saved before this field) is read into it.
        max_position_embeddings (`int`, defaults to 1024): longest sequence the model accepts.
        tie_word_embeddings (`bool`, defaults to `True`): share the input embedding with `lm_head`.
        rms_norm_eps (`float`, *optional*): epsilon of every RMSNorm; `None` (the reference): torch's float32 default
            (1.19e-7), also in a bf16/fp16 model, which then computes what the reference computes under autocast.
        frequency_embedding_size (`int`, defaults to 256): width of the sinusoidal features of t and Δ.
        max_period (`float`, defaults to 10000.0): longest period of those sinusoidal features.
        default_loop_budget (`int`, *optional*): budget M used when a call gives neither `loop_budget` nor a
            schedule list; `None` means `num_loops`.
        default_step_schedule (`str`, defaults to `"uniform"`): preset used when a call gives no schedule; one of
            `"uniform"`, `"coarse_to_fine"`, `"fine_to_coarse"`.
        halt_kv_fill (`str`, defaults to `"reuse"`): with `halt_eps`, how the cache slots a halted token skips are
            filled: `"reuse"` repeats its last computed step's keys/values; `"recompute"` projects its frozen state.
        attention_dropout (`float`, defaults to 0.0): dropout on attention probabilities during training.
        attention_bias (`bool`, defaults to `False`): biases in the attention projections.
        mlp_bias (`bool`, defaults to `False`): biases in the MLP projections.
        initializer_range (`float`, defaults to 0.02): std σ of the normal initialisation of weights.
        initializer_scheme (`str`, defaults to `"reference"`): `"reference"`: as the authors' code, every Linear and
            embedding N(0, σ), `o_proj`/`down_proj` N(0, σ/√(2k)); `"zero_adaln"`: the paper's DiT-style adaLN zeroed.
        block_norm_weight (`bool`, defaults to `False`): a learnable weight (initialised to 1) in the two RMSNorms of
            each block, as the reference's Base-Loop and Base blocks have (its LoopFormer and TMLT blocks: adaLN).
        use_cache (`bool`, defaults to `True`): return a KV cache (one slot per loop step and block).
        max_loop_budget_factor (`int`, defaults to 8): a call's loop budget is at most `max_loop_budget_factor *
            num_loops` (`max_loop_budget`); a larger one raises `ValueError` before anything is allocated.

    Validated as Llama's config (`@strict`): each field whenever it is set (`StrictDataclassFieldValidationError`),
    the rules between fields (`validate_*`) at construction, load, save and `validate()` (`...ClassValidationError`).
    """

    model_type = "loopformer"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    vocab_size: int = positive_int_field(default=50304)
    hidden_size: int = positive_int_field(default=768)
    num_attention_heads: int = positive_int_field(default=12)
    num_key_value_heads: int | None = positive_int_field(default=None)
    intermediate_size: int = positive_int_field(default=3072)
    hidden_act: str = validated_field(check_activation, default="gelu")
    num_hidden_layers: int = positive_int_field(default=3)
    num_loops: int = positive_int_field(default=8)
    loop_conditioning: Literal[LOOP_CONDITIONING_MODES] = "shortcut"
    position_embedding_type: Literal[POSITION_EMBEDDING_TYPES] = "learned"
    rope_parameters: dict | None = validated_field(check_rope_parameters, default=None)
    max_position_embeddings: int = positive_int_field(default=1024)
    tie_word_embeddings: bool = True
    rms_norm_eps: int | float | None = validated_field(check_positive_number, default=None)
    frequency_embedding_size: int = positive_int_field(default=256)
    max_period: int | float = validated_field(check_positive_number, default=10000.0)
    default_loop_budget: int | None = positive_int_field(default=None)
    default_step_schedule: str | list | tuple = validated_field(
        trajectory.check_default_step_schedule, default="uniform"
    )
    halt_kv_fill: Literal[HALT_KV_FILLS] = "reuse"
    attention_dropout: int | float = probability(default=0.0)
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: int | float = interval(min=0, max=math.inf, exclude_max=True)(default=0.02)
    initializer_scheme: Literal[INITIALIZER_SCHEMES] = "reference"
    block_norm_weight: bool = False
    use_cache: bool = True
    max_loop_budget_factor: int = positive_int_field(default=8)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        drop_removed_fields(kwargs)
        self.warn_unknown_kwargs(kwargs, also_allowed=("authors_config_sources",))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        rope, given = self.position_embedding_type == "rope", self.rope_parameters
        # transformers fills in rope_type and rope_theta (a `rope_theta` kwarg, else 1e4)
        self.rope_parameters = {"partial_rotary_factor": 1.0, **(given or {})} if rope else None
        if not rope:
            kwargs.pop("rope_theta", None)  # saved by earlier versions for every model; learned positions have none
        # an instance's plan (not saved: transformers leaves it out of config.json)
        self.base_model_tp_plan = {k: v for k, v in TP_PLAN.items() if self.hidden_act == "swiglu" or "gate" not in k}
        super().__post_init__(**kwargs)
        if not rope:  # transformers gives any config with the field a default RoPE: learned positions keep theirs
            self.rope_parameters = given

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """As `PreTrainedConfig.get_config_dict` (what `from_pretrained` reads). A config.json without `num_loops` may
        be one of the authors' Hub repos (their model type "loopformer" is ours too): the authors' folder translates
        it from the repo's files (`loopformer_hf/authors/`, their loading path alone). Asked by a model class's
        `from_pretrained` (which reads weights under our names), their repo is refused: the Auto classes and
        `loopformer_hf.authors.from_pretrained_authors` load it."""
        hub_kwargs = {key: kwargs[key] for key in HUB_OPTIONS if kwargs.get(key) is not None}
        by_a_model = "gguf_file" in kwargs  # (`PreTrainedModel.from_pretrained` passes it, a config's caller does not)
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if (
            "num_loops" not in config_dict
            and (authors := _authors_layouts())
            and authors.is_reference_config(config_dict)
        ):
            if by_a_model:  # a model class of ours would read their weights under our names: at random
                raise authors.refusal_of_a_model_class(pretrained_model_name_or_path)
            config_dict = authors.translated_config_dict(config_dict, pretrained_model_name_or_path, hub_kwargs)
        return config_dict, kwargs

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """As `PreTrainedConfig.from_dict`. The rules between fields run again once `from_pretrained`'s kwargs are
        set (transformers sets them one by one after construction). A config of this format reads no file; a dict
        without `num_loops` is refused, unless it is an authors' config.json that `AutoConfig` hands here with the
        repo's name (`name_or_path`), which the authors' folder translates."""
        if "num_loops" not in config_dict and "num_loops" not in kwargs:
            if (authors := _authors_layouts()) and authors.is_reference_config(config_dict):
                return authors.authors_config_from_dict(config_dict, **kwargs)
            # the constructor's default (8) would load silently and change the logits
            raise ValueError(
                "A LoopFormer config.json must give `num_loops`, got none: the loop count a looped model "
                'was trained with is part of its weights\' meaning. Add "num_loops": L (the loop steps '
                "of its training run) to config.json, or pass num_loops=L to from_pretrained."
            )
        loaded = super().from_dict(config_dict, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded).validate()
        return loaded

    # ---- the rules between fields (`@strict` runs every `validate_*`) ----------------------------------------------

    def validate_architecture(self):
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

    def validate_loop_budget(self):
        if self.default_loop_budget is not None:
            trajectory.check_budget(self, self.default_loop_budget, "default_loop_budget")

    @property
    def max_loop_budget(self):
        """The largest loop budget M a call may ask for."""
        return self.max_loop_budget_factor * self.num_loops

    # ---- trajectories: `trajectory_loopformer`, the one place a budget or schedule is resolved and validated ------

    def resolve_trajectory(self, loop_budget=None, step_schedule=None):
        """The steps (Δ_1, ..., Δ_M) of a (budget, schedule) request, validated: `trajectory.resolve_trajectory`."""
        return trajectory.resolve_trajectory(self, loop_budget, step_schedule)

    def step_schedule_preset(self, name, budget):
        """The step sizes Δ_1..Δ_M of a named schedule for budget M (on the 1/L grid whenever M <= L)."""
        return trajectory.step_schedule_preset(self.num_loops, name, budget)

    def _check_budget(self, budget, name="loop_budget"):  # an integer 1 <= M <= `max_loop_budget`, or ValueError
        return trajectory.check_budget(self, budget, name)

    check_halt_eps = staticmethod(check_halt_eps)  # a loop knob's rule, as the budget's


__all__ = [
    "LoopFormerConfig",
    "STEP_SCHEDULE_PRESETS",
    "INITIALIZER_SCHEMES",
    "check_halt_eps",
]
