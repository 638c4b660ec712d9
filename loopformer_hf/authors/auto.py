"""How transformers' Auto classes reach the authors' Hub repos: the config classes `AutoConfig` reads their
config.json with (one per model type of theirs, model_types.py), the translated config `AutoConfig` returns
(`LoopFormerAuthorsConfig`), and the two model classes `AutoModelForCausalLM` / `AutoModel` map it to, whose
`from_pretrained` is `from_pretrained_authors` (checkpoints.py) and which are never built: every model loaded is a
plain `LoopFormerForCausalLM` / `LoopFormerModel` with a plain `LoopFormerConfig`.

This module reads no file: the readers (files.py, config.py, code_defaults.py, weights.py, checkpoints.py) are
imported on the authors' loading path only, so `import loopformer_hf` and a config of this package's own format never
load them. `register_auto_classes` (called by `loopformer_hf/__init__.py`) registers their model types where
`AutoConfig` has none of that name, and otherwise leaves the other library's class in place, with one warning that
names `from_pretrained_authors`.
"""

from transformers import CONFIG_MAPPING, AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import logging

from ..configuration_loopformer import LoopFormerConfig
from ..modeling_loopformer import LoopFormerForCausalLM, LoopFormerModel
from ..tokenization_loopformer import LoopFormerTokenizerFast
from .model_types import LOADER, is_reference_config

logger = logging.get_logger(__name__)


def translated_config_dict(config_dict, pretrained_model_name_or_path, hub_kwargs):
    """Their config.json as the config dict of this package's format (`LoopFormerConfig.get_config_dict` on their
    repo): every value from the repo's files (config.py's `derive_config`), model type "loopformer"."""
    from .config import derive_config

    return dict(derive_config(config_dict, pretrained_model_name_or_path, hub_kwargs), model_type="loopformer")


def refusal_of_a_model_class(pretrained_model_name_or_path):
    """The ValueError for `LoopFormerForCausalLM.from_pretrained(<their repo>)` where the model classes have no hook
    that routes their repos to the loader: transformers would read their weights under our names, none would match,
    and the model would be initialised at random."""
    return ValueError(
        f"{pretrained_model_name_or_path!s} is one of the authors' repos (their config.json and weight names): a "
        f"model class's own from_pretrained reads weights under this package's names and would initialise this one "
        f"at random. Load it with AutoModelForCausalLM.from_pretrained(repo) (or AutoModel), or {LOADER}(repo)."
    )


def authors_config_from_dict(config_dict, **kwargs):
    """`AutoConfig`'s `from_dict` of their config.json (`kwargs["name_or_path"]`: the repo `AutoConfig` was given): a
    `LoopFormerAuthorsConfig` with the values the repo's files determine, so that `AutoModelForCausalLM` loads it
    through `from_pretrained_authors` and the config states the model that load builds."""
    from .config import derive_config

    translated = derive_config(config_dict, kwargs.get("name_or_path"))
    loaded = PreTrainedConfig.from_dict.__func__(LoopFormerAuthorsConfig, translated, **kwargs)
    (loaded[0] if isinstance(loaded, tuple) else loaded).validate()
    return loaded


class LoopFormerAuthorsConfig(LoopFormerConfig):
    """The `LoopFormerConfig` `AutoConfig` returns for an authors' repo: the same fields (and `authors_config_sources`)
    as the config `from_pretrained_authors` loads the model with. Its own class only so that the Auto model classes
    send their repo to that loader; saved, it is a `LoopFormerConfig` (model type "loopformer")."""

    def save_pretrained(self, save_directory, **kwargs):
        return LoopFormerConfig.from_dict(self.to_dict()).save_pretrained(save_directory, **kwargs)


class AuthorsLoopFormerForCausalLM(LoopFormerForCausalLM):
    """`AutoModelForCausalLM`'s class for `LoopFormerAuthorsConfig`: never built, its `from_pretrained` returns a
    `LoopFormerForCausalLM` (`from_pretrained_authors`)."""

    config_class = LoopFormerAuthorsConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from .checkpoints import from_pretrained_authors

        return from_pretrained_authors(pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):  # AutoModelForCausalLM.from_config: a model of ours, randomly initialised
        return LoopFormerForCausalLM._from_config(LoopFormerConfig.from_dict(config.to_dict()), **kwargs)


