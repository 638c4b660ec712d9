"""The authors' FPRM layout (GitHub nilskiKonjIzDunava/fprm) and this package's: their arch field names mapped to
`FPRMConfig`'s (`check_settings`, `build_config`) and their weight keys to `FPRMForReasoning`'s
(`map_reference_state_dict`; the converter's docstring, `convert.py`, has the key mapping table). Where their
settings come from (a checkpoint's files) is `settings.resolve_settings`.
"""

import math
import re

import torch
from transformers.utils import logging

from ..configuration_fprm import FPRMConfig
from ..modeling_fprm import FPRMForReasoning

logger = logging.get_logger(__name__)

GITHUB = "GitHub nilskiKonjIzDunava/fprm"
COMPILE_PREFIX = "_orig_mod."
WRAPPER_PREFIX = "model.inner."

# their fields that set what the forward computes, with their defaults (models/config.py, fprm_config.py)
COMPUTING_DEFAULTS = {
    "puzzle_emb_ndim": 0,
    "puzzle_emb_len": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "causal": False,
    "softmax_temp": 1.0,
    "norm_type": "post-norm",
    "norm_placement": "none",
    "conv_type": "none",
    "conv_kernel_size": 4,
    "conv_bias": False,
    "residual_scale": None,
    "alpha_1_init": 0.5,
    "alpha_2_init": 0.5,
    "normalize_input_injection": False,
    "use_spec_norm_linear": False,
    "outer_only": False,
    "mlp_t": False,
    "fp_thresh": 0.1,
    "stepsize": 1.0,
    "stepsize_decay_train": 0.9,
    "stepsize_decay_eval": 0.99,
    "decay_patience": 5,
    "eps": 1e-8,
    "init_std": 1.0,
    "additive_noise_std": 0.0,
    "fixed_init": False,
    "max_iter_eval": None,
    "max_iter": None,
}
REQUIRED = (
    "vocab_size",
    "seq_len",
    "num_puzzle_identifiers",
    "hidden_size",
    "num_heads",
    "expansion",
    "L_layers",
    "pos_encodings",
)
# their fields that change training, logging or data handling only: accepted and not used
IGNORED = {
    "name",
    "loss",
    "batch_size",
    "H_cycles",
    "L_cycles",
    "H_layers",
    "n_backwards_L",
    "halt_max_steps",
    "halt_exploration_prob",
    "halting_mechanism",
    "forward_dtype",
    "no_ACT_continue",
    "q_logit_from_puzzle_emb",
    "q_logit_detach_model",
    "weight_dropout",
    "variational_dropout",
    "jacobian_reg",
    "n_jacobian_samples",
    "jacobian_eps",
    "outlier_quantile",
    "max_iter_dist",
    "gamma_alpha",
    "gamma_scale",
    "expon_scale",
    "n_decode_steps",
}
# their TRM's fields (models/config.py ReasoningModelConfig, required there; `n_backwards_L` defaults to 1), read where
# the checkpoint holds TRM's initial states H_init / L_init (models/recursive_reasoning/trm.py); ignored for FPRM
TRM_REQUIRED = ("H_cycles", "L_cycles", "halt_max_steps", "halt_exploration_prob")
TRM_STATES = ("H_init", "L_init")
POSITIONS = {"rope": "rope", "learned": "learned", "none": "none"}
NORM_TYPES = {"pre-norm": "pre", "post-norm": "post", "peri-norm": "peri"}
CONV_TYPES = {"conv1d": "causal_1d", "conv2d": "2d", "none": "none"}
RESIDUAL_SCALES = {
    None: "none",
    "none": "none",
    "None": "none",
    "fixed": "fixed",
    "input-independent": "input_independent",
    "input-dependent": "input_dependent",
}


# ---- settings -----------------------------------------------------------------------------------------------------


def _bool(settings, key):
    value = settings[key]
    if not isinstance(value, bool):
        raise ValueError(f"`{key}` must be true or false, got {value!r}.")
    return value


def unknown_settings(settings):
    """The fields of `settings` that are not fields of their config classes (their pydantic configs ignore them)."""
    return sorted(set(settings) - set(COMPUTING_DEFAULTS) - set(REQUIRED) - IGNORED - {"intermediate_size"})


