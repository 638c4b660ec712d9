"""Convert a checkpoint of the authors' reference code (a nanoGPT fork) into a saved `LoopFormerForCausalLM`.

    python -m loopformer_hf.convert_authors --checkpoint ckpt.pt --output out/ \
        --n-layer 3 --n-loops 8 --n-embd 2048 --n-head 32 --mlp-hidden 5120 [--model-type loopformer]
    python -m loopformer_hf.convert_authors --hub_repo armenjeddi/LoopFormer-3block-8iterations \
        [--revision R] --output_dir out/

The second form downloads one of the authors' Hub repos with huggingface_hub (its cache and offline mode honoured)
and saves it in this package's format; `from_pretrained` on the repo itself works too (`checkpoints.py`).

`--model-type` names the reference file the checkpoint comes from (train.py's `model_type`):

    loopformer (models/loopformer.py) → loop_conditioning="shortcut"
    tmlt       (models/tmlt.py)       → loop_conditioning="timestep"
    base_loop  (models/base_loop.py)  → loop_conditioning="none", block_norm_weight=True
    base       (models/base.py)       → loop_conditioning="none", block_norm_weight=True, num_loops=1
                                        (`--n-layer` is then the number of blocks, e.g. 24; `--n-loops` 1 or omitted)

The checkpoint holds no shape hyper-parameters we rely on, so they are given on the command line (defaults are
the reference's: vocab 50304, block_size 1024, GELU MLP of width 4·n_embd unless `--mlp-hidden` is given). Every
key of the checkpoint must be mapped and every parameter of the model must be filled with a tensor of the right
shape; anything else is a `ValueError` that lists the offending keys.

Key mapping (reference → this package), for each block j (Base keeps its blocks in a plain list: its keys are
`transformer.h.{j}.…` instead of `transformer.h.blocks.{j}.…`):

    transformer.wte.weight                              → model.embed_tokens.weight (and the tied lm_head.weight)
    transformer.wpe.weight                              → model.embed_positions.weight
    transformer.h.blocks.{j}.attn.c_attn.weight (q|k|v) → model.layers.{j}.self_attn.{q,k,v}_proj.weight
    transformer.h.blocks.{j}.attn.c_proj.weight         → model.layers.{j}.self_attn.o_proj.weight
    transformer.h.blocks.{j}.mlp.c_fc.weight            → model.layers.{j}.mlp.up_proj.weight
    transformer.h.blocks.{j}.mlp.c_proj.weight          → model.layers.{j}.mlp.down_proj.weight
    transformer.h.blocks.{j}.adaLN_modulation.1.{w,b}   → model.layers.{j}.adaLN_modulation.1.{w,b}
    transformer.h.blocks.{j}.norm_1.weight              → model.layers.{j}.input_layernorm.weight (Base-Loop, Base)
    transformer.h.blocks.{j}.norm_2.weight              → model.layers.{j}.post_attention_layernorm.weight
    transformer.norm_f.weight                           → model.norm.weight
    time_embedder.mlp.{0,2}.{w,b}                       → model.loop_conditioning.time_embedder.mlp.{0,2}.{w,b}
    dt_embedder.mlp.{0,2}.{w,b}                         → model.loop_conditioning.dt_embedder.mlp.{0,2}.{w,b}
    lm_head.weight                                      → tied to wte (must equal it when present)

Checkpoint containers handled explicitly: a bare state dict; a `.pt` dict that wraps it under `"model"` (nanoGPT's
`train.py`) or `"state_dict"`; the `_orig_mod.` prefix that `torch.compile` adds to every key; and nanoGPT's
causal-mask buffer `transformer.h.blocks.{j}.attn.bias` (not a weight; dropped after checking its shape).
"""

import argparse
import os
import re
import sys

import torch
from huggingface_hub.errors import StrictDataclassError

from ..configuration_loopformer import LoopFormerConfig
from ..modeling_loopformer import LoopFormerForCausalLM
from .checkpoints import from_pretrained_authors
from .model_types import MODEL_TYPES
from .weights import map_names

