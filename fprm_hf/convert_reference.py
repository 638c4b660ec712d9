"""Convert a checkpoint of the authors' FPRM code (GitHub nilskiKonjIzDunava/fprm) into a saved `FPRMForReasoning`.

    python -m fprm_hf.convert_reference --checkpoint step_50000 --config config/arch/fprm.yaml \
        --config config/cfg_pretrain_state_tracking_fprm_s5.yaml --seq-len 128 --vocab-size 122 \
        --num-puzzle-identifiers 1 --output out/fprm-s5

The checkpoint is what their `pretrain.py` saves: `state_dict()` of the loss-head wrapper around the model, so every
key starts with `model.inner.` (and `_orig_mod.` first when the model was compiled). The settings are their `arch`
fields with their names, read from YAML or JSON files given with `--config` (later files win; a pretrain config's
`arch:` section is used, so `config/arch/fprm.yaml` then a task config reproduces what their hydra run merged; the
`${.field}` references of their files are resolved). The dataset fields their trainer reads from the data
(`vocab_size`, `seq_len`, `num_puzzle_identifiers`) come from the files, their `dataset.json` (`--dataset-json`) or
flags; a flag wins.

Key mapping (theirs, after `model.inner.` → this package):

    embed_tokens.embedding_weight                  → model.embed_tokens.weight
    embed_pos.embedding_weight                     → model.embed_positions.weight          (learned positions)
    puzzle_emb.weights (ids, puzzle_emb_ndim)      → model.prefix (ids, puzzle_emb_len, d)  (zero-padded, reshaped)
    L_level.conv.weight / .bias                    → model.conv.weight / .bias
    L_level.alpha_{1,2}_param                      → model.residual_scaling.alpha{1,2}_logit (input-independent);
                                                     config alpha1/alpha2 (fixed: the stored scalars)
    L_level.alpha_{1,2}_layer.weight / .bias       → model.residual_scaling.alpha{1,2}_proj.weight / .bias
    L_level.layers.{i}.self_attn.qkv_proj.weight   → model.layers.{i}.self_attn.qkv_proj.weight
    L_level.layers.{i}.self_attn.o_proj.weight     → model.layers.{i}.self_attn.o_proj.weight
    L_level.layers.{i}.mlp.gate_up_proj.weight     → model.layers.{i}.mlp.gate_up_proj.weight
    L_level.layers.{i}.mlp.down_proj.weight        → model.layers.{i}.mlp.down_proj.weight
    lm_head.weight                                 → lm_head.weight
    L_optimizer.init_vec                           → model.z_init                           (fixed_init)

Dropped after a check: the `mask` buffer of every linear layer (their DropConnect mask, applied in training only;
all ones unless `weight_dropout` > 0) and the Q-head (`q_head.weight`/`.bias`, a halting/loss head that does not
change the logits; `--keep-q-head` keeps it as `q_head`, for training on with their Q-halt loss). Anything else
(an unknown or missing key, a wrong shape, a setting this package cannot compute such as `mlp_t` or spectral-norm
linears) is a `ValueError` that names it. `puzzle_emb_ndim` is kept: the prefix values beyond it stay zero.
"""

import argparse
import json
import math
import os
import re
import sys

import torch
from huggingface_hub.errors import StrictDataclassError

from .configuration_fprm import FPRMConfig
from .modeling_fprm import FPRMForReasoning


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
POSITIONS = {"rope": "rope", "learned": "learned", "none": "none"}
NORM_TYPES = {"pre-norm": "pre", "post-norm": "post", "peri-norm": "peri"}
CONV_TYPES = {"conv1d": "causal_1d", "conv2d": "2d", "none": "none"}
RESIDUAL_SCALES = {None: "none", "none": "none", "None": "none", "fixed": "fixed",
                   "input-independent": "input_independent", "input-dependent": "input_dependent"}
_REF = re.compile(r"^\$\{\.([A-Za-z_][A-Za-z0-9_]*)\}$")


# ---- settings -----------------------------------------------------------------------------------------------------


def read_settings(path):
    """Their arch fields from one YAML/JSON file: a pretrain config's `arch:` section, or the whole mapping."""
    path = os.fspath(path)
    with open(path) as f:
        text = f.read()
    if path.lower().endswith(".json"):
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of their arch fields, got {type(data).__name__}.")
    if isinstance(data.get("arch"), dict):
        data = data["arch"]
    return dict(data)