class AuthorsLoopFormerModel(LoopFormerModel):
    """`AutoModel`'s class for `LoopFormerAuthorsConfig`: never built, its `from_pretrained` returns the
    `LoopFormerModel` of the loaded causal LM."""

    config_class = LoopFormerAuthorsConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from .checkpoints import from_pretrained_authors

        return from_pretrained_authors(
            pretrained_model_name_or_path, *model_args, model_class=LoopFormerModel, **kwargs
        )

    @classmethod
    def _from_config(cls, config, **kwargs):
        return LoopFormerModel._from_config(LoopFormerConfig.from_dict(config.to_dict()), **kwargs)


class AuthorsConfigMixin:
    """`from_dict` of their model types' classes: their config.json translated (`AutoConfig`), one of ours as ours."""

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        if is_reference_config(config_dict):
            return authors_config_from_dict(config_dict, **kwargs)
        return LoopFormerConfig.from_dict(config_dict, **kwargs)


class AuthorsTMLTConfig(AuthorsConfigMixin, LoopFormerConfig):
    """config.json of their TMLT repos; `AutoConfig` translates it (`authors_config_from_dict`)."""

    model_type = "tmlt"


class AuthorsTMLTEarlyExitConfig(AuthorsConfigMixin, LoopFormerConfig):
    """config.json of their early-exit TMLT repos (the weights of a TMLT model); translated as `AuthorsTMLTConfig`."""

    model_type = "tmlt_ee"


class AuthorsBaseLoopConfig(AuthorsConfigMixin, LoopFormerConfig):
    """config.json of their Base-Loop repos; `AutoConfig` translates it (`authors_config_from_dict`)."""

    model_type = "base_loop"


class AuthorsBaseLoopEarlyExitConfig(AuthorsConfigMixin, LoopFormerConfig):
    """config.json of their Base-Loop-EE repos (the weights of a Base-Loop model); translated as Base-Loop."""

    model_type = "base_loop_ee"


class AuthorsBaseConfig(AuthorsConfigMixin, LoopFormerConfig):
    """config.json of their Base repos (24 blocks, one pass); `AutoConfig` translates it (`authors_config_from_dict`)."""

    model_type = "base"


# one a model type of theirs other than "loopformer" (ours, whose `from_dict` hands their config.json here)
AUTHORS_CONFIG_CLASSES = (
    AuthorsTMLTConfig,
    AuthorsTMLTEarlyExitConfig,
    AuthorsBaseLoopConfig,
    AuthorsBaseLoopEarlyExitConfig,
    AuthorsBaseConfig,
)


def register_auto_classes():
    """Registers the classes above with transformers' Auto classes (their public `register`): the translated config's
    model classes and tokenizer (keyed by a class of ours), and each of their model types that `AutoConfig` does not
    hold yet. A model type another library registered is left to it, and one warning names those types and
    `from_pretrained_authors`, which loads their repos whatever `AutoConfig` holds. Returns the model types left."""
    AutoModelForCausalLM.register(LoopFormerAuthorsConfig, AuthorsLoopFormerForCausalLM, exist_ok=True)
    AutoModel.register(LoopFormerAuthorsConfig, AuthorsLoopFormerModel, exist_ok=True)
    AutoTokenizer.register(LoopFormerAuthorsConfig, tokenizer_class=LoopFormerTokenizerFast, exist_ok=True)
    taken = {}
    for config_class in AUTHORS_CONFIG_CLASSES:
        model_type = config_class.model_type
        if model_type not in CONFIG_MAPPING:
            AutoConfig.register(model_type, config_class)
        elif CONFIG_MAPPING[model_type] is not config_class:  # (a second registration of ours changes nothing)
            taken[model_type] = CONFIG_MAPPING[model_type]
    if taken:
        owners = ", ".join(f"{t!r} ({c.__module__}.{c.__qualname__})" for t, c in taken.items())
        logger.warning_once(
            f"loopformer_hf: AutoConfig already holds the model types {owners}, which the authors' LoopFormer repos "
            f"also use; they are left as registered, so AutoConfig and AutoModelForCausalLM read such a repo with "
            f"those classes. Load the authors' repos of these types with {LOADER}(repo)."
        )
    return sorted(taken)


def load_authors_repo(cls, pretrained_model_name_or_path, model_args, kwargs):
    """`checkpoints.load_authors_repo` (a model, or None where the folder is not theirs), imported on first use."""
    from .checkpoints import load_authors_repo

    return load_authors_repo(cls, pretrained_model_name_or_path, model_args, kwargs)
