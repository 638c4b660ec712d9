"""loopformer_hf/authors/code_defaults.py: the defaults of the configuration class an authors' config.json names in `auto_map`,
read from the repo's Python source with `ast`: constants and simple arithmetic only, bases first, nothing executed."""

import json

import pytest

from loopformer_hf.authors.code_defaults import read_code_defaults, source_defaults

SOURCE = """
import os

class Base:
    n_head = 4
    vocab_size: int = 50304

class GPTConfig(Base):
    dropout = -0.0
    def __init__(self, n_embd=64 * 2, steps=[1 / 8] * 8, bias=False, *, block_size=1024 - 0, name=os.getcwd()):
        pass

class Unrelated:
    n_head = 99
"""


def test_init_defaults_and_class_assignments_with_the_bases_first():
    assert source_defaults(SOURCE, "GPTConfig") == {
        "n_head": 4,
        "vocab_size": 50304,
        "dropout": 0.0,
        "n_embd": 128,
        "steps": [0.125] * 8,
        "bias": False,
        "block_size": 1024,
    }  # `name`, computed at run time, states nothing
    assert source_defaults(SOURCE, "Missing") == {}


def test_nothing_in_the_source_is_run(tmp_path):
    source = "raise SystemExit('ran')\nclass C:\n    x = __import__('os').getpid()\n    y = 3\n"
    assert source_defaults(source, "C") == {"y": 3}


def test_a_list_too_long_for_a_trajectory_is_not_read():
    assert source_defaults("class C:\n    steps = [1] * 100000\n", "C") == {}


def test_the_class_auto_map_names_is_read_from_the_repo(tmp_path):
    (tmp_path / "configuration_gpt.py").write_text(SOURCE)
    defaults, source = read_code_defaults(tmp_path, {"auto_map": {"AutoConfig": "configuration_gpt.GPTConfig"}}, {})
    assert defaults["n_embd"] == 128 and source == "configuration_gpt.py's GPTConfig default"
    # no auto_map, code in another repo, or a file the repo lacks: nothing to read
    for config in ({}, {"auto_map": {"AutoConfig": "other/repo--configuration_gpt.GPTConfig"}}):
        assert read_code_defaults(tmp_path, config, {}) == (None, None)
    assert read_code_defaults(tmp_path, {"auto_map": {"AutoConfig": "missing.GPTConfig"}}, {}) == (None, None)


def test_source_that_does_not_parse_is_a_value_error_naming_the_file(tmp_path):
    (tmp_path / "broken.py").write_text("class C(:\n")
    with pytest.raises(ValueError, match="broken.py .* is not valid Python"):
        read_code_defaults(tmp_path, json.loads('{"auto_map": {"AutoConfig": "broken.C"}}'), {})
