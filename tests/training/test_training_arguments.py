"""Config files of the training entry points (`looped_training.arguments`): read through HfArgumentParser, flags override
them, and every file under training/configs/ parses into its entry point's arguments."""

import glob
import json
import os

import pytest
from transformers import HfArgumentParser, TrainingArguments

from looped_training.arguments import parse_args_with_config, split_config_file
from looped_training.loopformer.arguments import DataArguments, ModelArguments, ShortcutArguments
from support import REPO_ROOT


def loopformer_parser():
    return HfArgumentParser((ModelArguments, DataArguments, ShortcutArguments, TrainingArguments))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_sets_values_and_flags_override_them(tmp_path, suffix):
    values = {"variant": "tmlt", "num_loops": 3, "learning_rate": 0.002, "warmup_steps": 7, "max_steps": 11}
    path = tmp_path / f"run{suffix}"
    path.write_text(json.dumps(values))  # JSON is also YAML
    for argv in (["--config", str(path)], [str(path)], [f"--config={path}"]):
        (model, _, _, train), found = parse_args_with_config(loopformer_parser(), [*argv, "--max_steps", "5"])
        assert found == str(path)
        assert (model.variant, model.num_loops, train.learning_rate, train.max_steps) == ("tmlt", 3, 0.002, 5)
        assert train.warmup_steps == 7.0 and isinstance(train.warmup_steps, float)  # the field's type, as a flag


def test_config_file_errors_name_the_file_and_the_problem(tmp_path):
    # a suffix, a Python-object tag and broken JSON are rows of tests/support/bad_input_table.py
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_loops: 3\nnot_an_argument: 1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*not_an_argument"):
        parse_args_with_config(loopformer_parser(), ["--config", str(bad)])
    with pytest.raises(ValueError, match=r"does not exist"):
        parse_args_with_config(loopformer_parser(), ["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ValueError, match=r"one config file"):
        split_config_file(["a.yaml", "--config", "b.yaml"])
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"must map argument names to values, got a list"):
        parse_args_with_config(loopformer_parser(), [str(listing)])


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(REPO_ROOT, "training", "configs", "loopformer", "*.yaml")))
)
def test_every_loopformer_config_parses(path):
    (model, data, _, train), _ = parse_args_with_config(loopformer_parser(), [path, "--output_dir", "unused"])
    assert model.num_loops in (4, 8) and data.task in ("synthetic", "text") and train.max_steps > 0


def test_every_fprm_preset_parses_with_its_name_as_output_dir():
    from looped_training.fprm.train import parse_args, preset_names

    names = preset_names()
    assert {"s5-cpu", "a5-cpu", "sudoku-cpu", "maze-cpu", "s5-gpu", "sudoku"} <= set(names)
    for name in names:
        try:
            _, data, _, train = parse_args(["--preset", name])
        except ValueError:  # an accelerator preset (bf16 autocast) on a machine without one: refused, then in float32
            _, data, _, train = parse_args(["--preset", name, "--forward_dtype", "float32"])
        assert data.preset == name and train.output_dir == f"outputs/fprm-{name}" and train.max_steps > 0


@pytest.mark.parametrize("command", ["loopformer.train", "fprm.train", "loopformer.evaluate"])
def test_help_names_the_command_as_users_type_it(command):
    # "usage: train.py [-h] ..." (argparse's default, the file's name) for a command run as `python -m ...` (issue 55)
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", f"looped_training.{command}", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: python -m looped_training.{command} "), (
        proc.stdout[:200]
    )


def test_the_shared_checks_of_paths_and_models_take_what_commands_accept(tmp_path, monkeypatch):
    """The parse-time checks of every command (issue 64) refuse only mistakes: an existing report file may be
    replaced, a folder not there yet is created by the command (the check creates nothing), a Hub id is left to the
    Hub; a path that is not there and cannot be a Hub id is refused."""
    from looped_training.arguments import check_model_source, check_output_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.json").write_text("{}")
    check_output_path("--output", tmp_path / "r.json")
    check_output_path("--output", tmp_path / "new" / "r.json")
    check_output_path("--output_dir", tmp_path / "new" / "run", folder=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    for hub_id in ("gpt2", "fixed-point-reasoners/fprm"):
        check_model_source("--model", hub_id)
    (tmp_path / "runs").mkdir()
    for path in ("runs/nope", "./nope", str(tmp_path / "a" / "b"), "a/b/c"):
        with pytest.raises(ValueError, match="no such folder"):
            check_model_source("--model", path)
