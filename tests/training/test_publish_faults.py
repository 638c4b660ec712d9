"""`python -m looped_training.publish` on bad input: a corrupt checkpoint or a stage folder inside it is a one-line error
naming the file and what is wrong, exit code 2, no traceback, and no half-filled stage folder left to block the rerun;
the card's snippets fit the model's context and variant and run as written."""

import json
import os
import shutil
import subprocess

import pytest

from support.hub_helpers import PYTHON, REPO_ROOT, save_checkpoint

from looped_training.publish import main as publish_main


REPO = "org/loopformer-tiny"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "ckpt"
    save_checkpoint(path)
    return path


def _truncate_weights(path):
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return weights, "truncated"


def _invalid_json_config(path):
    (path / "config.json").write_text('{"model_type": "loopformer", "hidden_size": ')
    return path / "config.json", "is corrupt"


def _bad_config_value(path):
    config = json.loads((path / "config.json").read_text())
    config["num_loops"] = -1
    (path / "config.json").write_text(json.dumps(config))
    return (
        path / "config.json",
        "Validation error for field 'num_loops': ValueError: Value must be a positive integer, got -1",
    )


def _config_weights_disagree(path):
    config = json.loads((path / "config.json").read_text())
    config["hidden_size"] = 64  # the weights were trained at 32
    (path / "config.json").write_text(json.dumps(config))
    return path / "model.safetensors", "shape"


def _weights_lack_a_tensor(path):
    from safetensors.torch import load_file, save_file

    weights = path / "model.safetensors"
    state = load_file(weights)
    del state["model.norm.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    return weights, "model.norm.weight"


def _no_weights(path):
    (path / "model.safetensors").unlink()
    return path, "holds no weights"


def _corrupt_tokenizer(path):
    (path / "tokenizer.json").write_text("{not json")
    return path, "tokenizer"  # fails after the weights were staged: the case that used to leave a half-filled folder


FAULTS = [
    _truncate_weights,
    _invalid_json_config,
    _bad_config_value,
    _config_weights_disagree,
    _weights_lack_a_tensor,
    _no_weights,
    _corrupt_tokenizer,
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.__name__.strip("_") for f in FAULTS])
def test_corrupt_checkpoint_is_a_one_line_error_naming_the_file_and_the_rerun_succeeds(good, tmp_path, fault, capsys):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(good, checkpoint)
    named, what = fault(checkpoint)
    stage = tmp_path / "stage"
    argv = ["--checkpoint", str(checkpoint), "--repo_id", REPO, "--dry_run", "--stage_dir", str(stage)]
    assert publish_main(argv) == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1, err_lines
    assert str(named) in err_lines[0] and what in err_lines[0]
    assert not stage.exists() and os.listdir(tmp_path) == ["ckpt"]  # nothing staged, no temporary folder left

    shutil.rmtree(checkpoint)
    shutil.copytree(good, checkpoint)  # the user repairs the checkpoint and reruns the same command
    assert publish_main(argv) == 0
    assert (stage / "README.md").is_file() and (stage / "model.safetensors").is_file()


