"""LoopFormer for transformers: importing this package registers the model with the Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .authors.auto import load_authors_repo as _load_authors_repo
from .authors.auto import register_auto_classes
from .cache_loopformer import LoopFormerCache, LoopFormerStaticCache
from .configuration_loopformer import STEP_SCHEDULE_PRESETS, LoopFormerConfig
from .generation_loopformer import LoopFormerGenerateBeamDecoderOnlyOutput, LoopFormerGenerateDecoderOnlyOutput
from .loss_loopformer import ShortcutConsistency
from .modeling_loopformer import LoopFormerForCausalLM, LoopFormerModel, LoopFormerPreTrainedModel
from .tokenization_loopformer import LoopFormerTokenizerFast

AutoConfig.register(LoopFormerConfig.model_type, LoopFormerConfig, exist_ok=True)
AutoModel.register(LoopFormerConfig, LoopFormerModel, exist_ok=True)
AutoModelForCausalLM.register(LoopFormerConfig, LoopFormerForCausalLM, exist_ok=True)
# for a folder whose tokenizer_config.json names no class (or that has none: it says so)
AutoTokenizer.register(LoopFormerConfig, tokenizer_class=LoopFormerTokenizerFast, exist_ok=True)
# The authors' Hub repos (loopformer_hf/authors/): AutoConfig translates their config.json, AutoModelForCausalLM loads
# them with `loopformer_hf.authors.from_pretrained_authors`; their model types ("base_loop", "base", ...) are
# registered where AutoConfig has none of that name, a warning names the loader otherwise.
register_auto_classes()
# `LoopFormerForCausalLM.from_pretrained(<their repo>)` (the class itself) reaches the same loader while the model
# classes have the `checkpoint_loaders` hook of `looped_common.CheckpointLoadersMixin`.
if _load_authors_repo not in getattr(LoopFormerPreTrainedModel, "checkpoint_loaders", [_load_authors_repo]):
    LoopFormerPreTrainedModel.checkpoint_loaders.append(_load_authors_repo)

# save_pretrained then writes `auto_map` and copies the configuration/modeling files next to the weights, so a
# saved folder loads with `trust_remote_code=True` where this package is not installed.
LoopFormerConfig.register_for_auto_class()
LoopFormerModel.register_for_auto_class("AutoModel")
LoopFormerForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__version__ = "0.1.0"
__all__ = [
    "LoopFormerConfig",
    "LoopFormerModel",
    "LoopFormerForCausalLM",
    "LoopFormerPreTrainedModel",
    "LoopFormerCache",
    "LoopFormerStaticCache",
    "LoopFormerGenerateDecoderOnlyOutput",
    "LoopFormerGenerateBeamDecoderOnlyOutput",
    "STEP_SCHEDULE_PRESETS",
    "ShortcutConsistency",
]