def merge_settings(*mappings):
    """Later mappings win; then `${.field}` references (their omegaconf interpolations) are resolved."""
    merged = {}
    for mapping in mappings:
        merged.update({k: v for k, v in mapping.items() if k != "defaults"})
    for _ in range(len(merged) + 1):
        changed = False
        for key, value in merged.items():
            match = _REF.match(value) if isinstance(value, str) else None
            if match:
                if match.group(1) not in merged:
                    raise ValueError(f"`{key}: {value}` refers to `{match.group(1)}`, which no --config file sets.")
                merged[key] = merged[match.group(1)]
                changed = True
        if not changed:
            return merged
    raise ValueError(f"circular `${{.field}}` references among {sorted(merged)}.")


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


def load_reference_state_dict(path, allow_pickle=False):
    """Their checkpoint (a `torch.save`d state dict, or `.safetensors`), read with `weights_only=True` unless
    `allow_pickle`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"--checkpoint {path!r} is not a file.")
    if path.lower().endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except Exception as err:  # the unpickler's own message says which object it refused
        hint = "" if allow_pickle else " (read with weights_only=True; pass --allow-pickle only for a file you trust)"
        raise ValueError(f"could not read {path!r}{hint}: {err}") from err
    if not isinstance(obj, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
        raise ValueError(f"{path!r} does not hold a state dict (str -> tensor), got {type(obj).__name__}.")
    return obj


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
                print(f"note: {key} is not all ones (a DropConnect mask of training); inference does not use it",
                      file=sys.stderr)
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


# ---- conversion ---------------------------------------------------------------------------------------------------


def convert(checkpoint, configs, output, vocab_size=None, seq_len=None, num_puzzle_identifiers=None,
            dataset_json=None, allow_pickle=False, overrides=None, keep_q_head=False):
    """Convert and save; returns the loaded-back `FPRMForReasoning`. `checkpoint` is a path or a state dict;
    `configs` are paths or mappings of their arch fields (later wins). `keep_q_head=True` keeps their Q-head
    (`use_q_head=True`, for training on with their Q-halt loss); by default it is dropped."""
    output = os.fspath(output)
    if os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"--output {output!r} exists and is not a folder.")
    mappings = [c if isinstance(c, dict) else read_settings(c) for c in configs]
    if dataset_json is not None:
        with open(dataset_json) as f:
            meta = json.load(f)
        mappings.append({k: meta[k] for k in ("vocab_size", "seq_len", "num_puzzle_identifiers") if k in meta})
    flags = {"vocab_size": vocab_size, "seq_len": seq_len, "num_puzzle_identifiers": num_puzzle_identifiers}
    mappings.append({k: v for k, v in flags.items() if v is not None})
    mappings.append(dict(overrides or {}))
    settings = merge_settings(*mappings)
    reference = checkpoint if isinstance(checkpoint, dict) else load_reference_state_dict(checkpoint, allow_pickle)
    from .authors_checkpoints import resolve_settings  # the one derivation (it imports this module)

    where = "the checkpoint" if isinstance(checkpoint, dict) else os.fspath(checkpoint)
    settings, grid, _ = resolve_settings(reference, settings, "--config/flags", where=where)
    config = build_config(settings, fixed_alphas_of(reference), use_q_head=keep_q_head, grid=grid)
    state_dict, _ = map_reference_state_dict(reference, config)
    model = FPRMForReasoning(config)
    model.load_state_dict(state_dict, strict=True)
    os.makedirs(output, exist_ok=True)
    model.save_pretrained(output, safe_serialization=True)
    return FPRMForReasoning.from_pretrained(output)


def _parser():
    p = argparse.ArgumentParser(prog="python -m fprm_hf.convert_reference", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="their checkpoint: a torch.save'd state dict or .safetensors")
    p.add_argument("--config", required=True, action="append",
                   help="YAML/JSON with their arch fields (repeat: later files win; a pretrain config's arch: is used)")
    p.add_argument("--output", required=True, help="folder to save_pretrained into")
    p.add_argument("--dataset-json", default=None, help="their dataset.json (vocab_size, seq_len, num_puzzle_identifiers)")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--num-puzzle-identifiers", type=int, default=None)
    p.add_argument("--keep-q-head", action="store_true",
                   help="keep their Q-head (use_q_head=True) instead of dropping it, to train on with its loss")
    p.add_argument("--allow-pickle", action="store_true",
                   help="torch.load with weights_only=False (only for a trusted file holding other objects)")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        model = convert(args.checkpoint, args.config, args.output, args.vocab_size, args.seq_len,
                        args.num_puzzle_identifiers, args.dataset_json, args.allow_pickle,
                        keep_q_head=args.keep_q_head)
    except (ValueError, StrictDataclassError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in model.state_dict().values())
    print(f"saved FPRMForReasoning ({n / 1e6:.2f}M values) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
