# Copied from loopformer_hf/looped_common.py: edit there, then `python scripts/check_copies.py --fix_and_overwrite`
"""What LoopFormer and FPRM both compute or check, in one file: the Llama-style helpers that torch and transformers
do not offer as public API with exactly these numbers (`rms_norm`, `rotate_half`, `repeat_kv`,
`eager_attention_forward`, `attend`), the config rules transformers does not provide (`check_positive_number`,
`check_rope_parameters`, `LoopedConfigMixin`), and `from_pretrained`'s other layouts and refusals
(`CheckpointLoadersMixin`).

One source, two files: `loopformer_hf/looped_common.py` is the source; `fprm_hf/looped_common.py` is a copy of it,
marked "Copied from" on its first line, which `python scripts/check_copies.py` checks (tests/test_check_copies.py) and
`--fix_and_overwrite` rewrites, as transformers' utils/check_copies.py does for its "Copied from" code. Each package
imports its own file relatively, so `save_pretrained` copies it next to the weights with the package's own files, and
a saved model loads with `trust_remote_code=True` where neither package is installed (tests/test_layout.py checks that
neither package imports the other).
"""

import dataclasses
import functools
import glob
import math
import numbers
import os

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

logger = logging.get_logger(__name__)

# ---- layers -------------------------------------------------------------------------------------------------------

# `rms_norm_eps=None`: torch's default eps for a float32 input, which the references' norms see (float32 weights and
# residual stream, also under bf16 autocast). Taken from the input dtype instead, a bf16 model would add 7.8e-3
# (fp16: 9.8e-4) to the mean square and compute another function.
DEFAULT_RMS_NORM_EPS = torch.finfo(torch.float32).eps


def rms_norm(x, weight=None, eps=None):
    """RMSNorm computed in float32, returned in the dtype of `x`; `eps=None` is `DEFAULT_RMS_NORM_EPS` whatever the
    dtype of `x`. `weight`: None (FPRM's norms, LoopFormer's block norms), one vector, or one per token (a halting
    rule's exit step: norm, then weight).

    Not torch's `F.rms_norm` alone, which equals this in float32, bfloat16 and float16 on CPU but computes a float64
    `x` in float64 (the authors' norms: in float32; up to 7e-7 apart) and, under CUDA autocast (where rms_norm is a
    float32 op), returns a bfloat16 `x`'s norm in float32 instead of rounding it to bfloat16 as the authors do."""
    eps = DEFAULT_RMS_NORM_EPS if eps is None else eps
    if weight is not None and weight.dim() > 1:
        return rms_norm(x, None, eps) * weight.to(x.dtype)
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # no casts: each is a dispatch per block and token
    return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps).to(x.dtype)


def rotate_half(x):  # Llama's (a module-level helper of its modeling file, not transformers' public API)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):  # Llama's: grouped keys and values repeated for each query head of the group
    if n_rep == 1:
        return hidden_states
    b, h, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The "eager" attention: keys grouped by `module.num_key_value_groups`; a boolean or additive mask, or None:
    causal where `module.is_causal` (LoopFormer; FPRM's state tracking), none otherwise (FPRM's grids, where every
    token is an input). Llama's (the nearest in transformers, not public API) softmaxes a float64 model in float32
    and takes additive masks only."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None and module.is_causal:
        q_len, kv_len = scores.shape[-2:]
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril(kv_len - q_len)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask
    # at least float32 (as Llama) but never below the scores' own precision: a float32 cast of a float64 model loses
    # the eager path's agreement with sdpa, and float64's min would become -inf
    weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def attend(module, query, key, value, attention_mask, output_attentions=False):
    """(output, weights) by the kernel `module.config._attn_implementation` names ("sdpa", flex, a registered one),
    or by the eager attention where none is set or the weights are asked for (only the eager path returns them).
    `get_interface` (rather than indexing) lets `set_attn_implementation` switch the kernel on a built model."""
    interface = eager_attention_forward
    if module.config._attn_implementation not in (None, "eager") and not output_attentions:
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_attention_forward)
    dropout = module.config.attention_dropout if module.training else 0.0
    return interface(
        module, query, key, value, attention_mask, dropout=dropout, scaling=module.scaling, is_causal=module.is_causal
    )


# ---- loading -----------------------------------------------------------------------------------------------------


