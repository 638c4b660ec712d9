"""LoopFormer for transformers: importing this package registers the model with the Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_loopformer import STEP_SCHEDULE_PRESETS, LoopFormerConfig
from .modeling_loopformer import LoopFormerForCausalLM, LoopFormerModel, LoopFormerPreTrainedModel

AutoConfig.register(LoopFormerConfig.model_type, LoopFormerConfig, exist_ok=True)
AutoModel.register(LoopFormerConfig, LoopFormerModel, exist_ok=True)
AutoModelForCausalLM.register(LoopFormerConfig, LoopFormerForCausalLM, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "LoopFormerConfig",
    "LoopFormerModel",
    "LoopFormerForCausalLM",
    "LoopFormerPreTrainedModel",
    "STEP_SCHEDULE_PRESETS",
]
