"""The one derivation of the authors' settings from a checkpoint's files (`resolve_settings`), shared by
`from_pretrained` on their authors' folders (`checkpoints.py`), `FPRMConfig.from_pretrained` and the converter
(`convert_authors`). Each value comes from the first of these that gives it, with where it came from:

1. the tensors' shapes (`weight_settings`);
2. the fields a config file states (their names, `arch:`);
3. the task sizes their dataset builders write, from the data path's name (`data_sizes`);
4. the defaults of their config classes (`layout.COMPUTING_DEFAULTS`).

A later source that contradicts an earlier one, or a field nothing determines, is a `PublishedCheckpointError`
naming it. Their field and key names are mapped to this package's in `layout.py`.
"""

import math
import os
import re

from ..configuration_fprm import swiglu_width
from .layout import COMPUTING_DEFAULTS, GITHUB, strip_reference_prefixes

# Their defaults, with the class that holds each (models/config.py, else fprm_config.py).
FPRM_CONFIG_FIELDS = {
    "fp_thresh",
    "stepsize",
    "stepsize_decay_train",
    "stepsize_decay_eval",
    "decay_patience",
    "eps",
    "init_std",
    "additive_noise_std",
    "fixed_init",
    "max_iter_eval",
    "max_iter",
}

# The sizes their dataset builders write into dataset.json, by the data path's name.
DATA_PATHS = (
    (
        re.compile(r"sudoku"),
        lambda m: dict(seq_len=81, grid=(9, 9), vocab_size=11),
        f"{GITHUB} dataset/build_sudoku_dataset.py (9x9 grids: seq_len 81, vocab 11 = pad + '0'..'9')",
    ),
    (
        re.compile(r"maze-(\d+)x(\d+)"),
        lambda m: dict(seq_len=int(m[1]) * int(m[2]), grid=(int(m[1]), int(m[2])), vocab_size=6),
        "the Maze-Hard builder (HRM's dataset/build_maze_dataset.py; HxW grids from the path's name: seq_len H*W, "
        "vocab 6 = pad + '# SGo')",
    ),
)
# their α tensors, in the order the first one present decides `residual_scale`
ALPHA_KEYS = (
    "L_level.alpha_1_param",
    "L_level.alpha_2_param",
    "L_level.alpha_1_layer.weight",
    "L_level.alpha_2_layer.weight",
)


class PublishedCheckpointError(ValueError):
    """A checkpoint in their layout (an authors' folder, a file given to the converter) that cannot be loaded as it
    is: the message names the file or field."""


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
        raise PublishedCheckpointError(
            f"no {emb} of shape (vocab, hidden) among the tensors: not their FPRM (keys: {sorted(shapes)[:6]})."
        )
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
    found["conv_bias"] = _present(shapes, "L_level.conv.bias")
    if "puzzle_emb.weights" in shapes:
        shown("num_puzzle_identifiers", shapes["puzzle_emb.weights"][0], "puzzle_emb.weights")
        shown("puzzle_emb_ndim", shapes["puzzle_emb.weights"][1], "puzzle_emb.weights")
    else:
        found["puzzle_emb_ndim"] = (0, "no puzzle_emb.weights")
    if "embed_pos.embedding_weight" in shapes:
        shown("pos_encodings", "learned", "embed_pos.embedding_weight")
    found.update(_residual_scale_settings(shapes))
    found["fixed_init"] = _present(shapes, "L_optimizer.init_vec")
    return found, "q_head.weight" in shapes


def _present(shapes, key):
    """(whether the tensor `key` is there, the evidence)."""
    return key in shapes, f"{key} {'present' if key in shapes else 'absent'}"