def check_settings(settings):
    """Their arch fields over `COMPUTING_DEFAULTS`, refused with a `ValueError` naming the field where they ask for
    something this model does not compute."""
    unknown = unknown_settings(settings)
    if unknown:
        raise ValueError(
            f"unknown settings {unknown}: not fields of the authors' FPRM config (or not supported here)."
        )
    missing = [k for k in REQUIRED if settings.get(k) is None]
    if missing:
        raise ValueError(
            f"missing settings {missing}: give them in a --config file or as flags "
            f"(vocab_size/seq_len/num_puzzle_identifiers come from their dataset.json)."
        )
    s = {**COMPUTING_DEFAULTS, **settings}
    unsupported = []
    if _bool(s, "mlp_t"):
        unsupported.append("mlp_t=True (an MLP over the sequence instead of attention)")
    if s["residual_scale"] not in RESIDUAL_SCALES:
        raise ValueError(
            f"`residual_scale` must be one of {sorted(map(str, RESIDUAL_SCALES))}, got {s['residual_scale']!r}."
        )
    if _bool(s, "use_spec_norm_linear") and RESIDUAL_SCALES[s["residual_scale"]] == "input_dependent":
        unsupported.append("use_spec_norm_linear=True (spectral-norm linears for the input-dependent α)")
    if s["additive_noise_std"]:
        unsupported.append(f"additive_noise_std={s['additive_noise_std']} (noise added at every solver step)")
    if s.get("n_decode_steps"):
        unsupported.append(f"n_decode_steps={s['n_decode_steps']} (extra decoding passes of f after the solve)")
    if not math.isclose(float(s["eps"]), 1e-8):
        unsupported.append(f"eps={s['eps']} (the residual's denominator epsilon is 1e-8 here)")
    if unsupported:
        raise ValueError(f"unsupported settings: {'; '.join(unsupported)}.")
    for key, table in (("pos_encodings", POSITIONS), ("norm_type", NORM_TYPES), ("conv_type", CONV_TYPES)):
        if s[key] not in table:
            raise ValueError(f"`{key}` must be one of {sorted(table)}, got {s[key]!r}.")
    return s


def recursion_of(reference):
    """ "trm" for a checkpoint of their TRM (its initial states `H_init` and `L_init` stored), else "fixed_point"."""
    held = [key for key in TRM_STATES if key in strip_reference_prefixes(reference)]
    if len(held) == 1:
        raise ValueError(
            f"the checkpoint holds {held[0]} without {set(TRM_STATES) - set(held)}: their TRM stores both."
        )
    return "trm" if held else "fixed_point"


def trm_fields(settings):
    """`FPRMConfig`'s TRM fields (`recursion="trm"`) from their TRM settings, refused where one is missing or asks for
    what this model does not compute."""
    missing = [k for k in TRM_REQUIRED if settings.get(k) is None]
    if missing:
        raise ValueError(
            f"missing settings {missing}: a TRM checkpoint (H_init / L_init) needs them, as their config/arch/trm.yaml "
            f"gives them; give them in a --config file."
        )
    if settings.get("q_logit_from_puzzle_emb", True) is not True:
        raise ValueError(
            f"unsupported settings: q_logit_from_puzzle_emb={settings['q_logit_from_puzzle_emb']!r} (a Q-head over the "
            f"mean of the tokens; the Q-head here reads z_H[:, 0], their default)."
        )
    return dict(
        recursion="trm",
        H_cycles=int(settings["H_cycles"]),
        L_cycles=int(settings["L_cycles"]),
        n_backwards_L=int(settings.get("n_backwards_L") or 1),  # their ReasoningModelConfig's default
        halt_max_steps=int(settings["halt_max_steps"]),
        halt_exploration_prob=float(settings["halt_exploration_prob"]),
    )


