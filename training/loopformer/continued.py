"""Continued training (`train --model_name_or_path`): a run that starts from a checkpoint's weights and tokenizer
(a folder or Hub id of ours, or one of the authors' repos, loaded as `from_pretrained` loads it). The
model's shape comes from the checkpoint; a model flag given on the command line (or in a config file) that says
otherwise is refused by name, since the weights could not follow it."""

import logging

import torch

logger = logging.getLogger(__name__)

# ModelArguments field -> how the checkpoint's config answers it
CONFIG_FIELDS = {
    "hidden_size": lambda c: c.hidden_size,
    "num_attention_heads": lambda c: c.num_attention_heads,
    "intermediate_size": lambda c: c.intermediate_size,
    "position_embedding_type": lambda c: c.position_embedding_type,
    "initializer_scheme": lambda c: c.initializer_scheme,
    "vocab_size": lambda c: c.vocab_size,
    "num_blocks": lambda c: c.num_hidden_layers,  # Base: its k·L blocks, one loop
    "num_loops": lambda c: c.num_loops,
}


def variant_of(config, variants):
    """The variant whose configuration `config` is (loop conditioning, looped, block norm weight); the -EE variants
    share their base's configuration and differ by objective, so the plain one is named."""
    looped = config.num_loops > 1
    for name, (conditioning, is_looped, trajectory, _, norm_weight) in variants.items():
        same = (conditioning, is_looped, norm_weight) == (config.loop_conditioning, looped, config.block_norm_weight)
        if same and trajectory != "early_exit":
            return name
    raise ValueError(
        f"The checkpoint's configuration (loop_conditioning={config.loop_conditioning!r}, num_loops={config.num_loops}, "
        f"block_norm_weight={config.block_norm_weight}) is none of the variants {tuple(variants)}."
    )


def model_args_of(config, model_args, given, variants):
    """`model_args` as the checkpoint's `config` sets them; a field of `given` (the flags the user gave) that differs
    is a ValueError naming it."""
    values = {name: read(config) for name, read in CONFIG_FIELDS.items()}
    looped = config.num_loops > 1
    wanted = variants.get(model_args.variant)
    inferred = variant_of(config, variants)
    if "variant" in given and wanted is not None:
        conditioning, is_looped, _, _, norm_weight = wanted
        if (conditioning, is_looped, norm_weight) != (config.loop_conditioning, looped, config.block_norm_weight):
            raise ValueError(
                f"--variant {model_args.variant} contradicts --model_name_or_path, whose configuration is a "
                f"{inferred} (loop_conditioning={config.loop_conditioning!r}); leave --variant out or give {inferred}"
                f"{' or its -EE objective' if variants[inferred][0] != 'shortcut' else ''}."
            )
    else:
        values["variant"] = inferred
    contradicting = [
        f"--{name} {getattr(model_args, name)} (the checkpoint has {values[name]})"
        for name in sorted(given & set(values))
        if name != "variant" and getattr(model_args, name) is not None and getattr(model_args, name) != values[name]
    ]
    if contradicting:
        raise ValueError(
            f"The model comes from --model_name_or_path, so its shape is the checkpoint's: {', '.join(contradicting)}; "
            f"leave these flags out."
        )
    for name, value in values.items():
        setattr(model_args, name, value)
    return model_args


def load_source(name, model_class):
    """The checkpoint's model (fp32 weights to train) and tokenizer (None if it has none)."""
    from transformers import AutoTokenizer

    try:
        model = model_class.from_pretrained(name, dtype=torch.float32)
    except OSError as e:
        raise ValueError(
            f"--model_name_or_path {name!r} does not load as a LoopFormer ({str(e).splitlines()[0]})"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer
