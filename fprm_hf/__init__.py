"""FPRM for transformers: importing this package registers the model with the Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

from .authors.checkpoints import authors_checkpoint_config_dict, from_pretrained_authors
from .configuration_fprm import FPRMConfig
from .modeling_fprm import FPRMForReasoning, FPRMModel, FPRMPreTrainedModel
from .outputs_fprm import FPRMModelOutput, FPRMReasoningOutput
from .solver_fprm import FPRMSolverState, SolverSettings

AutoConfig.register(FPRMConfig.model_type, FPRMConfig, exist_ok=True)
# the authors' folders (step files, no config.json; fprm_hf/authors/): FPRMConfig.from_pretrained and the models'
# from_pretrained derive the config from their files (the model files import no loader). AutoConfig reads config.json
# alone: for such a folder it gives transformers' own error.
if authors_checkpoint_config_dict not in FPRMConfig.config_loaders:
    FPRMConfig.config_loaders.append(authors_checkpoint_config_dict)
if from_pretrained_authors not in FPRMPreTrainedModel.checkpoint_loaders:
    FPRMPreTrainedModel.checkpoint_loaders.append(from_pretrained_authors)
AutoModel.register(FPRMConfig, FPRMModel, exist_ok=True)
# The head predicts one answer token per input token: token classification is the Auto class that fits.
AutoModelForTokenClassification.register(FPRMConfig, FPRMForReasoning, exist_ok=True)

# save_pretrained then writes `auto_map` and copies the configuration/modeling files next to the weights, so a
# saved folder loads with `trust_remote_code=True` where this package is not installed.
FPRMConfig.register_for_auto_class()
FPRMModel.register_for_auto_class("AutoModel")
FPRMForReasoning.register_for_auto_class("AutoModelForTokenClassification")

__version__ = "0.1.0"
__all__ = [
    "FPRMConfig",
    "FPRMModel",
    "FPRMForReasoning",
    "FPRMPreTrainedModel",
    "FPRMSolverState",
    "SolverSettings",
    "FPRMModelOutput",
    "FPRMReasoningOutput",
]
