"""An authors' config.json translated into `LoopFormerConfig` keyword arguments, every value from the first of the
repo's files that determines it (`resolve_config`; docs/loopformer.md has the order and why):

1. the weights: vocabulary, width, block count, FFN width, context, biases, the model family and the sinusoid
   width, read from the safetensors header (or its shard index), never by reading the tensors;
2. config.json, where it states a value (nanoGPT keys or the GPT-2 aliases their loader accepts);
3. the defaults of the configuration class named in `auto_map` (`code_defaults.py`, parsed, never executed);
4. the repo's name ("…-2block-12iterations") for the loop count only;
5. their GitHub `GPTConfig` defaults (32 heads, `steps=[1/8]*8`).

A value a later source states that the weights contradict is a `ValueError` naming both; the attention-head count and
the trajectory, which no tensor shape gives, are recorded in `config.authors_config_sources` and logged once.
Their model types and the config classes `AutoConfig` reads them with are in `auto.py`.
"""

import math
import os
import re

from transformers.utils import logging

from .code_defaults import read_code_defaults
from .files import read_config_dict, read_special_token_ids, read_weight_shapes
from .model_types import MODEL_TYPES
from .weights import strip_wrapper_prefixes

logger = logging.get_logger(__name__)

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
GITHUB_DEFAULTS = dict(
    block_size=1024,
    vocab_size=50304,
    n_layer=3,
    n_head=32,
    n_embd=2048,
    dropout=0.0,
    bias=False,
    intermediate_dim=5120,
)
GITHUB_N_LAYER = {"base": 24}  # models/base.py's GPTConfig: 24 blocks in one pass
GITHUB_STEPS = {"loopformer": [1 / 8] * 8}  # list of Δ for LoopFormer; the others take an integer count
GITHUB_STEP_COUNT = 8
GITHUB = "their GitHub GPTConfig's default"
REPO_NAME = re.compile(r"(\d+)\s*blocks?-(\d+)\s*iterations?", re.IGNORECASE)
SUM_TOLERANCE = 1e-6


# ---- what the files say ----------------------------------------------------------------------------------------------


def _stated(values, name):
    """The value a dict of their keys states for the nanoGPT field `name` (its aliases included), or None."""
    for key in REFERENCE_CONFIG_KEYS[name]:
        if values.get(key) is not None:
            return values[key]
    return None


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
    blocks = sorted(
        {int(m.group(2)) for name in shapes if (m := re.match(r"(transformer\.h\.(?:blocks\.)?)(\d+)\.", name))}
    )
    if blocks:
        block = next(m.group(1) for name in shapes if (m := re.match(r"(transformer\.h\.(?:blocks\.)?)\d+\.", name)))
        found["n_layer"] = (len(blocks), f"they hold {block}{{{', '.join(map(str, blocks))}}}")
        shown_by(f"{block}{blocks[0]}.mlp.c_fc.weight", 0, "intermediate_dim")
        bias = f"{block}{blocks[0]}.attn.c_attn.bias"
        found["bias"] = (bias in shapes, f"{bias} is {'present' if bias in shapes else 'absent'}")
    for embedder in ("time_embedder", "dt_embedder"):
        shown_by(f"{embedder}.mlp.0.weight", 1, "frequency_embedding_size")
    return found


def _trajectory(steps, model_type, source):
    """(L, default step schedule) from their `steps`: a list of step sizes, or a loop count. LoopFormer's step sizes
    must sum to 1 (their forward would end below t = 1, a trajectory it never trained): refused, never renormalised."""
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
        return steps, "uniform"
    if (
        isinstance(steps, (list, tuple))
        and steps
        and all(isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 for s in steps)
    ):
        if model_type != "loopformer":  # TMLT and Base-Loop count their steps; their sizes change nothing
            if len({round(float(s), 9) for s in steps}) > 1:
                raise ValueError(
                    f"`steps`={steps!r} ({source}): a {model_type!r} model only counts its loop steps; "
                    "unequal step sizes need model_type 'loopformer'."
                )
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
    raise ValueError(
        f"`steps` ({source}) must be a loop count >= 1 or a list of positive step sizes summing to 1, got {steps!r}."
    )


