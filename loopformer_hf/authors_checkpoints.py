"""The authors' published checkpoints (armenjeddi/LoopFormer-*, Base-Loop-*) loaded into this package's classes.

What is known of the published files (public traces of armenjeddi/LoopFormer-3block-8iterations at 2b4fbaa; the Hub
cannot be reached from where this was written): config.json of 296 bytes with `architectures`
["LoopFormerGPTForCausalLM"], `auto_map` (their custom code), `dtype`, `model_type` ("loopformer"; the Base-Loop repos
"base_loop" and "base_loop_ee") and `transformers_version`, and no sizes: those come from the defaults of the
configuration class in the repo's own code. model.safetensors holds 29 bf16 tensors named as their GitHub `GPT`'s
state dict under a `gpt.` prefix, the tied head stored once as `transformer.wte.weight`; GPT-2's tokenizer files.
What is inferred: which keys the 1- and 2-block repos state (most likely `n_layer`, perhaps `steps`).

So a value is taken, in order, from what the files determine (`resolve_config`):

1. the weights: vocabulary, width, block count, FFN width, context, biases, the model family and the sinusoid
   width, read from the safetensors header (or its shard index), never by reading the tensors;
2. config.json, where it states a value (nanoGPT keys or the GPT-2 aliases their loader accepts);
3. the defaults of the configuration class named in `auto_map`, its source read as text and parsed, never executed;
4. the repo's name ("…-2block-12iterations") for the loop count only;
5. their GitHub `GPTConfig` defaults (32 heads, `steps=[1/8]*8`).

A value a later source states that the weights contradict is a `ValueError` naming both; the attention-head count and
the trajectory, which no tensor shape gives, are recorded in `config.authors_config_sources` and logged once.

The weights are then read by transformers' own `from_pretrained` (sharding, dtype, `device_map`, quantisation, the
missing/unexpected-key report) through a checkpoint conversion mapping (`WeightRenaming`, and a `WeightConverter`
with `Chunk` for the fused `c_attn`), registered for the class `LoopFormerGPTForCausalLM` that exists only while
loading: the loaded model is a `LoopFormerForCausalLM`, so `save_pretrained` writes this package's layout. A key
left unmapped or a parameter left unfilled is refused, never initialised at random.
"""

import ast
import json
import math
import os
import re

import torch
from transformers.utils import cached_file, logging

from .configuration_loopformer import HUB_OPTIONS as HUB_KWARGS

logger = logging.get_logger(__name__)

# the reference's model_type -> (loop_conditioning, weighted block norms, blocks in a plain list); the early-exit
# variants (the Hub's Base-Loop-EE) are trained differently but hold the weights of their looped model
MODEL_TYPES = {
    "loopformer": ("shortcut", False, False),
    "tmlt": ("timestep", False, False),
    "tmlt_ee": ("timestep", False, False),
    "base_loop": ("none", True, False),
    "base_loop_ee": ("none", True, False),
    "base": ("none", True, True),
}
# the class name their config.json's `architectures` gives (their remote code's causal LM)
ARCHITECTURE = "LoopFormerGPTForCausalLM"
# Fields only this package's configs carry: a config.json with any of them is ours, not the authors'.
OWN_CONFIG_KEYS = ("num_loops", "loop_conditioning")
# nanoGPT name -> the names their loader also accepts, in its order of preference (`_get` in GPT.from_pretrained).
REFERENCE_CONFIG_KEYS = {
    "block_size": ("block_size", "n_positions", "max_position_embeddings"),
    "vocab_size": ("vocab_size",),
    "n_layer": ("n_layer", "num_hidden_layers"),
    "n_head": ("n_head", "num_attention_heads"),
    "n_embd": ("n_embd", "hidden_size"),
    "dropout": ("dropout", "resid_pdrop"),
    "bias": ("bias",),
    "intermediate_dim": ("intermediate_dim", "n_inner"),
    "steps": ("steps",),
}
# their GitHub GPTConfig (models/{loopformer,tmlt,base_loop,base}.py) and their forward's default `steps`
GITHUB_DEFAULTS = dict(block_size=1024, vocab_size=50304, n_layer=3, n_head=32, n_embd=2048, dropout=0.0, bias=False,
                       intermediate_dim=5120)
