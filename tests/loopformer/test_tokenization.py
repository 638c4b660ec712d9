"""tokenization_loopformer.py: `AutoTokenizer`'s class for a LoopFormer folder. A folder without any tokenizer file is
an OSError that says so (not sentencepiece's "You need to have sentencepiece or tiktoken installed"); a folder with one
loads a plain fast tokenizer, so a saved copy names no class of this package."""

import json

import pytest
from support.hub_helpers import make_tokenizer
from transformers import PreTrainedTokenizerFast

from loopformer_hf.tokenization_loopformer import TOKENIZER_FILES, LoopFormerTokenizerFast


def test_a_folder_without_a_tokenizer_is_an_oserror_naming_the_files_it_looked_for(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "loopformer"}))
    with pytest.raises(OSError, match="holds no tokenizer") as error:
        LoopFormerTokenizerFast.from_pretrained(tmp_path)
    assert all(name in str(error.value) for name in TOKENIZER_FILES)


def test_a_folder_with_a_tokenizer_loads_a_plain_fast_tokenizer_that_encodes_as_the_saved_one(tmp_path):
    saved = make_tokenizer()
    saved.save_pretrained(tmp_path)
    loaded = LoopFormerTokenizerFast.from_pretrained(tmp_path)
    assert type(loaded) is PreTrainedTokenizerFast
    text = "the cat sat on the log"
    assert loaded(text)["input_ids"] == saved(text)["input_ids"] and loaded.eos_token == "<|endoftext|>"