COMPILE_PREFIX = "_orig_mod."
WRAPPER_KEYS = ("model", "state_dict")
TORCH_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_EXTENSIONS = (".safetensors",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHARED_BLOCK_KEY = re.compile(r"^transformer\.h\.blocks\.(\d+)\.(.+)$")
_LIST_BLOCK_KEY = re.compile(r"^transformer\.h\.(\d+)\.(.+)$")


# ---- reading the checkpoint --------------------------------------------------------------------------------------


def load_reference_state_dict(path, allow_pickle=False):
    """Read an authors' checkpoint (`.pt`/`.pth`/`.bin`/`.ckpt` or `.safetensors`) and return its flat state dict.

    `.pt` files are read with `torch.load(weights_only=True)` unless `allow_pickle=True` (only for files you trust).
    A wrapped state dict (`{"model": sd, ...}` or `{"state_dict": sd, ...}`) is unwrapped and the `_orig_mod.`
    prefix of torch.compile'd models is removed.
    """
    path = os.fspath(path)
    lower = path.lower()
    if not lower.endswith(TORCH_EXTENSIONS + SAFETENSORS_EXTENSIONS):
        raise ValueError(
            f"`--checkpoint` {path!r} has an unsupported extension; allowed: "
            f"{', '.join(TORCH_EXTENSIONS + SAFETENSORS_EXTENSIONS)}."
        )
    if not os.path.isfile(path):
        raise ValueError(f"`--checkpoint` {path!r} does not exist or is not a file.")
    if lower.endswith(SAFETENSORS_EXTENSIONS):
        from safetensors.torch import load_file

        obj = load_file(path, device="cpu")
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
        except Exception as error:  # torch raises UnpicklingError / RuntimeError for unsafe or corrupt files
            hint = (
                "" if allow_pickle else " If the file is trusted and holds other Python objects, pass --allow-pickle."
            )
            raise ValueError(f"Could not read {path!r} with torch.load: {error}.{hint}") from error
    return _unwrap(obj, path)


def _is_state_dict(obj):
    return (
        isinstance(obj, dict)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def _unwrap(obj, path):
    if not isinstance(obj, dict):
        raise ValueError(f"{path!r} holds a {type(obj).__name__}, not a state dict (a dict of tensors).")
    if not _is_state_dict(obj):
        wrapped = [key for key in WRAPPER_KEYS if _is_state_dict(obj.get(key))]
        if not wrapped:
            raise ValueError(
                f"{path!r} is neither a state dict (a dict of name -> tensor) nor a dict that wraps one under "
                f"{' or '.join(repr(k) for k in WRAPPER_KEYS)}; its top-level keys are {sorted(map(str, obj))[:20]}."
            )
        obj = obj[wrapped[0]]
    state_dict = {}
    for key, value in obj.items():
        new_key = key[len(COMPILE_PREFIX) :] if key.startswith(COMPILE_PREFIX) else key
        if new_key in state_dict:
            raise ValueError(f"{path!r} holds both {new_key!r} and {COMPILE_PREFIX + new_key!r}.")
        state_dict[new_key] = value
    return state_dict


# ---- mapping -------------------------------------------------------------------------------------------------------


def _check_model_type(model_type):
    if model_type not in MODEL_TYPES:
        raise ValueError(f"`model_type` must be one of {tuple(MODEL_TYPES)}, got {model_type!r}.")
    return MODEL_TYPES[model_type]


def build_config(
    n_layer,
    n_loops,
    n_embd,
    n_head,
    vocab_size=50304,
    block_size=1024,
    mlp_hidden=None,
    model_type="loopformer",
    frequency_embedding_size=256,
    max_period=10000.0,
    **extra,
):
    """The `LoopFormerConfig` of a reference model: GELU MLP, no biases, learned positions, tied head.

    `n_loops=None` is allowed for `model_type="base"` only (one pass over its blocks)."""
    loop_conditioning, block_norm_weight, plain_list = _check_model_type(model_type)
    if plain_list:
        if n_loops not in (None, 1):
            raise ValueError(f"`n_loops` must be 1 (or omitted) for model_type='base' (not looped), got {n_loops!r}.")
        n_loops = 1
    elif n_loops is None:
        raise ValueError(f"`n_loops` (L, loop steps of training) is required for model_type={model_type!r}.")
    return LoopFormerConfig(
        vocab_size=vocab_size,
        hidden_size=n_embd,
        num_attention_heads=n_head,
        intermediate_size=4 * n_embd if mlp_hidden is None else mlp_hidden,
        hidden_act="gelu",
        num_hidden_layers=n_layer,
        num_loops=n_loops,
        loop_conditioning=loop_conditioning,
        block_norm_weight=block_norm_weight,
        position_embedding_type="learned",
        max_position_embeddings=block_size,
        tie_word_embeddings=True,
        rms_norm_eps=None,
        frequency_embedding_size=frequency_embedding_size,
        max_period=max_period,
        attention_bias=False,
        mlp_bias=False,
        **extra,
    )


def map_reference_state_dict(reference, config, model_type="loopformer"):
    """Map reference keys onto `LoopFormerForCausalLM` keys by the table `from_pretrained` loads their Hub repos with
    (`weights.map_names`), every key checked. Raises `ValueError` listing every problem at once."""
    plain_list = _check_model_type(model_type)[2]
    block_key, other_layout = (
        (_LIST_BLOCK_KEY, _SHARED_BLOCK_KEY) if plain_list else (_SHARED_BLOCK_KEY, _LIST_BLOCK_KEY)
    )
    d, n = config.hidden_size, config.max_position_embeddings
    unknown, problems, reference = [], [], dict(reference)
    for key in [k for k in reference if (m := block_key.match(k)) and m.group(2) == "attn.bias"]:
        # nanoGPT's causal-mask buffer (no flash attention): not a weight
        if tuple(reference.pop(key).shape) != (1, 1, n, n):
            problems.append(f"{key}: causal-mask buffer must have shape (1, 1, {n}, {n})")
    for key in [k for k in reference if (m := block_key.match(k)) and m.group(2).startswith("attn.c_attn.")]:
        if reference[key].shape[0] != 3 * d:
            expected = f"({3 * d}, {d})" if key.endswith("weight") else f"({3 * d},)"
            problems.append(f"{key}: fused qkv must have shape {expected}, got {tuple(reference.pop(key).shape)}")
    if "lm_head.weight" in reference and "transformer.wte.weight" in reference:
        head, wte = reference.pop("lm_head.weight"), reference["transformer.wte.weight"]
        if head.shape != wte.shape or not torch.equal(head, wte):
            problems.append(
                "lm_head.weight differs from transformer.wte.weight; the reference ties them and so does "
                "the converted model (tie_word_embeddings=True)"
            )
    unknown += [key for key in reference if other_layout.match(key)]
    model_shapes = _expected_shapes(config)
    mapped = {}
    for source, name, tensor in map_names({k: v for k, v in reference.items() if not other_layout.match(k)}):
        if name not in model_shapes:
            unknown.append(source)
            continue
        mapped[name] = tensor
        if tuple(tensor.shape) != model_shapes[name]:
            problems.append(
                f"{source} -> {name}: checkpoint shape {tuple(tensor.shape)}, model expects {model_shapes[name]}"
            )
        if not tensor.is_floating_point():
            problems.append(f"{source}: dtype {tensor.dtype} is not a floating-point type")
    missing = sorted(key for key in model_shapes if key not in mapped and key != "lm_head.weight")
    if unknown or missing or problems:
        raise _mismatch_error(config, model_type, plain_list, other_layout, unknown, missing, problems)
    return mapped


def _mismatch_error(config, model_type, plain_list, other_layout, unknown, missing, problems):
    """One `ValueError` listing every problem `map_reference_state_dict` found."""
    parts = []
    if unknown:
        parts.append(
            f"unknown keys (not part of a {config.num_hidden_layers}-block reference model of "
            f"model_type={model_type!r}): {sorted(set(unknown))}"
        )
        if any(other_layout.match(key) for key in unknown):
            hint = (
                "model_type='base' keeps its blocks under transformer.h.{j}"
                if plain_list
                else "keys transformer.h.{j}.… (no .blocks) are the layout of models/base.py: model_type='base'"
            )
            parts.append(f"block keys of the other layout: {hint}")
    if missing:
        parts.append(f"missing keys (model parameters the checkpoint does not fill): {missing}")
    if problems:
        parts.append("shape/value mismatches: " + "; ".join(problems))
    return ValueError(
        "The checkpoint does not match the given shape hyper-parameters "
        f"(n_layer={config.num_hidden_layers}, n_embd={config.hidden_size}, n_head={config.num_attention_heads}, "
        f"vocab_size={config.vocab_size}, block_size={config.max_position_embeddings}, "
        f"mlp_hidden={config.intermediate_size}):\n  - " + "\n  - ".join(parts)
    )


def _expected_shapes(config):
    with torch.device("meta"):
        model = LoopFormerForCausalLM(config)
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def convert(checkpoint, output, dtype="float32", allow_pickle=False, safe_serialization=True, **architecture):
    """Convert `checkpoint` (a model of the reference's `model_type`) and save it with `save_pretrained` into
    `output`. `architecture`: `build_config`'s arguments (n_layer, n_loops, n_embd, n_head, ..., model_type). Returns
    the converted model (eval)."""
    output = os.fspath(output)
    # checked before any work: save_pretrained only logs an error for a file path and writes nothing
    if os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"--output {output!r} exists and is not a folder.")
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {sorted(DTYPES)}, got {dtype!r}.")
    config = build_config(**architecture)
    reference = load_reference_state_dict(checkpoint, allow_pickle=allow_pickle)
    state_dict = map_reference_state_dict(reference, config, architecture.get("model_type", "loopformer"))

    model = LoopFormerForCausalLM(config)
    result = model.load_state_dict({k: v.to(torch.float32) for k, v in state_dict.items()}, strict=False)
    leftover = sorted(set(result.missing_keys) - {"lm_head.weight"}) + sorted(result.unexpected_keys)
    if leftover:  # map_reference_state_dict checked this already; a failure here is a bug of the converter
        raise RuntimeError(f"internal error: keys not loaded into the model: {leftover}")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(DTYPES[dtype]).eval()
    model.save_pretrained(output, safe_serialization=safe_serialization)
    return model


# ---- command line --------------------------------------------------------------------------------------------------


# what a Hub repo of theirs holds that a converted folder needs (their remote code is not needed)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.txt", "*.model"]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
)