def build_config(settings, fixed_alphas=None, use_q_head=False, grid=None, recursion="fixed_point"):
    """An `FPRMConfig` from their arch fields (names as in their code; module docstring). `intermediate_size`, where
    given (the weights' SwiGLU width), is built as it is instead of their rule over `expansion`; `grid` is the
    task's (height, width), which a conv2d needs and which fixes the input length; `recursion="trm"` (a checkpoint
    of their TRM, `recursion_of`) reads their TRM fields too (`trm_fields`)."""
    s = check_settings(settings)
    trm = trm_fields(s) if recursion == "trm" else {}
    residual = RESIDUAL_SCALES[s["residual_scale"]]
    hidden, seq_len = int(s["hidden_size"]), int(s["seq_len"])
    ndim, prefix = int(s["puzzle_emb_ndim"]), prefix_rows(s)
    conv_type = CONV_TYPES[s["conv_type"]]
    grid_size = grid_size_of(grid, conv_type, seq_len)
    alpha1, alpha2 = float(s["alpha_1_init"]), float(s["alpha_2_init"])
    if fixed_alphas is not None:
        alpha1 = fixed_alphas.get("alpha1", alpha1)
        alpha2 = fixed_alphas.get("alpha2", alpha2)
    max_loops = s["max_iter_eval"] if s["max_iter_eval"] is not None else s["max_iter"]
    return FPRMConfig(
        vocab_size=int(s["vocab_size"]),
        hidden_size=hidden,
        num_attention_heads=int(s["num_heads"]),
        expansion=float(s["expansion"]),
        intermediate_size=s.get("intermediate_size"),
        num_hidden_layers=int(s["L_layers"]),
        grid_size=grid_size,
        conv_type=conv_type,
        conv_kernel_size=int(s["conv_kernel_size"]),
        conv_bias=_bool(s, "conv_bias"),
        causal=_bool(s, "causal"),
        position_embedding_type=POSITIONS[s["pos_encodings"]],
        max_position_embeddings=seq_len + prefix,
        rope_theta=float(s["rope_theta"]),
        num_prefix_tokens=prefix,
        num_puzzle_identifiers=int(s["num_puzzle_identifiers"]),
        residual_scaling=residual,
        outer_only=_bool(s, "outer_only"),
        alpha1=alpha1,
        alpha2=alpha2,
        norm_type=NORM_TYPES[s["norm_type"]],
        norm_placement=s["norm_placement"],
        normalize_input_injection=_bool(s, "normalize_input_injection"),
        softmax_temperature=float(s["softmax_temp"]),
        init_std=float(s["init_std"]),
        fixed_init=_bool(s, "fixed_init"),
        halt_eps=float(s["fp_thresh"]),
        eta=float(s["stepsize"]),
        gamma_train=float(s["stepsize_decay_train"]),
        gamma_eval=float(s["stepsize_decay_eval"]),
        patience=int(s["decay_patience"]),
        rms_norm_eps=float(s["rms_norm_eps"]),
        puzzle_emb_ndim=ndim if prefix else None,
        use_q_head=use_q_head,
        **({"max_loops": int(max_loops)} if max_loops else {}),
        **trm,
    )


