"""The authors' FPRM layout (GitHub nilskiKonjIzDunava/fprm) and this package's: their arch field names and key
names mapped to `FPRMConfig` and `FPRMForReasoning`'s, and the one derivation of their settings from a checkpoint's
files (`resolve_settings`), shared by `from_pretrained` on their published folders (`authors_checkpoints`),
`AutoConfig` and the converter (`convert_reference`; its docstring has the key mapping table).
"""

import math
import os
import re

import torch
from transformers.utils import logging

from .configuration_fprm import FPRMConfig, swiglu_width
from .modeling_fprm import FPRMForReasoning

logger = logging.get_logger(__name__)

GITHUB = "GitHub nilskiKonjIzDunava/fprm"
COMPILE_PREFIX = "_orig_mod."
WRAPPER_PREFIX = "model.inner."

# their fields that set what the forward computes, with their defaults (models/config.py, fprm_config.py)
COMPUTING_DEFAULTS = {
    "puzzle_emb_ndim": 0, "puzzle_emb_len": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "causal": False,
    "softmax_temp": 1.0, "norm_type": "post-norm", "norm_placement": "none", "conv_type": "none",
    "conv_kernel_size": 4, "conv_bias": False, "residual_scale": None, "alpha_1_init": 0.5, "alpha_2_init": 0.5,
    "normalize_input_injection": False, "use_spec_norm_linear": False, "outer_only": False, "mlp_t": False,
    "fp_thresh": 0.1, "stepsize": 1.0, "stepsize_decay_train": 0.9, "stepsize_decay_eval": 0.99,
    "decay_patience": 5, "eps": 1e-8, "init_std": 1.0, "additive_noise_std": 0.0, "fixed_init": False,
    "max_iter_eval": None, "max_iter": None,
}
REQUIRED = ("vocab_size", "seq_len", "num_puzzle_identifiers", "hidden_size", "num_heads", "expansion", "L_layers",
            "pos_encodings")
# their fields that change training, logging or data handling only: accepted and not used
IGNORED = {
    "name", "loss", "batch_size", "H_cycles", "L_cycles", "H_layers", "n_backwards_L", "halt_max_steps",
    "halt_exploration_prob", "halting_mechanism", "forward_dtype", "no_ACT_continue", "q_logit_from_puzzle_emb",
    "q_logit_detach_model", "weight_dropout", "variational_dropout", "jacobian_reg", "n_jacobian_samples",
    "jacobian_eps", "outlier_quantile", "max_iter_dist", "gamma_alpha", "gamma_scale", "expon_scale",
    "n_decode_steps",
}
# Their defaults, with the class that holds each (models/config.py, else fprm_config.py).
FPRM_CONFIG_FIELDS = {"fp_thresh", "stepsize", "stepsize_decay_train", "stepsize_decay_eval", "decay_patience", "eps",
                      "init_std", "additive_noise_std", "fixed_init", "max_iter_eval", "max_iter"}

# The sizes their dataset builders write into dataset.json, by the data path's name.
DATA_PATHS = (
    (re.compile(r"sudoku"), lambda m: dict(seq_len=81, grid=(9, 9), vocab_size=11),
     f"{GITHUB} dataset/build_sudoku_dataset.py (9x9 grids: seq_len 81, vocab 11 = pad + '0'..'9')"),
    (re.compile(r"maze-(\d+)x(\d+)"), lambda m: dict(seq_len=int(m[1]) * int(m[2]), grid=(int(m[1]), int(m[2])),
                                                     vocab_size=6),
     "the Maze-Hard builder (HRM's dataset/build_maze_dataset.py; HxW grids from the path's name: seq_len H*W, "
     "vocab 6 = pad + '# SGo')"),
)
POSITIONS = {"rope": "rope", "learned": "learned", "none": "none"}
NORM_TYPES = {"pre-norm": "pre", "post-norm": "post", "peri-norm": "peri"}
CONV_TYPES = {"conv1d": "causal_1d", "conv2d": "2d", "none": "none"}
RESIDUAL_SCALES = {None: "none", "none": "none", "None": "none", "fixed": "fixed",
                   "input-independent": "input_independent", "input-dependent": "input_dependent"}


class PublishedCheckpointError(ValueError):
    """A checkpoint in their layout (a published folder, a file given to the converter) that cannot be loaded as it
    is: the message names the file or field."""


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
        raise ValueError(f"unknown settings {unknown}: not fields of the authors' FPRM config (or not supported here).")
    missing = [k for k in REQUIRED if settings.get(k) is None]
    if missing:
        raise ValueError(f"missing settings {missing}: give them in a --config file or as flags "
                         f"(vocab_size/seq_len/num_puzzle_identifiers come from their dataset.json).")
    s = {**COMPUTING_DEFAULTS, **settings}
    unsupported = []
    if _bool(s, "mlp_t"):
        unsupported.append("mlp_t=True (an MLP over the sequence instead of attention)")
    if s["residual_scale"] not in RESIDUAL_SCALES:
        raise ValueError(f"`residual_scale` must be one of {sorted(map(str, RESIDUAL_SCALES))}, got "
                         f"{s['residual_scale']!r}.")
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