def convert_hub_repo(repo, output, revision=None, dtype=None):
    """Download one of the authors' Hub repos (huggingface_hub: the cache, `HF_HUB_OFFLINE` and `HF_ENDPOINT` are
    honoured; a local folder is read in place) and save it in this package's format, tokenizer included."""
    import shutil

    from huggingface_hub import snapshot_download

    output = os.fspath(output)
    if os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"--output_dir {output!r} exists and is not a folder.")
    folder = repo if os.path.isdir(repo) else snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS)
    model = from_pretrained_authors(folder, dtype=DTYPES[dtype] if dtype else "auto")
    model.save_pretrained(output)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(output, name))
    return model


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m loopformer_hf.convert_authors",
        description="Convert a reference LoopFormer (nanoGPT-style) checkpoint, or one of the authors' Hub repos, into "
        "a saved LoopFormerForCausalLM.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="authors' checkpoint: .pt/.pth/.bin/.ckpt or .safetensors")
    source.add_argument(
        "--hub_repo",
        help="a Hub repo id of the authors (e.g. armenjeddi/LoopFormer-3block-"
        "8iterations) or a local folder in their layout; the shapes come from its config.json",
    )
    p.add_argument("--revision", default=None, help="with --hub_repo: branch, tag or commit")
    p.add_argument("--output", "--output_dir", dest="output", required=True, help="folder to save_pretrained into")
    p.add_argument(
        "--n-layer",
        type=int,
        default=None,
        help="k, number of shared blocks (model type base: all its blocks); required with --checkpoint",
    )
    p.add_argument(
        "--n-loops",
        type=int,
        default=None,
        help="L, loop steps of the training trajectory (required except for --model-type base: 1)",
    )
    p.add_argument("--n-embd", type=int, default=None, help="hidden size d; required with --checkpoint")
    p.add_argument("--n-head", type=int, default=None, help="attention heads; required with --checkpoint")
    p.add_argument("--vocab-size", type=int, default=50304, help="vocabulary size (default: 50304)")
    p.add_argument("--block-size", type=int, default=1024, help="learned positions (default: 1024)")
    p.add_argument("--mlp-hidden", type=int, default=None, help="GELU MLP width (default: 4 * n_embd)")
    p.add_argument(
        "--model-type",
        default="loopformer",
        choices=tuple(MODEL_TYPES),
        help="the reference model the checkpoint comes from: loopformer (default), tmlt, base_loop, base",
    )
    p.add_argument("--frequency-embedding-size", type=int, default=256, help="sinusoidal width (default: 256)")
    p.add_argument("--max-period", type=float, default=10000.0, help="sinusoid max period (default: 10000)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="dtype of the saved weights (default: float32 from --checkpoint, the repo's own with --hub_repo)",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="torch.load with weights_only=False (only for trusted .pt files holding other objects)",
    )
    return p


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    _check_output(parser, args.output)
    if args.hub_repo is not None:
        try:
            convert_hub_repo(args.hub_repo, args.output, revision=args.revision, dtype=args.dtype)
        except (ValueError, StrictDataclassError, OSError) as error:  # the Hub's not-found / offline errors: OSErrors
            parser.exit(2, f"{parser.prog}: error: {' '.join(str(error).split())}\n")
        print(f"saved LoopFormerForCausalLM to {args.output}", file=sys.stderr)
        return 0
    missing = [
        flag
        for flag, value in (("--n-layer", args.n_layer), ("--n-embd", args.n_embd), ("--n-head", args.n_head))
        if value is None
    ]
    if missing:
        parser.error(f"--checkpoint needs the shape flags {', '.join(missing)}")
    try:
        convert(
            args.checkpoint,
            args.output,
            n_layer=args.n_layer,
            n_loops=args.n_loops,
            n_embd=args.n_embd,
            n_head=args.n_head,
            vocab_size=args.vocab_size,
            block_size=args.block_size,
            mlp_hidden=args.mlp_hidden,
            model_type=args.model_type,
            frequency_embedding_size=args.frequency_embedding_size,
            max_period=args.max_period,
            dtype=args.dtype or "float32",
            allow_pickle=args.allow_pickle,
        )
    except (ValueError, StrictDataclassError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(error).split())}\n")
    print(f"saved LoopFormerForCausalLM to {args.output}", file=sys.stderr)
    return 0


def _check_output(parser, output):
    """Before any conversion: the output folder must be creatable (not a file, nor under one) and writable."""
    if os.path.exists(output) and not os.path.isdir(output):
        parser.exit(2, f"{parser.prog}: error: --output {output!r} exists and is not a folder.\n")
    try:
        os.makedirs(output, exist_ok=True)
        if not os.access(output, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
            raise PermissionError(13, "Permission denied")
    except OSError as error:
        parser.exit(
            2,
            f"{parser.prog}: error: --output {output!r} cannot be written ({error.strerror}); give a folder you can write.\n",
        )


if __name__ == "__main__":
    sys.exit(main())