class CheckpointLoadersMixin:
    """`from_pretrained` of both models (placed before `PreTrainedModel` among the bases). A folder in another layout
    (the authors' files) is loaded by an entry of the model's own `checkpoint_loaders` list, `load(cls,
    path, args, kwargs)` -> a model or None, which the package's `__init__` registers: the model files import none, so
    a saved folder carries none. Weights that are not safetensors (a renamed pickle, a truncated download) are an
    OSError naming the file, where transformers lets safetensors' bare "Error while deserializing header" through (a
    tiny Llama does the same)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        for load in cls.checkpoint_loaders:
            if (model := load(cls, pretrained_model_name_or_path, args, kwargs)) is not None:
                return model
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as e:
            raise OSError(
                f"{_unreadable_safetensors(pretrained_model_name_or_path)} is not a safetensors file (safetensors: "
                f"{e}). Nothing was loaded from it, and pickles are never unpickled here: re-save the model with "
                f"`save_pretrained`, or give the folder it was saved to."
            ) from None


def _unreadable_safetensors(path):
    """The .safetensors files of a local folder that safetensors cannot open, or the name given (a Hub id)."""
    bad = []
    for file in sorted(glob.glob(os.path.join(str(path), "*.safetensors"))):
        try:
            with safe_open(file, framework="pt"):
                pass
        except SafetensorError:
            bad.append(file)
    return ", ".join(repr(f) for f in bad) or f"a weights file of {str(path)!r}"


# ---- config rules transformers does not provide: check(value) raises ValueError -----------------------------------
# transformers' nearest are not these: `positive_any_number` takes 0 and inf, `interval` has no None and its own
# message, `validate_rope` warns where these refuse.


def is_real_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive_number(value):
    """A positive finite number (None allowed: the field's type says whether it may be None)."""
    if value is not None and not (is_real_number(value) and 0 < value < math.inf):
        raise ValueError(f"Value must be a positive finite number, got {value!r}.")


def check_rope_parameters(value):
    """None or transformers' `rope_parameters`: "rope_type" one of its RoPE types ("default", "linear", "dynamic",
    "yarn", ...), a positive "rope_theta" and "factor", "partial_rotary_factor" in (0, 1]; keys left out take the
    defaults (the keys each RoPE type requires are transformers' `validate_rope`)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if value is None:
        return
    if value.get("rope_type", "default") not in (kinds := ("default", *ROPE_INIT_FUNCTIONS)):
        raise ValueError(f"`rope_parameters['rope_type']` must be one of {kinds}, got {value['rope_type']!r}.")
    for key in ("rope_theta", "factor"):
        if key in value and not (is_real_number(value[key]) and 0 < value[key] < math.inf):
            raise ValueError(f"`rope_parameters['{key}']` must be a positive number, got {value[key]!r}.")
    if not (is_real_number(partial := value.get("partial_rotary_factor", 1.0)) and 0 < partial <= 1):
        raise ValueError(f"`rope_parameters['partial_rotary_factor']` must be in (0, 1], got {partial!r}.")


# keyword arguments that are not fields yet belong in a config: config.json's bookkeeping and what `PreTrainedConfig`
# itself reads
NON_FIELD_KWARGS = (
    "auto_map",
    "model_type",
    "name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "rope_theta",
    "rope_scaling",
    "output_attentions",
    "attn_implementation",
    "experts_implementation",
    "per_layer_config",
    "num_labels",
)


@functools.cache
def _generation_kwargs():
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())  # configs of older releases carry them; transformers drops them


class LoopedConfigMixin:
    """What both configs derive the same way (placed before `PreTrainedConfig` among the bases)."""

    def warn_unknown_kwargs(self, kwargs, also_allowed=()):
        """A keyword that is no field (a typo: `num_loop=4`, `hiden_size=64`) was kept silently and changed nothing:
        warn, as transformers' GenerationConfig does for flags it does not know, naming the closest field.
        `also_allowed`: the config's own records that are not fields (a translated config's sources)."""
        import difflib

        fields = [f.name for f in dataclasses.fields(self)]
        allowed = set(NON_FIELD_KWARGS) | set(also_allowed) | _generation_kwargs()
        unknown = sorted(k for k in kwargs if not k.startswith("_") and k not in allowed)
        if unknown:
            hints = {k: difflib.get_close_matches(k, fields, n=1) for k in unknown}
            hint = "; ".join(f"{k!r}: did you mean {v[0]!r}?" for k, v in hints.items() if v)
            logger.warning(
                f"{type(self).__name__} got keyword arguments that are not its fields, kept on the config but read "
                f"by nothing: {unknown}" + (f" ({hint})" if hint else "") + "."
            )

    def validate_rope(self):
        """transformers' check of the keys each RoPE type requires; a missing one (a KeyError there) is refused."""
        try:
            super().validate_rope()
        except KeyError as error:
            raise ValueError(f"`rope_parameters` {self.rope_parameters}: {error.args[0]}") from None

    def validate_rotary(self):
        """RoPE's parameters apply to RoPE alone, and it turns pairs of channels."""
        if self.position_embedding_type != "rope" and self.rope_parameters is not None:
            raise ValueError(
                f"`rope_parameters` apply to position_embedding_type='rope', got {self.rope_parameters!r} "
                f"with position_embedding_type={self.position_embedding_type!r}."
            )
        if self.position_embedding_type == "rope" and self.rotary_dim % 2:
            raise ValueError(
                f"RoPE needs an even rotary dimension, got {self.rotary_dim} (head_dim {self.head_dim}, "
                f"rope_parameters {self.rope_parameters})."
            )

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self):
        """The channels of each head that RoPE rotates (all unless `rope_parameters` has partial_rotary_factor < 1)."""
        return int(self.head_dim * (self.rope_parameters or {}).get("partial_rotary_factor", 1.0))