def test_command_line_prints_no_traceback(good, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(good, checkpoint)
    weights, _ = _truncate_weights(checkpoint)
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "looped_training.publish",
            "--checkpoint",
            str(checkpoint),
            "--repo_id",
            REPO,
            "--dry_run",
            "--stage_dir",
            str(tmp_path / "stage"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {weights} is truncated")


def test_an_empty_stage_dir_stays_usable_after_a_failure(good, tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(good, checkpoint)
    _corrupt_tokenizer(checkpoint)
    stage = tmp_path / "stage"
    stage.mkdir()  # made by the user beforehand
    argv = ["--checkpoint", str(checkpoint), "--repo_id", REPO, "--dry_run", "--stage_dir", str(stage)]
    assert publish_main(argv) == 2
    assert stage.is_dir() and not any(stage.iterdir())
    shutil.copy(good / "tokenizer.json", checkpoint / "tokenizer.json")
    assert publish_main(argv) == 0
    assert (stage / "README.md").is_file()


def test_a_stage_dir_inside_the_checkpoint_is_refused_and_the_checkpoint_is_untouched(good, tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(good, checkpoint)
    before = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*"))
    for stage in (checkpoint, checkpoint / "staged", checkpoint / "sub" / "staged"):
        argv = ["--checkpoint", str(checkpoint), "--repo_id", REPO, "--dry_run", "--stage_dir", str(stage)]
        assert publish_main(argv) == 2
        assert f"error: --stage_dir {stage} is inside --checkpoint {checkpoint}" in capsys.readouterr().err
    assert sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*")) == before


def _run_card_snippets(stage, repo_id):
    """Execute every python snippet of the staged card, loading from the staged folder instead of the Hub."""
    import re

    card = (stage / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", card, re.S)
    assert snippets
    for snippet in snippets:
        exec(snippet.replace(f'"{repo_id}"', f'r"{stage}"'), {})
    return card


def test_card_snippets_run_on_a_12_token_context(tmp_path, capsys):
    # the card hard-coded max_new_tokens=16: past position 12 a learned position table has no row
    checkpoint = tmp_path / "ctx12"
    _, tokenizer = save_checkpoint(checkpoint, max_position_embeddings=12)
    room = 12 - len(tokenizer("the cat sat")["input_ids"])
    stage = tmp_path / "stage"
    assert (
        publish_main(
            [
                "--checkpoint",
                str(checkpoint),
                "--repo_id",
                "org/ctx12",
                "--dry_run",
                "--stage_dir",
                str(stage),
                "--prompt",
                "the cat sat",
            ]
        )
        == 0
    )
    card = _run_card_snippets(stage, "org/ctx12")
    assert f"max_new_tokens={room}," in card and "max_new_tokens=16" not in card
    capsys.readouterr()
    long_prompt = " ".join(["the cat sat on the mat"] * 3)
    assert (
        publish_main(
            [
                "--checkpoint",
                str(checkpoint),
                "--repo_id",
                "org/ctx12",
                "--dry_run",
                "--stage_dir",
                str(tmp_path / "stage2"),
                "--prompt",
                long_prompt,
            ]
        )
        == 2
    )
    assert "leaves no room in the model's context of 12 tokens" in capsys.readouterr().err


def test_fprm_card_snippet_fits_a_short_learned_position_table(tmp_path):
    from support.hub_helpers import make_fprm

    checkpoint = tmp_path / "fprm"
    make_fprm(position_embedding_type="learned", max_position_embeddings=12, num_prefix_tokens=2).save_pretrained(
        checkpoint
    )
    stage = tmp_path / "stage"
    assert (
        publish_main(
            ["--checkpoint", str(checkpoint), "--repo_id", "org/fprm12", "--dry_run", "--stage_dir", str(stage)]
        )
        == 0
    )
    card = _run_card_snippets(stage, "org/fprm12")
    assert "(2, 10))" in card  # 12 rows - 2 prefix rows


@pytest.mark.parametrize("conditioning", ["shortcut", "timestep", "none"])
def test_loopformer_card_matches_the_variant_and_its_snippets_run(tmp_path, conditioning):
    # With L=8 the card's example budget 4 makes "coarse_to_fine" a non-uniform schedule, which a model with
    # loop_conditioning "timestep" or "none" refuses: the card's second snippet raised ValueError, and its first line
    # said every step is conditioned on t and Δ, which only the shortcut variant is.
    checkpoint = tmp_path / "ckpt"
    save_checkpoint(checkpoint, num_loops=8, loop_conditioning=conditioning)
    stage = tmp_path / "stage"
    assert (
        publish_main(
            ["--checkpoint", str(checkpoint), "--repo_id", "org/variant", "--dry_run", "--stage_dir", str(stage)]
        )
        == 0
    )
    card = _run_card_snippets(stage, "org/variant")
    body = card.split("---", 2)[2]
    assert {
        "shortcut": "(shortcut-conditioned;",
        "timestep": "(TMLT, timestep-conditioned;",
        "none": "(Base-Loop, unconditioned;",
    }[conditioning] in body
    if conditioning == "shortcut":
        assert "conditioned on its normalised time t and step size Δ" in body
        assert 'step_schedule="coarse_to_fine"' in body
    else:
        assert "step size Δ" not in body and "coarse_to_fine" not in body
        assert {"timestep": "conditioned on its loop index", "none": "no loop conditioning"}[conditioning] in body
    assert "one slot per (loop step, block)" in body  # the shared cache is the lab's (benchmarks/cache_sharing.py)
    # the citation names the paper's full title and its three authors (it was "Jeddi and others")
    assert "LoopFormer: Elastic-Depth Looped Transformers for Latent Reasoning via Shortcut Modulation" in body
    assert "{Jeddi, Ahmadreza and Ciccone, Marco and Taati, Babak}" in body
    assert "and others" not in body and "2602.11451" in body


def test_the_card_of_the_unlooped_base_variant_does_not_call_it_base_loop(tmp_path):
    checkpoint = tmp_path / "ckpt"
    save_checkpoint(checkpoint, num_loops=1, loop_conditioning="none")
    stage = tmp_path / "stage"
    assert (
        publish_main(
            ["--checkpoint", str(checkpoint), "--repo_id", "org/base", "--dry_run", "--stage_dir", str(stage)]
        )
        == 0
    )
    body = _run_card_snippets(stage, "org/base").split("---", 2)[2]
    assert "(Base, not looped: one pass of its blocks;" in body and "Base-Loop" not in body


def test_card_snippets_hold_the_prompt_exactly_whatever_its_characters(tmp_path):
    # only '"' was escaped: a newline in --prompt made every snippet a SyntaxError, a backslash changed the prompt
    import ast
    import re

    checkpoint = tmp_path / "ckpt"
    save_checkpoint(checkpoint)
    prompt = 'the "cat"\\sat\non\tthe mat'
    stage = tmp_path / "stage"
    assert (
        publish_main(
            [
                "--checkpoint",
                str(checkpoint),
                "--repo_id",
                "org/prompt",
                "--dry_run",
                "--stage_dir",
                str(stage),
                "--prompt",
                prompt,
            ]
        )
        == 0
    )
    card = _run_card_snippets(stage, "org/prompt")
    literals = re.findall(r'tokenizer\(\[("(?:[^"\\\n]|\\.)*")\]', card) + re.findall(
        r'generator\(("(?:[^"\\\n]|\\.)*")', card
    )
    assert len(literals) == 3 and {ast.literal_eval(x) for x in literals} == {prompt}


def test_an_empty_prompt_is_refused(tmp_path, capsys):
    # the card was published with snippets that fail: generate() refuses a prompt of zero tokens
    checkpoint = tmp_path / "ckpt"
    save_checkpoint(checkpoint)
    assert (
        publish_main(
            [
                "--checkpoint",
                str(checkpoint),
                "--repo_id",
                "org/empty",
                "--dry_run",
                "--stage_dir",
                str(tmp_path / "stage"),
                "--prompt",
                "",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "error: --prompt '' is 0 tokens" in err and "at least one token" in err
    assert not (tmp_path / "stage").exists()
