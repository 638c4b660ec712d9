"""LoopFormer for transformers: importing this package registers the model with the Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .authors_checkpoints import from_pretrained_reference, translate_config
from .authors_config import AUTHORS_CONFIG_CLASSES
from .cache_loopformer import LoopFormerCache, LoopFormerStaticCache
from .configuration_loopformer import STEP_SCHEDULE_PRESETS, LoopFormerConfig
from .generation_loopformer import LoopFormerGenerateBeamDecoderOnlyOutput, LoopFormerGenerateDecoderOnlyOutput
from .loss_loopformer import ShortcutConsistency
from .modeling_loopformer import LoopFormerForCausalLM, LoopFormerModel, LoopFormerPreTrainedModel
from .tokenization_loopformer import LoopFormerTokenizerFast

AutoConfig.register(LoopFormerConfig.model_type, LoopFormerConfig, exist_ok=True)
# the authors' Hub layout: its config.json translated, its weights mapped (the model files import no loader)
if translate_config not in LoopFormerConfig.config_translators:
    LoopFormerConfig.config_translators.append(translate_config)
if from_pretrained_reference not in LoopFormerPreTrainedModel.checkpoint_loaders:
    LoopFormerPreTrainedModel.checkpoint_loaders.append(from_pretrained_reference)
# The authors' Hub repos (model_type "base_loop", "base_loop_ee", …): their configs translate to a LoopFormerConfig.
for _authors_config in AUTHORS_CONFIG_CLASSES:
    AutoConfig.register(_authors_config.model_type, _authors_config, exist_ok=True)
AutoModel.register(LoopFormerConfig, LoopFormerModel, exist_ok=True)
AutoModelForCausalLM.register(LoopFormerConfig, LoopFormerForCausalLM, exist_ok=True)
# for a folder whose tokenizer_config.json names no class (or that has none: it says so)
AutoTokenizer.register(LoopFormerConfig, tokenizer_class=LoopFormerTokenizerFast, exist_ok=True)

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