def _residual_scale_settings(shapes):
    """`residual_scale` (and `outer_only`, where there are α tensors) as their α tensors show them."""
    alpha = [k for k in ALPHA_KEYS if k in shapes]
    if not alpha:
        return {"residual_scale": (None, "no L_level.alpha_* tensors")}
    if alpha[0].endswith("_layer.weight"):
        scale = "input-dependent"
    else:
        scale = "fixed" if shapes[alpha[0]] == () else "input-independent"
    return {
        "residual_scale": (scale, f"{alpha[0]} {shapes[alpha[0]]}"),
        "outer_only": (not any("alpha_1" in k for k in alpha), ", ".join(alpha)),
    }


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
    arch = dict(arch or {})
    settings, sources = _weights_then_stated(reference, arch, arch_source, where)
    grid = _add_task_sizes(settings, sources, data_paths, where)
    _add_defaults(settings, sources, reference)
    missing = [f for f in ("num_heads", "seq_len", "pos_encodings") if settings.get(f) is None]
    if missing:
        raise PublishedCheckpointError(
            f"{where}: nothing determines {missing} (no tensor shape gives them, and no config file or task "
            f"states them): give them as their fields in a config file (all_config.yaml `arch:`)."
        )
    return settings, grid, sources


def _weights_then_stated(reference, arch, arch_source, where):
    """(settings, sources) of sources 1 and 2: what the weights show, then what `arch` states besides; a stated value
    the weights contradict is refused (`expansion` against the SwiGLU width the weights show)."""
    from_weights, _ = weight_settings(reference)
    settings, sources = {}, {}
    for field, (value, evidence) in from_weights.items():
        stated = arch.get(field)
        if field == "intermediate_size":
            continue  # checked against `expansion` below
        if field in arch and stated is not None and not _same(stated, value):
            raise PublishedCheckpointError(
                f"{where}: {arch_source} states {field}={stated!r}, the weights show {value!r} ({evidence})."
            )
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
                f"{swiglu_width(d, float(arch['expansion']))} for hidden {d}), the weights show {width} ({evidence})."
            )
        settings["intermediate_size"], sources["intermediate_size"] = width, f"weights: {evidence}"
        settings.setdefault("expansion", width * 3 / (2 * d))  # recorded only; the width above is what is built
    return settings, sources


def _add_task_sizes(settings, sources, data_paths, where):
    """Adds the task's tokens and vocabulary from the data path's name (`data_sizes`), where the settings do not
    state them (and refuses those they contradict); returns the task's grid, or None."""
    sizes, size_source = data_sizes(data_paths)
    if sizes is None:
        return None
    for field in ("seq_len", "vocab_size"):
        if field in settings and not _same(settings[field], sizes[field]):
            raise PublishedCheckpointError(
                f"{where}: {size_source} gives {field}={sizes[field]}, the {sources[field]} shows {settings[field]}."
            )
        if field not in settings:
            settings[field], sources[field] = sizes[field], size_source
    sources["grid"] = size_source
    return list(sizes["grid"])


def _add_defaults(settings, sources, reference):
    """Adds what is still unset: the tokens that learned positions imply, the one puzzle identifier, and the defaults
    of their config classes (`COMPUTING_DEFAULTS`)."""
    if settings.get("pos_encodings") == "learned" and "seq_len" not in settings:
        rows = strip_reference_prefixes(reference)["embed_pos.embedding_weight"].shape[0]
        prefix = settings.get("puzzle_emb_len", COMPUTING_DEFAULTS["puzzle_emb_len"]) or 0
        settings["seq_len"], sources["seq_len"] = rows - prefix, "weights: embed_pos.embedding_weight rows - prefix"
    settings.setdefault("num_puzzle_identifiers", 1)  # no puzzle embedding: their datasets' single identifier
    sources.setdefault("num_puzzle_identifiers", "no puzzle_emb.weights: the one identifier their datasets use")
    for field, default in COMPUTING_DEFAULTS.items():
        if field not in settings:
            settings[field] = default
            holder = (
                "models/fixed_point_reasoning/fprm_config.py FPRMConfig"
                if field in FPRM_CONFIG_FIELDS
                else "models/config.py ReasoningModelConfig"
            )
            sources[field] = f"{GITHUB} {holder} default"


__all__ = ["PublishedCheckpointError", "weight_settings", "data_sizes", "resolve_settings"]