def build_config(settings, fixed_alphas=None, use_q_head=False, grid=None):
    """An `FPRMConfig` from their arch fields (names as in their code; module docstring). `intermediate_size`, where
    given (the weights' SwiGLU width), is built as it is instead of their rule over `expansion`; `grid` is the
    task's (height, width), which a conv2d needs and which fixes the input length."""
    s = check_settings(settings)
    residual = RESIDUAL_SCALES[s["residual_scale"]]
    hidden, seq_len = int(s["hidden_size"]), int(s["seq_len"])
    ndim = int(s["puzzle_emb_ndim"])
    prefix = -(ndim // -hidden) if int(s["puzzle_emb_len"]) == 0 else int(s["puzzle_emb_len"])
    if ndim == 0 and prefix:
        raise ValueError(f"puzzle_emb_ndim=0 with puzzle_emb_len={prefix}: their model has no puzzle embedding to "
                         f"fill the {prefix} prefix rows (set puzzle_emb_len: 0).")
    conv_type = CONV_TYPES[s["conv_type"]]
    grid_size = list(grid) if grid is not None else None
    if grid_size is not None and math.prod(grid_size) != seq_len:
        raise ValueError(f"a {grid_size[0]}x{grid_size[1]} grid has {math.prod(grid_size)} tokens, seq_len is {seq_len}.")
    if conv_type == "2d" and grid_size is None:
        side = math.isqrt(seq_len)
        if side * side != seq_len:
            raise ValueError(f"conv_type=conv2d needs a square grid, got seq_len={seq_len}.")
        grid_size = side
    alpha1, alpha2 = float(s["alpha_1_init"]), float(s["alpha_2_init"])
    if fixed_alphas is not None:
        alpha1 = fixed_alphas.get("alpha1", alpha1)
        alpha2 = fixed_alphas.get("alpha2", alpha2)
    max_loops = s["max_iter_eval"] if s["max_iter_eval"] is not None else s["max_iter"]
    return FPRMConfig(
        vocab_size=int(s["vocab_size"]), hidden_size=hidden, num_attention_heads=int(s["num_heads"]),
        expansion=float(s["expansion"]), intermediate_size=s.get("intermediate_size"), num_hidden_layers=int(s["L_layers"]), grid_size=grid_size,
        conv_type=conv_type, conv_kernel_size=int(s["conv_kernel_size"]), conv_bias=_bool(s, "conv_bias"),
        causal=_bool(s, "causal"), position_embedding_type=POSITIONS[s["pos_encodings"]],
        max_position_embeddings=seq_len + prefix, rope_theta=float(s["rope_theta"]), num_prefix_tokens=prefix,
        num_puzzle_identifiers=int(s["num_puzzle_identifiers"]), residual_scaling=residual,
        outer_only=_bool(s, "outer_only"), alpha1=alpha1, alpha2=alpha2, norm_type=NORM_TYPES[s["norm_type"]],
        norm_placement=s["norm_placement"], normalize_input_injection=_bool(s, "normalize_input_injection"),
        softmax_temperature=float(s["softmax_temp"]), init_std=float(s["init_std"]),
        fixed_init=_bool(s, "fixed_init"), halt_eps=float(s["fp_thresh"]), eta=float(s["stepsize"]),
        gamma_train=float(s["stepsize_decay_train"]), gamma_eval=float(s["stepsize_decay_eval"]),
        patience=int(s["decay_patience"]), rms_norm_eps=float(s["rms_norm_eps"]),
        puzzle_emb_ndim=ndim if prefix else None, use_q_head=use_q_head,
        **({"max_loops": int(max_loops)} if max_loops else {}),
    )


# ---- weights ------------------------------------------------------------------------------------------------------


def strip_reference_prefixes(reference):
    """Their keys without `_orig_mod.` (compiled) and `model.inner.` (the loss-head wrapper); another key is refused."""
    out = {}
    outside = []
    for key, tensor in reference.items():
        name = key[len(COMPILE_PREFIX):] if key.startswith(COMPILE_PREFIX) else key
        if not name.startswith(WRAPPER_PREFIX):
            outside.append(key)
            continue
        out[name[len(WRAPPER_PREFIX):]] = tensor
    if outside:
        raise ValueError(f"unknown keys {sorted(outside)[:10]}{' ...' if len(outside) > 10 else ''}: every key of "
                         f"their checkpoint starts with {WRAPPER_PREFIX!r} (after an optional {COMPILE_PREFIX!r}).")
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
        if key in ("q_head.weight", "q_head.bias") and config.use_q_head:
            mapped[key] = tensor.float()
            continue
        if key in ("q_head.weight", "q_head.bias", "L_level.rotary_emb.cos_cached", "rotary_emb.cos_cached",
                   "rotary_emb.sin_cached"):
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
        raise ValueError(f"unknown keys {unknown}: not weights of the authors' FPRM with these settings "
                         f"(residual_scale={config.residual_scaling}, conv_type={config.conv_type}, "
                         f"pos_encodings={config.position_embedding_type}, fixed_init={config.fixed_init}).")
    expected = {k: tuple(v.shape) for k, v in FPRMForReasoning(config).state_dict().items()}
    extra = sorted(set(mapped) - set(expected))
    if extra:
        raise ValueError(f"unknown keys {extra}: the model with these settings (outer_only={config.outer_only}) has "
                         f"no such weights.")
    missing = sorted(set(expected) - set(mapped))
    if missing:
        raise ValueError(f"missing keys {missing}: the model with these settings needs them and the checkpoint does "
                         f"not have them.")
    wrong = [f"{k}: checkpoint {tuple(v.shape)} vs model {expected[k]}" for k, v in mapped.items()
             if tuple(v.shape) != expected[k]]
    if wrong:
        raise ValueError(f"wrong shapes: {wrong}.")
    return mapped, dropped


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
    match = re.fullmatch(r"L_level\.layers\.(\d+)\.(self_attn\.qkv_proj|self_attn\.o_proj|mlp\.gate_up_proj|"
                         r"mlp\.down_proj)\.weight", key)
    if match:
        return f"model.layers.{match.group(1)}.{match.group(2)}.weight"
    return None


# ---- the derivation: their settings from a checkpoint's files --------------------------------------------------


def weight_settings(reference):
    """{their field: (value, the tensor that shows it)} of what the tensors' shapes determine, and whether they hold
    a Q-head. `reference` maps their keys (any prefix) to tensors."""
    ref = strip_reference_prefixes(reference)
    shapes = {k: tuple(v.shape) for k, v in ref.items()}
    found = {}

    def shown(field, value, key):
        found[field] = (value, f"{key} {shapes[key]}")

    emb = "embed_tokens.embedding_weight"
    if emb not in shapes or len(shapes[emb]) != 2:
        raise PublishedCheckpointError(f"no {emb} of shape (vocab, hidden) among the tensors: not their FPRM "
                                       f"(keys: {sorted(shapes)[:6]}).")
    shown("vocab_size", shapes[emb][0], emb)
    shown("hidden_size", shapes[emb][1], emb)
    layers = sorted({int(m[1]) for k in shapes if (m := re.match(r"L_level\.layers\.(\d+)\.", k))})
    if layers:
        found["L_layers"] = (len(layers), f"L_level.layers.0..{layers[-1]}")
        gate_up = f"L_level.layers.{layers[0]}.mlp.gate_up_proj.weight"
        if gate_up in shapes:
            shown("intermediate_size", shapes[gate_up][0] // 2, gate_up)
    conv = "L_level.conv.weight"
    if conv in shapes:
        shown("conv_type", {3: "conv1d", 4: "conv2d"}.get(len(shapes[conv]), "unknown"), conv)
        shown("conv_kernel_size", shapes[conv][-1], conv)
    else:
        found["conv_type"] = ("none", "no L_level.conv.weight")
    found["conv_bias"] = ("L_level.conv.bias" in shapes, "L_level.conv.bias " + ("present" if "L_level.conv.bias"
                                                                                  in shapes else "absent"))
    if "puzzle_emb.weights" in shapes:
        shown("num_puzzle_identifiers", shapes["puzzle_emb.weights"][0], "puzzle_emb.weights")
        shown("puzzle_emb_ndim", shapes["puzzle_emb.weights"][1], "puzzle_emb.weights")
    else:
        found["puzzle_emb_ndim"] = (0, "no puzzle_emb.weights")
    if "embed_pos.embedding_weight" in shapes:
        shown("pos_encodings", "learned", "embed_pos.embedding_weight")
    alpha = [k for k in ("L_level.alpha_1_param", "L_level.alpha_2_param", "L_level.alpha_1_layer.weight",
                         "L_level.alpha_2_layer.weight") if k in shapes]
    if not alpha:
        found["residual_scale"] = (None, "no L_level.alpha_* tensors")
    elif alpha[0].endswith("_layer.weight"):
        shown("residual_scale", "input-dependent", alpha[0])
    else:
        shown("residual_scale", "fixed" if shapes[alpha[0]] == () else "input-independent", alpha[0])
    if alpha:
        found["outer_only"] = (not any("alpha_1" in k for k in alpha), ", ".join(alpha))
    found["fixed_init"] = ("L_optimizer.init_vec" in shapes, "L_optimizer.init_vec " + (
        "present" if "L_optimizer.init_vec" in shapes else "absent"))
    return found, "q_head.weight" in shapes


def _same(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b))
    return a == b or (a in (None, "none", "None") and b in (None, "none", "None"))


def data_sizes(data_paths):
    """(sizes, source) from the first data path whose name their builders' sizes are known for, or (None, None)."""
    for data_path in data_paths or ():
        for pattern, sizes, builder in DATA_PATHS:
            if match := pattern.search(os.path.basename(os.path.normpath(str(data_path)))):
                return sizes(match), f"data path {data_path!r} -> {builder}"
    return None, None


def resolve_settings(reference, arch=None, arch_source=None, data_paths=None, where="the checkpoint"):
    """(their arch fields, grid, sources): the one derivation (module docstring). `arch` is what a config file
    states (their field names), `data_paths` the run's data; raises `PublishedCheckpointError` naming a
    contradiction or a value nothing determines."""
    from_weights, _ = weight_settings(reference)
    arch = {k: v for k, v in (arch or {}).items()}
    settings, sources = {}, {}
    for field, (value, evidence) in from_weights.items():
        stated = arch.get(field)
        if field == "intermediate_size":
            continue  # checked against `expansion` below
        if field in arch and stated is not None and not _same(stated, value):
            raise PublishedCheckpointError(f"{where}: {arch_source} states {field}={stated!r}, the weights show "
                                           f"{value!r} ({evidence}).")
        settings[field], sources[field] = value, f"weights: {evidence}"
    for field, value in arch.items():
        if field not in settings:
            settings[field], sources[field] = value, f"{arch_source}.{field}"
    if "intermediate_size" in from_weights:
        width, evidence = from_weights["intermediate_size"]
        d = settings["hidden_size"]
        if "expansion" in arch and swiglu_width(d, float(arch["expansion"])) != width:
            raise PublishedCheckpointError(
                f"{where}: {arch_source} states expansion={arch['expansion']!r} (SwiGLU width "
                f"{swiglu_width(d, float(arch['expansion']))} for hidden {d}), the weights show {width} ({evidence}).")
        settings["intermediate_size"], sources["intermediate_size"] = width, f"weights: {evidence}"
        settings.setdefault("expansion", width * 3 / (2 * d))  # recorded only; the width above is what is built
    sizes, size_source = data_sizes(data_paths)
    grid = None
    if sizes is not None:
        for field in ("seq_len", "vocab_size"):
            if field in settings and not _same(settings[field], sizes[field]):
                raise PublishedCheckpointError(f"{where}: {size_source} gives {field}={sizes[field]}, the "
                                               f"{sources[field]} shows {settings[field]}.")
            if field not in settings:
                settings[field], sources[field] = sizes[field], size_source
        grid, sources["grid"] = list(sizes["grid"]), size_source
    if settings.get("pos_encodings") == "learned" and "seq_len" not in settings:
        rows = strip_reference_prefixes(reference)["embed_pos.embedding_weight"].shape[0]
        prefix = settings.get("puzzle_emb_len", COMPUTING_DEFAULTS["puzzle_emb_len"]) or 0
        settings["seq_len"], sources["seq_len"] = rows - prefix, "weights: embed_pos.embedding_weight rows - prefix"
    settings.setdefault("num_puzzle_identifiers", 1)  # no puzzle embedding: their datasets' single identifier
    sources.setdefault("num_puzzle_identifiers", "no puzzle_emb.weights: the one identifier their datasets use")
    for field, default in COMPUTING_DEFAULTS.items():
        if field not in settings:
            settings[field] = default
            holder = "models/fixed_point_reasoning/fprm_config.py FPRMConfig" if field in FPRM_CONFIG_FIELDS else \
                "models/config.py ReasoningModelConfig"
            sources[field] = f"{GITHUB} {holder} default"
    missing = [f for f in ("num_heads", "seq_len", "pos_encodings") if settings.get(f) is None]
    if missing:
        raise PublishedCheckpointError(
            f"{where}: nothing determines {missing} (no tensor shape gives them, and no config file or task "
            f"states them): give them as their fields in a config file (all_config.yaml `arch:`).")
    return settings, grid, sources