GITHUB_N_LAYER = {"base": 24}  # models/base.py's GPTConfig: 24 blocks in one pass
GITHUB_STEPS = {"loopformer": [1 / 8] * 8}  # list of Δ for LoopFormer; the others take an integer count
GITHUB_STEP_COUNT = 8
GITHUB = "their GitHub GPTConfig's default"
WRAPPER_PREFIXES = ("gpt.", "model.", "module.")  # their loader's `_strip_prefixes`
# their GPT's modules; `lm_head.` is both theirs and ours, so it decides nothing
REFERENCE_WEIGHT_ROOTS = ("transformer.", "time_embedder.", "dt_embedder.")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
REPO_NAME = re.compile(r"(\d+)\s*blocks?-(\d+)\s*iterations?", re.IGNORECASE)
SUM_TOLERANCE = 1e-6


def is_reference_config(config_dict):
    """True for a config.json in the authors' layout: one of their model types and none of our own fields."""
    return config_dict.get("model_type") in MODEL_TYPES and not any(key in config_dict for key in OWN_CONFIG_KEYS)


# ---- what the files say ----------------------------------------------------------------------------------------------


def _stated(values, name):
    """The value a dict of their keys states for the nanoGPT field `name` (its aliases included), or None."""
    for key in REFERENCE_CONFIG_KEYS[name]:
        if values.get(key) is not None:
            return values[key]
    return None


def strip_wrapper_prefixes(state_dict):
    """Their loader's `_strip_prefixes`: `gpt.`, `model.` and `module.` removed, repeatedly, from every key."""
    out = {}
    for key, tensor in state_dict.items():
        name = key
        while name.startswith(WRAPPER_PREFIXES):
            name = name[len(next(p for p in WRAPPER_PREFIXES if name.startswith(p))):]
        if name in out:
            raise ValueError(f"two tensors of the checkpoint map to {name!r} once the wrapper prefixes "
                             f"{WRAPPER_PREFIXES} are removed (one of them is {key!r}).")
        out[name] = tensor
    return out


def weight_family(names):
    """The reference model type whose modules the weight names hold, or None when they hold none of theirs."""
    if any(name.startswith("dt_embedder.") for name in names):
        return "loopformer"
    if any(name.startswith("time_embedder.") for name in names):
        return "tmlt"
    if any(name.startswith("transformer.h.blocks.") for name in names):
        return "base_loop"
    if any(re.match(r"transformer\.h\.\d+\.", name) for name in names):
        return "base"
    return None


def weight_values(shapes):
    """{nanoGPT field: (value, what in the weights shows it)} of the fields tensor shapes determine; `shapes` maps
    the prefix-stripped names to shapes."""
    found = {}

    def shown_by(name, dim, field):
        if name in shapes:
            found[field] = (shapes[name][dim], f"{name} has shape {tuple(shapes[name])}")

    embedding = "transformer.wte.weight" if "transformer.wte.weight" in shapes else "lm_head.weight"
    shown_by(embedding, 0, "vocab_size")
    shown_by(embedding, 1, "n_embd")
    shown_by("transformer.wpe.weight", 0, "block_size")
    blocks = sorted({int(m.group(2)) for name in shapes if (m := re.match(r"(transformer\.h\.(?:blocks\.)?)(\d+)\.",
                                                                           name))})
    if blocks:
        block = next(m.group(1) for name in shapes if (m := re.match(r"(transformer\.h\.(?:blocks\.)?)\d+\.", name)))
        found["n_layer"] = (len(blocks), f"they hold {block}{{{', '.join(map(str, blocks))}}}")
        shown_by(f"{block}{blocks[0]}.mlp.c_fc.weight", 0, "intermediate_dim")
        bias = f"{block}{blocks[0]}.attn.c_attn.bias"
        found["bias"] = (bias in shapes, f"{bias} is {'present' if bias in shapes else 'absent'}")
    for embedder in ("time_embedder", "dt_embedder"):
        shown_by(f"{embedder}.mlp.0.weight", 1, "frequency_embedding_size")
    return found


_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: a / b}


