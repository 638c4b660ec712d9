"""The authors' model types and how their config.json is told from ours: read by auto.py (the registrations) and by
the readers of this folder alike, and importing nothing."""

# their model types -> (loop_conditioning, block_norm_weight, one pass over a plain list of blocks); the variants
# (the Hub's Base-Loop-EE) are trained differently but hold the weights of their looped model
MODEL_TYPES = {
    "loopformer": ("shortcut", False, False),
    "tmlt": ("timestep", False, False),
    "tmlt_ee": ("timestep", False, False),
    "base_loop": ("none", True, False),
    "base_loop_ee": ("none", True, False),
    "base": ("none", True, True),
}
# Fields only this package's configs carry: a config.json with any of them is ours, not the authors'.
OWN_CONFIG_KEYS = ("num_loops", "loop_conditioning")
LOADER = "loopformer_hf.authors.from_pretrained_authors"


def is_reference_config(config_dict):
    """True for a config.json in the authors' layout: one of their model types and none of our own fields."""
    return config_dict.get("model_type") in MODEL_TYPES and not any(key in config_dict for key in OWN_CONFIG_KEYS)
