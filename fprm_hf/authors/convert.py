"""Convert a checkpoint of the authors' FPRM or TRM code (GitHub nilskiKonjIzDunava/fprm) into a saved
`FPRMForReasoning` (TRM: `FPRMConfig(recursion="trm")`).

    python -m fprm_hf.convert_authors --checkpoint step_50000 --config config/arch/fprm.yaml \
        --config config/cfg_pretrain_state_tracking_fprm_s5.yaml --seq-len 128 --vocab-size 122 \
        --num-puzzle-identifiers 1 --output out/fprm-s5
    python -m fprm_hf.convert_authors --checkpoint step_50000 --config config/arch/trm.yaml \
        --config config/cfg_pretrain_sudoku.yaml --dataset-json data/sudoku/train/dataset.json --output out/trm

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
    H_init / L_init                                → model.H_init / model.L_init            (TRM)
    q_head.weight / .bias                          → q_head.weight / .bias                  (TRM; --keep-q-head)

A checkpoint that holds `H_init` and `L_init` (their models/recursive_reasoning/trm.py) is their TRM: it converts to
`recursion="trm"`, with `H_cycles`, `L_cycles`, `n_backwards_L` (their default 1), `halt_max_steps` and
`halt_exploration_prob` from the settings (their config/arch/trm.yaml) and the Q-head kept (the model halts by it).

Dropped after a check: the `mask` buffer of every linear layer (their DropConnect mask, applied in training only;
all ones unless `weight_dropout` > 0) and the Q-head (`q_head.weight`/`.bias`, a halting/loss head that does not
change the logits; `--keep-q-head` keeps it as `q_head`, for training on with their Q-halt loss). Anything else
(an unknown or missing key, a wrong shape, a setting this package cannot compute such as `mlp_t` or spectral-norm
linears) is a `ValueError` that names it. `puzzle_emb_ndim` is kept: the prefix values beyond it stay zero.
"""

import argparse
import json
import os
import re
import sys

import torch
from huggingface_hub.errors import StrictDataclassError

from ..modeling_fprm import FPRMForReasoning
from .layout import build_config, fixed_alphas_of, map_reference_state_dict, recursion_of
from .settings import resolve_settings

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


# ---- conversion ---------------------------------------------------------------------------------------------------


def convert(
    checkpoint,
    configs,
    output,
    vocab_size=None,
    seq_len=None,
    num_puzzle_identifiers=None,
    dataset_json=None,
    allow_pickle=False,
    overrides=None,
    keep_q_head=False,
):
    """Convert and save; returns the loaded-back `FPRMForReasoning`. `checkpoint` is a path or a state dict;
    `configs` are paths or mappings of their arch fields (later wins). `keep_q_head=True` keeps their Q-head
    (`use_q_head=True`, for training on with their Q-halt loss); by default an FPRM's is dropped (a TRM's is kept:
    its model halts by it)."""
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
    where = "the checkpoint" if isinstance(checkpoint, dict) else os.fspath(checkpoint)
    settings, grid, _ = resolve_settings(reference, settings, "--config/flags", where=where)
    recursion = recursion_of(reference)
    config = build_config(settings, fixed_alphas_of(reference), use_q_head=keep_q_head, grid=grid, recursion=recursion)
    state_dict, _ = map_reference_state_dict(reference, config)
    model = FPRMForReasoning(config)
    model.load_state_dict(state_dict, strict=True)
    os.makedirs(output, exist_ok=True)
    model.save_pretrained(output, safe_serialization=True)
    return FPRMForReasoning.from_pretrained(output)


def _parser():
    p = argparse.ArgumentParser(prog="python -m fprm_hf.convert_authors", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="their checkpoint: a torch.save'd state dict or .safetensors")
    p.add_argument(
        "--config",
        required=True,
        action="append",
        help="YAML/JSON with their arch fields (repeat: later files win; a pretrain config's arch: is used)",
    )
    p.add_argument("--output", required=True, help="folder to save_pretrained into")
    p.add_argument(
        "--dataset-json", default=None, help="their dataset.json (vocab_size, seq_len, num_puzzle_identifiers)"
    )
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--num-puzzle-identifiers", type=int, default=None)
    p.add_argument(
        "--keep-q-head",
        action="store_true",
        help="keep their Q-head (use_q_head=True) instead of dropping it, to train on with its loss",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="torch.load with weights_only=False (only for a trusted file holding other objects)",
    )
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        if not os.path.isfile(args.output):  # before the conversion: a folder that cannot be made fails here
            try:
                os.makedirs(args.output, exist_ok=True)
            except OSError as err:
                raise ValueError(
                    f"--output {args.output} cannot be created ({err.strerror}); give a folder you can write."
                )
        model = convert(
            args.checkpoint,
            args.config,
            args.output,
            args.vocab_size,
            args.seq_len,
            args.num_puzzle_identifiers,
            args.dataset_json,
            args.allow_pickle,
            keep_q_head=args.keep_q_head,
        )
    except (ValueError, StrictDataclassError, OSError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in model.state_dict().values())
    print(f"saved FPRMForReasoning ({n / 1e6:.2f}M values) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