def _constant(node):
    """The value of a constant expression in parsed source (literals, lists, + - * / of them), or raise ValueError:
    defaults such as `steps=[1/8]*8` are read without executing anything."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_constant(item) for item in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _constant(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _constant(node.left), _constant(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int) and right <= 4096:
            return left * right  # `[1/8]*8`; a list too long for a trajectory is not read
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            return _OPERATORS[type(node.op)](left, right)
    raise ValueError("not a constant")


def source_defaults(text, class_name):
    """{name: default} of the configuration class `class_name` in Python source `text`: its `__init__` keyword
    defaults and class-level assignments, its bases in the same file first. Parsed with `ast`, never executed."""
    classes = {node.name: node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ClassDef)}

    def defaults_of(name, seen):
        node = classes.get(name)
        if node is None or name in seen:
            return {}
        found = {}
        for base in node.bases:
            if isinstance(base, ast.Name):
                found.update(defaults_of(base.id, seen | {name}))
        for statement in node.body:
            pairs = []
            if isinstance(statement, ast.Assign):
                pairs = [(t.id, statement.value) for t in statement.targets if isinstance(t, ast.Name)]
            elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
                pairs = [(statement.target.id, statement.value)]
            elif isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
                args = statement.args
                positional = args.posonlyargs + args.args
                pairs = list(zip([a.arg for a in positional[len(positional) - len(args.defaults):]], args.defaults))
                pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for key, value in pairs:
                try:
                    found[key] = _constant(value)
                except ValueError:
                    found.pop(key, None)  # a default computed at run time states nothing we can read
        return found

    return defaults_of(class_name, frozenset())


def _trajectory(steps, model_type, source):
    """(L, default step schedule) from their `steps`: a list of step sizes, or a loop count. LoopFormer's step sizes
    must sum to 1 (their forward would end below t = 1, a trajectory it never trained): refused, never renormalised."""
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
        return steps, "uniform"
    if isinstance(steps, (list, tuple)) and steps and all(
            isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 for s in steps):
        if model_type != "loopformer":  # TMLT and Base-Loop count their steps; their sizes change nothing
            if len({round(float(s), 9) for s in steps}) > 1:
                raise ValueError(f"`steps`={steps!r} ({source}): a {model_type!r} model only counts its loop steps; "
                                 "unequal step sizes need model_type 'loopformer'.")
            return len(steps), "uniform"
        total = math.fsum(steps)
        if abs(total - 1.0) > SUM_TOLERANCE:
            raise ValueError(
                f"`steps`={list(steps)!r} ({source}) sum to {total!r}, not 1: LoopFormer's time t runs from 0 to 1, "
                f"and this trajectory would stop at t={total!r}. Nothing was loaded; give step sizes summing to 1 "
                f"(e.g. [{1 / len(steps)!r}] * {len(steps)})."
            )
        if len({round(float(s), 9) for s in steps}) == 1:
            return len(steps), "uniform"
        return len(steps), [float(s) for s in steps]
    raise ValueError(f"`steps` ({source}) must be a loop count >= 1 or a list of positive step sizes summing to 1, "
                     f"got {steps!r}.")


def resolve_config(config_dict, shapes=None, code_defaults=None, code_source=None, name_or_path=None):
    """`LoopFormerConfig` keyword arguments for a config.json in the authors' layout (`is_reference_config`), every
    value from the first source that determines it (the module docstring's order). `shapes`: the weights' prefix-
    stripped name -> shape (None: not read yet); `code_defaults`: the defaults of their configuration class, read
    from `code_source`."""
    model_type = config_dict["model_type"]
    from_weights = weight_values(shapes or {})
    family = weight_family(shapes or {})
    if family is not None and MODEL_TYPES[family] != MODEL_TYPES[model_type]:
        raise ValueError(f"config.json says model_type {model_type!r}, but the weights hold a {family!r} model "
                         f"({sorted(shapes)[:4]}, …).")
    stated = [("config.json", config_dict)] + ([(code_source, code_defaults)] if code_defaults else [])
    values, sources = {}, {}
    for name in REFERENCE_CONFIG_KEYS:
        values[name], sources[name] = _value(name, from_weights, stated, model_type, name_or_path)
    loop_conditioning, block_norm_weight, plain_list = MODEL_TYPES[model_type]
    if plain_list:
        num_loops, schedule = 1, "uniform"
    else:
        num_loops, schedule = _trajectory(values["steps"], model_type, sources["steps"])
    n_embd, n_head = int(values["n_embd"]), int(values["n_head"])
    if n_embd % n_head:
        raise ValueError(f"{n_head} attention heads ({sources['n_head']}) do not divide the width {n_embd} "
                         f"({sources['n_embd']}).")
    dtype = config_dict.get("dtype") or config_dict.get("torch_dtype")  # transformers >= 4.56 writes `dtype`
    return dict(
        vocab_size=int(values["vocab_size"]),
        hidden_size=n_embd,
        num_attention_heads=n_head,
        intermediate_size=int(values["intermediate_dim"]),
        num_hidden_layers=int(values["n_layer"]),
        num_loops=num_loops,
        default_step_schedule=schedule,
        loop_conditioning=loop_conditioning,
        block_norm_weight=block_norm_weight,
        hidden_act="gelu",
        position_embedding_type="learned",
        max_position_embeddings=int(values["block_size"]),
        tie_word_embeddings=True,
        rms_norm_eps=None,  # torch's default, as their nn.RMSNorm
        attention_bias=bool(values["bias"]),
        mlp_bias=bool(values["bias"]),
        attention_dropout=float(values["dropout"]),
        frequency_embedding_size=int(from_weights.get("frequency_embedding_size", (256, None))[0]),
        architectures=["LoopFormerForCausalLM"],  # the class that now holds the weights (vLLM resolves by it)
        authors_config_sources={"num_attention_heads": sources["n_head"],
                                "trajectory": f"model_type {model_type!r} (one pass)" if plain_list else sources["steps"]},
        **({"dtype": dtype} if dtype else {}),
        bos_token_id=config_dict.get("bos_token_id"),
        eos_token_id=config_dict.get("eos_token_id"),
        pad_token_id=config_dict.get("pad_token_id"),
    )


def _value(name, from_weights, stated, model_type, name_or_path):
    """(value, source) of the nanoGPT field `name`: the weights', checked against the first stated one (config.json
    overrides its class's defaults); else the first stated; else the repo's name (loop count) or their defaults."""
    claims = [(source, value) for source, d in stated if (value := _stated(d, name)) is not None]
    if name in from_weights:
        value, evidence = from_weights[name]
        for source, claimed in claims[:1]:
            if claimed != value and not (name == "bias" and bool(claimed) == value):
                raise ValueError(f"`{name}`: {source} says {claimed!r}, but the weights say {value!r} "
                                 f"({evidence}). Nothing was loaded.")
        return value, f"the weights ({evidence})"
    if claims:
        return claims[0][1], claims[0][0]
    if name == "steps":
        return _steps_default(model_type, name_or_path)
    if name == "n_layer":
        return GITHUB_N_LAYER.get(model_type, GITHUB_DEFAULTS[name]), GITHUB
    return GITHUB_DEFAULTS[name], GITHUB


def _steps_default(model_type, name_or_path):
    """Their trajectory when neither config.json nor their code states one: the repo's name (…-12iterations), else
    their forward's default."""
    match = REPO_NAME.search(os.fspath(name_or_path or ""))
    if match:
        count = int(match.group(2))
        return ([1 / count] * count if model_type == "loopformer" else count), f"the repo's name ({match.group(0)})"
    return GITHUB_STEPS.get(model_type, GITHUB_STEP_COUNT), "their forward's default (steps=[1/8]*8 or 8)"


def _public(config_dict):
    """config.json's keys without those transformers adds on reading (`_commit_hash` before 5.24)."""
    return None if config_dict is None else {k: v for k, v in config_dict.items() if not k.startswith("_")}


def derive_config(config_dict, name_or_path=None, hub_kwargs=None, shapes=None):
    """`LoopFormerConfig` keyword arguments of a config.json in the authors' layout: the one derivation that
    `AutoConfig` (through `LoopFormerConfig.from_dict`) and `from_pretrained` both use, so PEFT, vLLM, pipelines and
    `finetune_lora` see the model that loads. The weights' header and the repo's code are read from `name_or_path`
    when its config.json is `config_dict`; config.json alone otherwise (a bare dict, or AutoConfig given a
    `subfolder`, whose Hub options transformers does not pass on). Logs where the head count and trajectory came
    from, and warns where they were assumed."""
    hub_kwargs = dict(hub_kwargs or {})
    code_defaults = code_source = None
    if name_or_path is not None:
        local = os.path.isdir(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else False
        try:
            if shapes is None and _public(read_config_dict(name_or_path, hub_kwargs)) != _public(config_dict):
                raise OSError("its config.json at the default revision and folder is another one")
            if shapes is None:
                shapes = read_weight_shapes(name_or_path, hub_kwargs)
            code_defaults, code_source = read_code_defaults(name_or_path, config_dict, hub_kwargs)
        except OSError as error:
            if local and read_config_dict(name_or_path, hub_kwargs) == config_dict:
                raise  # a truncated or missing weights file, named
            logger.warning_once(f"{os.fspath(name_or_path)}: the sizes come from config.json alone, the repo's "
                                f"weights were not read ({error}); from_pretrained reads them.")
            shapes = None
    kwargs = resolve_config(config_dict, strip_wrapper_prefixes(shapes) if shapes else None, code_defaults,
                            code_source, name_or_path=name_or_path)
    _report_sources(name_or_path, kwargs)
    return kwargs


def _report_sources(name_or_path, kwargs):
    """One info line on where the head count and trajectory came from; a warning where one was assumed (no file
    states it) or where the repo's name says another loop count than the one taken."""
    where = os.fspath(name_or_path) if name_or_path is not None else "config.json"
    heads, loops = kwargs["num_attention_heads"], kwargs["num_loops"]
    sources = kwargs["authors_config_sources"]
    logger.info_once(f"{where}: {heads} attention heads from {sources['num_attention_heads']}; trajectory "
                     f"(L={loops}, {kwargs['default_step_schedule']}) from {sources['trajectory']}.")
    if sources["num_attention_heads"] == GITHUB:
        logger.warning_once(
            f"{where}: no attention-head count in config.json (n_head) or the repo's code; assumed {heads}, "
            f"{GITHUB}. No tensor shape gives it: if the model was trained with another, pass "
            f"num_attention_heads=N to from_pretrained.")
    named = REPO_NAME.search(os.fspath(name_or_path or ""))
    if sources["trajectory"].startswith("their forward's default"):
        logger.warning_once(f"{where}: no loop count in config.json (steps), the repo's code or its name; assumed "
                            f"L={loops}, {sources['trajectory']}. Pass num_loops=L to from_pretrained if it differs.")
    elif named and int(named.group(2)) != loops and not sources["trajectory"].startswith("config.json"):
        logger.warning_once(f"{where}: L={loops} loop steps from {sources['trajectory']}, while the repo's name says "
                            f"{named.group(0)}; pass num_loops={named.group(2)} to from_pretrained if the name is "
                            f"right.")


def translate_config(config_dict, name_or_path=None, hub_kwargs=None):
    """`derive_config` for a config.json in the authors' layout (`is_reference_config`), else None: the translator
    `LoopFormerConfig.from_dict` calls."""
    return derive_config(config_dict, name_or_path, hub_kwargs) if is_reference_config(config_dict) else None


# ---- reading the repo ----------------------------------------------------------------------------------------------


def _resolve(path, filename, hub_kwargs):
    return cached_file(path, filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)


def read_config_dict(path, hub_kwargs):
    """config.json of a folder or Hub repo as a dict, or None when there is none."""
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        return None  # a single file is not a repo
    resolved = _resolve(path, "config.json", hub_kwargs)
    if resolved is None:
        return None
    with open(resolved, encoding="utf-8") as handle:
        return json.load(handle)


def read_weight_shapes(path, hub_kwargs):
    """{tensor name: shape} of a repo's weights, from the safetensors header (of each shard named by the index) or
    a memory-mapped pytorch_model.bin: no tensor is read. A truncated or missing file is an OSError naming it."""
    from safetensors import SafetensorError, safe_open

    def header(file):
        try:
            with safe_open(file, "pt") as handle:
                return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        except (SafetensorError, OSError) as error:
            raise OSError(f"{file!r} is not a whole safetensors file ({error}): it may be truncated or still "
                          "downloading. Nothing was loaded; download it again.") from None

    for filename in WEIGHT_FILES:
        resolved = _resolve(path, filename, hub_kwargs)
        if resolved is None:
            continue
        if filename.endswith(".index.json"):
            with open(resolved, encoding="utf-8") as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
            shapes = {}
            for shard in shards:
                file = _resolve(path, shard, hub_kwargs)
                if file is None:
                    raise OSError(f"{os.fspath(path)!r}: {filename} names the shard {shard!r}, which the repo does "
                                  "not hold. Nothing was loaded; download the repo again.")
                shapes.update(header(file))
            return shapes
        if filename.endswith(".safetensors"):
            return header(resolved)
        try:
            state_dict = torch.load(resolved, map_location="meta", weights_only=True, mmap=True)
        except Exception as error:  # torch raises RuntimeError / UnpicklingError for a damaged file
            raise OSError(f"{resolved!r} could not be read ({error}). Nothing was loaded.") from None
        return {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
    raise OSError(f"{os.fspath(path)!r} holds none of {WEIGHT_FILES}: there are no weights to load.")


def read_code_defaults(path, config_dict, hub_kwargs):
    """(defaults, source name) of the configuration class `auto_map` names in the repo's own code, or (None, None)."""
    reference = (config_dict.get("auto_map") or {}).get("AutoConfig")
    if not isinstance(reference, str) or "--" in reference or "." not in reference:
        return None, None  # no code, or code in another repo
    module, class_name = reference.rsplit(".", 1)
    filename = module.replace(".", "/") + ".py"
    resolved = _resolve(path, filename, hub_kwargs)
    if resolved is None:
        return None, None
    with open(resolved, encoding="utf-8") as handle:
        text = handle.read()
    try:
        defaults = source_defaults(text, class_name)
    except SyntaxError as error:
        raise ValueError(f"{filename} (named by config.json's auto_map) is not valid Python: {error}.") from None
    return defaults, f"{filename}'s {class_name} default"


def wrapper_prefix(names):
    """The wrapper prefix their weights are stored under (`gpt.`, `gpt.model.`, …; '' for none), checked to be one."""
    prefixes = set()
    for name in names:
        stripped = next(iter(strip_wrapper_prefixes({name: None})))
        prefixes.add(name[:len(name) - len(stripped)])
    if len(prefixes) > 1:
        raise ValueError(f"the weights are stored under several wrapper prefixes {sorted(prefixes)}; their loader "
                         "strips them, but one checkpoint is written under one.")
    return prefixes.pop() if prefixes else ""


def is_reference_weight_name(name):
    """True for a tensor name of their `GPT` (after the wrapper prefixes), never for one of ours (`model.…`)."""
    return next(iter(strip_wrapper_prefixes({name: None}))).startswith(REFERENCE_WEIGHT_ROOTS)


# ---- their names onto ours -----------------------------------------------------------------------------------------


# (their name, ours) after the wrapper prefix, applied in order; the fused c_attn is split by `weight_conversions`
RENAMES = (
    (r"^transformer\.wte\.", "model.embed_tokens."),
    (r"^transformer\.wpe\.", "model.embed_positions."),
    (r"^transformer\.norm_f\.", "model.norm."),
    (r"^transformer\.h\.blocks\.", "model.layers."),
    (r"^transformer\.h\.", "model.layers."),  # Base keeps its blocks in a plain list
    (r"\.attn\.c_proj\.", ".self_attn.o_proj."),
    (r"\.mlp\.c_fc\.", ".mlp.up_proj."),
    (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    (r"\.norm_1\.", ".input_layernorm."),
    (r"\.norm_2\.", ".post_attention_layernorm."),
    (r"^time_embedder\.", "model.loop_conditioning.time_embedder."),
    (r"^dt_embedder\.", "model.loop_conditioning.dt_embedder."),
)
FUSED_QKV = ("attn.c_attn.", ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj."))


def _renames(prefix, names):
    """`RENAMES` for one checkpoint: its wrapper prefix removed first; a head stored only as `lm_head.weight` (their
    loader's `_fix_tied` accepts it) becomes the embedding it is tied to."""
    renames = ([(f"^{re.escape(prefix)}", "")] if prefix else []) + list(RENAMES)
    if "lm_head.weight" in names and "transformer.wte.weight" not in names:
        renames.append((r"^lm_head\.weight$", "model.embed_tokens.weight"))
    return renames


def weight_conversions(renames):
    """transformers' conversion mapping from their names to ours: `renames` (`_renames`), then the fused c_attn
    split in three."""
    from transformers.core_model_loading import Chunk, WeightConverter, WeightRenaming

    fused, parts = FUSED_QKV
    return [WeightRenaming(source, target) for source, target in renames] + [
        WeightConverter(fused + kind, [part + kind for part in parts], operations=[Chunk(dim=0)])
        for kind in ("weight", "bias")
    ]


def our_name(key, renames):
    """The name `key` (as stored) takes in this package's model: `renames` in order, then the fused q/k/v split (its
    first part)."""
    for source, target in renames:
        key = re.sub(source, target, key, count=1)
    return key.replace(FUSED_QKV[0], FUSED_QKV[1][0])


def map_names(state_dict):
    """(their name, ours, tensor) for every tensor of their state dict (wrapper prefix allowed), by the same table
    transformers loads with: the fused c_attn yields three rows. For the readers that hold tensors themselves
    (vLLM's loader, the converter's `.pt` path)."""
    prefix = wrapper_prefix(state_dict)
    renames = _renames(prefix, set(strip_wrapper_prefixes(dict.fromkeys(state_dict))))
    parts = FUSED_QKV[1]
    for key, tensor in state_dict.items():
        name = our_name(key, renames)
        if parts[0] in name:
            yield from ((key, name.replace(parts[0], part), chunk) for part, chunk in zip(parts, tensor.chunk(3)))
        else:
            yield key, name, tensor


def mapped_reference_state_dict(state_dict):
    """Their state dict under our names (`map_names`); the tied `lm_head.weight` is dropped (the embedding holds it)."""
    return {name: tensor for _, name, tensor in map_names(state_dict) if name != "lm_head.weight"}


def _check_tied_head(path, prefix, names, hub_kwargs):
    """Both `lm_head.weight` and `transformer.wte.weight` stored: their model ties them, so they must be equal."""
    if not {"lm_head.weight", "transformer.wte.weight"} <= names:
        return
    from safetensors import safe_open

    resolved = _resolve(path, "model.safetensors", hub_kwargs)
    if resolved is None:
        return  # sharded or pickled: transformers loads both into the one tied parameter
    with safe_open(resolved, "pt") as handle:
        head, wte = handle.get_tensor(prefix + "lm_head.weight"), handle.get_tensor(prefix + "transformer.wte.weight")
    if head.shape != wte.shape or not torch.equal(head, wte):
        raise ValueError(f"{resolved!r}: lm_head.weight differs from transformer.wte.weight; their model ties them "
                         "(one tensor), so this checkpoint is not one of theirs.")


# ---- from_pretrained -----------------------------------------------------------------------------------------------


def _refuse_reference_weights_under_our_config(path, hub_kwargs):
    """Our config.json over weights named as theirs would load as a randomly initialised model (transformers only
    warns about missing keys): refuse it, reading only the weight names."""
    try:
        names = read_weight_shapes(path, hub_kwargs)
    except OSError:
        return  # from_pretrained's own load names the file
    theirs = sorted(name for name in names if is_reference_weight_name(name))
    if theirs:
        raise ValueError(
            f"{os.fspath(path)!r}: config.json is in this package's layout (it has {' / '.join(OWN_CONFIG_KEYS)}), "
            f"but the weights are named as the authors' GPT ({theirs[:3]}, …): the config was replaced or edited. "
            f"Use their config.json (it is translated), or convert with `python -m loopformer_hf.convert_reference`."
        )


def _loading_class(cls):
    """A subclass named as their architecture, for which the conversion mapping is registered: transformers looks
    mappings up by class name, and the loaded model is switched back to `cls`, so saving keeps our layout."""
    return type(ARCHITECTURE, (cls,), {"__module__": cls.__module__})


def _config_for(path, config_dict, hub_kwargs, shapes, kwargs):
    """The config to load with: the one the files determine (`derive_config`), with the caller's overrides: those
    AutoConfig set on the config it derived the same way (with transformers' default Hub options), or config fields
    among `kwargs` (popped); a config of the caller's own, as is."""
    from .configuration_loopformer import LoopFormerConfig

    given = kwargs.pop("config", None)
    config = LoopFormerConfig(**derive_config(config_dict, path, hub_kwargs, shapes))
    if isinstance(given, LoopFormerConfig) and getattr(given, "authors_config_sources", None) is not None:
        auto = config if not hub_kwargs else LoopFormerConfig(**derive_config(config_dict, path))
        derived = auto.to_dict()
        for key, value in given.to_dict().items():
            if derived.get(key) != value and key not in ("_name_or_path", "transformers_version"):
                setattr(config, key, value)
    elif given is not None:
        config = given
    fields = config.to_dict()
    for key in [key for key in kwargs if key in fields and key not in ("dtype", "torch_dtype")]:
        setattr(config, key, kwargs.pop(key))  # validated on assignment
    return config


def _refuse_incomplete(path, config, config_dict, info, stored):
    """transformers' loading report of their repo: a key no mapping knows (named as stored), a parameter nothing
    fills or a shape that differs is a ValueError, where transformers would initialise at random and log."""
    missing = sorted(set(info["missing_keys"]) - {"lm_head.weight"})  # the tie restores the head
    unexpected = sorted(stored.get(key, key) for key in info["unexpected_keys"])
    mismatched = sorted(map(str, info["mismatched_keys"]))
    if missing or unexpected or mismatched:
        raise ValueError(
            f"{os.fspath(path)!r} in the authors' layout does not fill a {config.num_hidden_layers}-block "
            f"{config_dict['model_type']!r} model: "
            + "; ".join(f"{what}: {keys}" for what, keys in (("unknown keys (no mapping knows them)", unexpected),
                                                             ("missing keys (parameters nothing fills)", missing),
                                                             ("shapes that differ", mismatched)) if keys)
            + ". Nothing was initialised at random."
        )


def _refuse_wrong_shapes(path, config, causal_lm, shapes, renames):
    """A stored tensor whose shape the derived model does not have is a ValueError naming it and both shapes, from
    the header, before transformers loads anything (it printed a loading report that reads as success, then raised
    its own RuntimeError). The fused c_attn is compared with q, k and v stacked."""
    with torch.device("meta"):
        expected = {name: tuple(tensor.shape) for name, tensor in causal_lm(config).state_dict().items()}
    fused, parts = FUSED_QKV
    wrong = []
    for key, shape in shapes.items():
        name = our_name(key, renames)
        want = expected.get(name)
        if want is not None and fused in key:
            stacked = [expected.get(name.replace(parts[0], part)) for part in parts]
            want = (sum(s[0] for s in stacked), *want[1:]) if None not in stacked else None
        if want is not None and tuple(shape) != want:
            wrong.append(f"{key} has shape {tuple(shape)}, the model needs {want}")
    if wrong:
        raise ValueError(f"{os.fspath(path)!r}: " + "; ".join(sorted(wrong)) + f" (a {config.num_hidden_layers}-block "
                         f"model of width {config.hidden_size} with {config.num_attention_heads} heads, as the other "
                         f"tensors and config.json say). Nothing was loaded.")


# from_pretrained kwargs that change nothing here (no remote code is run)
_ACCEPTED_NOOPS = ("trust_remote_code", "code_revision", "_from_auto", "adapter_kwargs")


def from_pretrained_reference(cls, path, model_args, kwargs):
    """`cls.from_pretrained(path, ...)` for a repo in the authors' layout, or None when `path` is not one."""
    hub_kwargs = {key: kwargs[key] for key in HUB_KWARGS if kwargs.get(key) is not None}
    config_dict = read_config_dict(path, hub_kwargs)
    if config_dict is None or config_dict.get("model_type") not in MODEL_TYPES:
        return None
    if not is_reference_config(config_dict):
        _refuse_reference_weights_under_our_config(path, hub_kwargs)
        return None
    from .modeling_loopformer import LoopFormerForCausalLM, LoopFormerPreTrainedModel

    if model_args:
        raise ValueError(f"positional model arguments {model_args!r} are not accepted for the authors' layout.")
    kwargs = {key: value for key, value in kwargs.items() if key not in _ACCEPTED_NOOPS}
    shapes = read_weight_shapes(path, hub_kwargs)
    if "model.embed_tokens.weight" in shapes:
        raise ValueError(
            f"{os.fspath(path)!r}: config.json has none of this package's fields ({', '.join(OWN_CONFIG_KEYS)}), as "
            f"the authors' configs, but the weights are in this package's layout (model.embed_tokens.weight, …): the "
            f"config was edited or truncated. Restore it (num_loops is the number of loop steps L it was trained with)."
        )
    config = _config_for(path, config_dict, hub_kwargs, shapes, kwargs)
    names = set(strip_wrapper_prefixes(dict.fromkeys(shapes)))
    prefix = wrapper_prefix(shapes)
    _check_tied_head(path, prefix, names, hub_kwargs)

    from transformers.conversion_mapping import register_checkpoint_conversion_mapping

    causal_lm = cls if issubclass(cls, LoopFormerForCausalLM) else LoopFormerForCausalLM
    loading = _loading_class(causal_lm)
    renames = _renames(prefix, names)
    _refuse_wrong_shapes(path, config, causal_lm, shapes, renames)
    register_checkpoint_conversion_mapping(ARCHITECTURE, weight_conversions(renames), overwrite=True)
    output_loading_info = kwargs.pop("output_loading_info", False)
    try:  # transformers' own loading, past our from_pretrained (which routed here)
        model, info = super(LoopFormerPreTrainedModel, loading).from_pretrained(path, config=config,
                                                                                output_loading_info=True, **kwargs)
    except TypeError as error:  # an option transformers passed on to the model's constructor
        unknown = re.findall(r"unexpected keyword argument '(\w+)'", str(error))
        if not unknown:
            raise
        raise ValueError(f"from_pretrained got keyword arguments that are neither config fields nor loading options: "
                         f"{unknown}.") from None
    model.__class__ = causal_lm
    model._weight_conversions = None  # save_pretrained: no reverse mapping, this package's layout
    _refuse_incomplete(path, config, config_dict, info, {our_name(name, renames): name for name in shapes})
    if model.generation_config.do_sample is None:  # theirs sets nothing: greedy, as our generate documents
        model.generation_config.do_sample = False
    if causal_lm is not cls:  # LoopFormerModel (AutoModel): the base model of the translated causal LM
        model = model.model
    return (model, info) if output_loading_info else model


__all__ = ["is_reference_config", "translate_config", "derive_config", "resolve_config", "strip_wrapper_prefixes",
           "read_config_dict", "read_weight_shapes", "from_pretrained_reference", "mapped_reference_state_dict"]


def reference_config_classes():
    """One `LoopFormerConfig` subclass per model type of theirs other than "loopformer" (ours), so that
    `AutoConfig` recognises their repos; `from_dict` returns a plain `LoopFormerConfig` for each."""
    from .configuration_loopformer import LoopFormerConfig

    return [type(f"Reference_{name}_Config", (LoopFormerConfig,), {"model_type": name, "__module__": __name__})
            for name in MODEL_TYPES if name != LoopFormerConfig.model_type]
