"""The authors' weight names onto this package's: the one table that `from_pretrained` (a state dict handed to
transformers' own), vLLM's loader and the converter's `.pt` path all map with.

Their `GPT`'s state dict, stored under a wrapper prefix (`gpt.`, `model.`, `module.`, which their loader strips),
holds `transformer.{wte,wpe,norm_f}`, the blocks under `transformer.h.blocks.{j}` (Base: `transformer.h.{j}`) with
a fused `attn.c_attn`, and the loop conditioning's `time_embedder` / `dt_embedder`; the tied head is stored once.
"""

import re

WRAPPER_PREFIXES = ("gpt.", "model.", "module.")  # their loader's `_strip_prefixes`
# their GPT's modules; `lm_head.` is both theirs and ours, so it decides nothing
REFERENCE_WEIGHT_ROOTS = ("transformer.", "time_embedder.", "dt_embedder.")

# (their name, ours) after the wrapper prefix, applied in order; the fused c_attn is split by `map_names`
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


def strip_wrapper_prefixes(state_dict):
    """Their loader's `_strip_prefixes`: `gpt.`, `model.` and `module.` removed, repeatedly, from every key."""
    out = {}
    for key, tensor in state_dict.items():
        name = key
        while name.startswith(WRAPPER_PREFIXES):
            name = name[len(next(p for p in WRAPPER_PREFIXES if name.startswith(p))) :]
        if name in out:
            raise ValueError(
                f"two tensors of the checkpoint map to {name!r} once the wrapper prefixes "
                f"{WRAPPER_PREFIXES} are removed (one of them is {key!r})."
            )
        out[name] = tensor
    return out


def wrapper_prefix(names):
    """The wrapper prefix their weights are stored under (`gpt.`, `gpt.model.`, …; '' for none), checked to be one."""
    prefixes = set()
    for name in names:
        stripped = next(iter(strip_wrapper_prefixes({name: None})))
        prefixes.add(name[: len(name) - len(stripped)])
    if len(prefixes) > 1:
        raise ValueError(
            f"the weights are stored under several wrapper prefixes {sorted(prefixes)}; their loader "
            "strips them, but one checkpoint is written under one."
        )
    return prefixes.pop() if prefixes else ""


def is_reference_weight_name(name):
    """True for a tensor name of their `GPT` (after the wrapper prefixes), never for one of ours (`model.…`)."""
    return next(iter(strip_wrapper_prefixes({name: None}))).startswith(REFERENCE_WEIGHT_ROOTS)


def renames_for(prefix, names):
    """`RENAMES` for one checkpoint: its wrapper prefix removed first; a head stored only as `lm_head.weight` (their
    loader's `_fix_tied` accepts it) becomes the embedding it is tied to."""
    renames = ([(f"^{re.escape(prefix)}", "")] if prefix else []) + list(RENAMES)
    if "lm_head.weight" in names and "transformer.wte.weight" not in names:
        renames.append((r"^lm_head\.weight$", "model.embed_tokens.weight"))
    return renames


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
    renames = renames_for(prefix, set(strip_wrapper_prefixes(dict.fromkeys(state_dict))))
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