def resolve_config(config_dict, shapes=None, code_defaults=None, code_source=None, name_or_path=None):
    """`LoopFormerConfig` keyword arguments for a config.json in the authors' layout (`is_reference_config`), every
    value from the first source that determines it (the module docstring's order). `shapes`: the weights' prefix-
    stripped name -> shape (None: not read yet); `code_defaults`: the defaults of their configuration class, read
    from `code_source`."""
    model_type = config_dict["model_type"]
    from_weights = weight_values(shapes or {})
    family = weight_family(shapes or {})
    if family is not None and MODEL_TYPES[family] != MODEL_TYPES[model_type]:
        raise ValueError(
            f"config.json says model_type {model_type!r}, but the weights hold a {family!r} model "
            f"({sorted(shapes)[:4]}, …)."
        )
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
        raise ValueError(
            f"{n_head} attention heads ({sources['n_head']}) do not divide the width {n_embd} ({sources['n_embd']})."
        )
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
        authors_config_sources={
            "num_attention_heads": sources["n_head"],
            "trajectory": f"model_type {model_type!r} (one pass)" if plain_list else sources["steps"],
        },
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
                raise ValueError(
                    f"`{name}`: {source} says {claimed!r}, but the weights say {value!r} "
                    f"({evidence}). Nothing was loaded."
                )
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
    special = {}
    if name_or_path is not None:
        local = os.path.isdir(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else False
        try:
            if shapes is None and _public(read_config_dict(name_or_path, hub_kwargs)) != _public(config_dict):
                raise OSError("its config.json at the default revision and folder is another one")
            if shapes is None:
                shapes = read_weight_shapes(name_or_path, hub_kwargs)
            code_defaults, code_source = read_code_defaults(name_or_path, config_dict, hub_kwargs)
            # their config.json names no end of text, their tokenizer does: generation stops there, pipelines pad
            special = read_special_token_ids(name_or_path, hub_kwargs)
        except OSError as error:
            if local and read_config_dict(name_or_path, hub_kwargs) == config_dict:
                raise  # a truncated or missing weights file, named
            logger.warning_once(
                f"{os.fspath(name_or_path)}: the sizes come from config.json alone, the repo's "
                f"weights were not read ({error}); from_pretrained reads them."
            )
            shapes = None
    kwargs = resolve_config(
        config_dict,
        strip_wrapper_prefixes(shapes) if shapes else None,
        code_defaults,
        code_source,
        name_or_path=name_or_path,
    )
    for key, value in special.items():
        if kwargs.get(key) is None:
            kwargs[key] = value
    _report_sources(name_or_path, kwargs)
    return kwargs


def _report_sources(name_or_path, kwargs):
    """One info line on where the head count and trajectory came from; a warning where one was assumed (no file
    states it) or where the repo's name says another loop count than the one taken."""
    where = os.fspath(name_or_path) if name_or_path is not None else "config.json"
    heads, loops = kwargs["num_attention_heads"], kwargs["num_loops"]
    sources = kwargs["authors_config_sources"]
    logger.info_once(
        f"{where}: {heads} attention heads from {sources['num_attention_heads']}; trajectory "
        f"(L={loops}, {kwargs['default_step_schedule']}) from {sources['trajectory']}."
    )
    if sources["num_attention_heads"] == GITHUB:
        logger.warning_once(
            f"{where}: no attention-head count in config.json (n_head) or the repo's code; assumed {heads}, "
            f"{GITHUB}. No tensor shape gives it: if the model was trained with another, pass "
            f"num_attention_heads=N to from_pretrained."
        )
    named = REPO_NAME.search(os.fspath(name_or_path or ""))
    if sources["trajectory"].startswith("their forward's default"):
        logger.warning_once(
            f"{where}: no loop count in config.json (steps), the repo's code or its name; assumed "
            f"L={loops}, {sources['trajectory']}. Pass num_loops=L to from_pretrained if it differs."
        )
    elif named and int(named.group(2)) != loops and not sources["trajectory"].startswith("config.json"):
        logger.warning_once(
            f"{where}: L={loops} loop steps from {sources['trajectory']}, while the repo's name says "
            f"{named.group(0)}; pass num_loops={named.group(2)} to from_pretrained if the name is "
            f"right."
        )
