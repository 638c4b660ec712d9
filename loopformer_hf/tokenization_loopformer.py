"""`AutoTokenizer`'s class for a LoopFormer folder that names no tokenizer class of its own.

A folder saved with its tokenizer names one (`tokenizer_config.json`), and transformers loads that. A folder without
any tokenizer file fell through to a conversion that failed with "You need to have sentencepiece or tiktoken
installed", which misstates what is wrong: this class says the folder holds no tokenizer."""

import os

from transformers import PreTrainedTokenizerFast
from transformers.utils import cached_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class LoopFormerTokenizerFast(PreTrainedTokenizerFast):
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        options = {
            k: kwargs[k]
            for k in ("cache_dir", "token", "revision", "subfolder", "local_files_only")
            if kwargs.get(k) is not None
        }
        if not os.path.isfile(os.fspath(pretrained_model_name_or_path)) and not any(
            cached_file(
                pretrained_model_name_or_path,
                name,
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
                **options,
            )
            for name in TOKENIZER_FILES
        ):
            raise OSError(
                f"{os.fspath(pretrained_model_name_or_path)!r} holds no tokenizer (none of "
                f"{', '.join(TOKENIZER_FILES)}): the model was saved without one. Save it there with "
                f"`tokenizer.save_pretrained(folder)`, or load the tokenizer it was trained with from its "
                f"own folder."
            )
        # a plain fast tokenizer, so that a saved copy names no class of this package
        return PreTrainedTokenizerFast.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