def prefix_rows(settings):
    """The number of prefix rows their puzzle embedding fills: `puzzle_emb_len`, or with `puzzle_emb_len: 0` as many
    rows of `hidden_size` as `puzzle_emb_ndim` values need."""
    hidden, ndim, length = (
        int(settings["hidden_size"]),
        int(settings["puzzle_emb_ndim"]),
        int(settings["puzzle_emb_len"]),
    )
    prefix = -(ndim // -hidden) if length == 0 else length
    if ndim == 0 and prefix:
        raise ValueError(
            f"puzzle_emb_ndim=0 with puzzle_emb_len={prefix}: their model has no puzzle embedding to "
            f"fill the {prefix} prefix rows (set puzzle_emb_len: 0)."
        )
    return prefix


def grid_size_of(grid, conv_type, seq_len):
    """`FPRMConfig.grid_size`: the task's (height, width) `grid` where known (it must hold `seq_len` tokens), else the
    side of the square grid a conv2d needs, else None (a sequence)."""
    if grid is not None and math.prod(grid) != seq_len:
        raise ValueError(f"a {grid[0]}x{grid[1]} grid has {math.prod(grid)} tokens, seq_len is {seq_len}.")
    if grid is not None:
        return list(grid)
    if conv_type != "2d":
        return None
    side = math.isqrt(seq_len)
    if side * side != seq_len:
        raise ValueError(f"conv_type=conv2d needs a square grid, got seq_len={seq_len}.")
    return side


# ---- weights ------------------------------------------------------------------------------------------------------


def strip_reference_prefixes(reference):
    """Their keys without `_orig_mod.` (compiled) and `model.inner.` (the loss-head wrapper); another key is refused."""
    out = {}
    outside = []
    for key, tensor in reference.items():
        name = key[len(COMPILE_PREFIX) :] if key.startswith(COMPILE_PREFIX) else key
        if not name.startswith(WRAPPER_PREFIX):
            outside.append(key)
            continue
        out[name[len(WRAPPER_PREFIX) :]] = tensor
    if outside:
        raise ValueError(
            f"unknown keys {sorted(outside)[:10]}{' ...' if len(outside) > 10 else ''}: every key of "
            f"their checkpoint starts with {WRAPPER_PREFIX!r} (after an optional {COMPILE_PREFIX!r})."
        )
    return out


def fixed_alphas_of(reference):
    """The stored α scalars of a `residual_scale: fixed` checkpoint (they are not learned)."""
    ref = strip_reference_prefixes(reference)
    out = {}
    for i in (1, 2):
        t = ref.get(f"L_level.alpha_{i}_param")
        if t is not None and t.dim() == 0:
            out[f"alpha{i}"] = float(t)
    return out


def map_reference_state_dict(reference, config):
    """Their state dict → this package's, checked key by key and shape by shape against `config`."""
    ref = strip_reference_prefixes(reference)
    mapped, unknown, dropped = {}, [], []
    d, p = config.hidden_size, config.num_prefix_tokens
    for key, tensor in ref.items():
        if key.endswith(".mask"):  # DropConnect mask of a linear layer: training only
            weight_key = key[: -len("mask")] + "weight"
            weight = ref.get(weight_key)
            if _map_key(weight_key, config) is None and weight_key != "q_head.weight":
                unknown.append(key)
            elif weight is not None and weight.shape != tensor.shape:
                unknown.append(f"{key} (shape {tuple(tensor.shape)} vs its weight {tuple(weight.shape)})")
            elif not bool((tensor == 1).all()):
                logger.warning(f"{key} is not all ones (a DropConnect mask of training); inference does not use it")
            dropped.append(key)
            continue
        if key in ("q_head.weight", "q_head.bias") and (config.use_q_head or config.recursion == "trm"):
            mapped[key] = tensor.float()
            continue
        if key in (
            "q_head.weight",
            "q_head.bias",
            "L_level.rotary_emb.cos_cached",
            "rotary_emb.cos_cached",
            "rotary_emb.sin_cached",
        ):
            dropped.append(key)
            continue
        new = _map_key(key, config)
        if new is None:
            unknown.append(key)
            continue
        if new == "__fixed_alpha__":
            continue
        if new == "model.prefix":
            if tensor.dim() != 2 or tensor.shape[1] > p * d:
                unknown.append(f"{key} (shape {tuple(tensor.shape)}, expected (num_puzzle_identifiers, <= {p * d}))")
                continue
            tensor = torch.nn.functional.pad(tensor, (0, p * d - tensor.shape[1])).view(-1, p, d)
        mapped[new] = tensor.float()
    if unknown:
        raise ValueError(
            f"unknown keys {unknown}: not weights of the authors' FPRM with these settings "
            f"(residual_scale={config.residual_scaling}, conv_type={config.conv_type}, "
            f"pos_encodings={config.position_embedding_type}, fixed_init={config.fixed_init})."
        )
    check_against_model(mapped, config)
    return mapped, dropped


def check_against_model(mapped, config):
    """The mapped weights are exactly those of an `FPRMForReasoning` built from `config`, shape for shape."""
    expected = {k: tuple(v.shape) for k, v in FPRMForReasoning(config).state_dict().items()}
    extra = sorted(set(mapped) - set(expected))
    if extra:
        raise ValueError(
            f"unknown keys {extra}: the model with these settings (outer_only={config.outer_only}) has "
            f"no such weights."
        )
    missing = sorted(set(expected) - set(mapped))
    if missing:
        raise ValueError(
            f"missing keys {missing}: the model with these settings needs them and the checkpoint does not have them."
        )
    wrong = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {expected[k]}"
        for k, v in mapped.items()
        if tuple(v.shape) != expected[k]
    ]
    if wrong:
        raise ValueError(f"wrong shapes: {wrong}.")


def _map_key(key, config):
    direct = {
        "embed_tokens.embedding_weight": "model.embed_tokens.weight",
        "lm_head.weight": "lm_head.weight",
        "L_level.conv.weight": "model.conv.weight",
        "L_level.conv.bias": "model.conv.bias",
        "puzzle_emb.weights": "model.prefix",
    }
    if key in direct:
        return direct[key]
    if key == "embed_pos.embedding_weight" and config.position_embedding_type == "learned":
        return "model.embed_positions.weight"
    if key == "L_optimizer.init_vec" and config.fixed_init:
        return "model.z_init"
    if key in TRM_STATES and config.recursion == "trm":
        return f"model.{key}"
    match = re.fullmatch(r"L_level\.alpha_([12])_param", key)
    if match:
        if config.residual_scaling == "fixed":
            return "__fixed_alpha__"
        if config.residual_scaling == "input_independent":
            return f"model.residual_scaling.alpha{match.group(1)}_logit"
        return None
    match = re.fullmatch(r"L_level\.alpha_([12])_layer\.(weight|bias)", key)
    if match and config.residual_scaling == "input_dependent":
        return f"model.residual_scaling.alpha{match.group(1)}_proj.{match.group(2)}"
    match = re.fullmatch(
        r"L_level\.layers\.(\d+)\.(self_attn\.qkv_proj|self_attn\.o_proj|mlp\.gate_up_proj|"
        r"mlp\.down_proj)\.weight",
        key,
    )
    if match:
        return f"model.layers.{match.group(1)}.{match.group(2)}.weight"
    return None
