"""Nothing a finished run saved is lost: it is never trained over (its own record counts when it kept no
checkpoint-N), a run killed (SIGKILL) during its final save leaves no half-written file and a resume finishes the
save from its last checkpoint, and an FPRM run stopped (Ctrl-C) during its final evaluation is evaluated by a resume."""

import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from looped_training.checkpoints import check_checkpoint
from looped_training.run_folder import FINAL_STAGING
from test_resume import MODULES, REPO, folder_bytes, run, run_fprm, trained_steps  # noqa: F401  (a fixture)
from support import TESTS_DIR, sigint_as_in_a_terminal


def weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


# --- a finished run without checkpoint-N is not trained over ----------------------------------------------------------


def test_a_finished_loopformer_run_without_checkpoints_is_not_trained_over(tmp_path, trained_steps, caplog):
    # "No complete checkpoint ... training from scratch", exit 0, and model.safetensors overwritten (global_step 40->10)
    out = tmp_path / "run"
    run(out, "--save_strategy", "no")
    assert not list(out.glob("checkpoint-*"))
    before = folder_bytes(out)
    trained_steps.clear()
    with caplog.at_level(logging.WARNING, logger="looped_training.checkpoints"):
        assert run(out, "--save_strategy", "no", "--resume_from_checkpoint", "last") is None
    assert f"{out} is the end of a finished run (step 6" in caplog.text and "training from scratch" not in caplog.text
    assert trained_steps == [] and folder_bytes(out) == before
    # more steps than it holds: nothing to continue from, and from scratch would overwrite it
    with pytest.raises(
        ValueError,
        match=r"holds a finished run \(step 6, .*no checkpoint-N to continue it from.*"
        r"--max_steps 12.*another --output_dir",
    ):
        run(out, "--save_strategy", "no", "--resume_from_checkpoint", "last", "--max_steps", "12")
    assert trained_steps == [] and folder_bytes(out) == before


def test_a_finished_fprm_run_of_the_default_save_strategy_is_not_trained_over(tmp_path, trained_steps, caplog):
    out = tmp_path / "run"
    run_fprm(out, "--save_strategy", "no")  # FPRM's default
    assert not list(out.glob("checkpoint-*"))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6
    before = folder_bytes(out)
    trained_steps.clear()
    with caplog.at_level(logging.WARNING, logger="looped_training.checkpoints"):
        assert run_fprm(out, "--save_strategy", "no", "--resume_from_checkpoint", "last") is None
    assert "is the end of a finished run (step 6" in caplog.text
    assert trained_steps == [] and folder_bytes(out) == before
    # a run of an earlier version holds results.json only: that record counts too
    (out / "trainer_state.json").unlink()
    before = folder_bytes(out)
    assert run_fprm(out, "--save_strategy", "no", "--resume_from_checkpoint", "last") is None
    assert trained_steps == [] and folder_bytes(out) == before


# --- SIGKILL during the final save loses nothing ----------------------------------------------------------------------


def kill_at_final_save(name, output_dir):
    """Run `name`'s training in a subprocess that a real SIGKILL ends when it starts its final model's config.json
    (tests/support/kill_during_save.py final:config.json)."""
    module, args, _ = MODULES[name]
    log = output_dir.with_name(output_dir.name + "-log.jsonl")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(TESTS_DIR / "support" / "kill_during_save.py"),
            "final:config.json",
            str(log),
            module,
            "--output_dir",
            str(output_dir),
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]  # SIGKILL


@pytest.mark.parametrize("name", ["loopformer", "fprm"])
def test_a_run_killed_during_its_final_save_is_finished_by_a_resume(name, tmp_path, trained_steps, caplog):
    # the root was left with a 0-byte config.json and no weights; the resume said "finished run, nothing written"
    out = tmp_path / "run"
    kill_at_final_save(name, out)
    check_checkpoint(str(out / "checkpoint-6"), for_resume=True)
    final = out if name == "loopformer" else out / "model"
    # nothing half-written where the final model goes: the save was killed aside
    assert not (final / "config.json").exists() or json.loads((final / "config.json").read_text())
    assert not (out / "trainer_state.json").exists()
    assert (out / FINAL_STAGING).is_dir()

    with caplog.at_level(logging.WARNING):
        result = (run if name == "loopformer" else run_fprm)(out, "--resume_from_checkpoint", "last")
    assert trained_steps == []  # nothing trained again
    check_checkpoint(str(final))
    assert not (out / FINAL_STAGING).exists()
    expected = weights(out / "checkpoint-6")
    got = weights(final)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6
    # one message, which says what the resume does (it said "nothing written", then "writing it")
    assert "nothing to train, but the final save in" in caplog.text and "nothing written" not in caplog.text
    assert "is incomplete (a run killed while writing it?): writing it from this checkpoint" in caplog.text
    if name == "loopformer":
        assert result is None
        record = json.loads((out / "loopformer_training.json").read_text())
        assert record["variant"] == "loopformer" and record["generation"]["do_sample"] is False
        from transformers import AutoModelForCausalLM

        import loopformer_hf  # noqa: F401

        AutoModelForCausalLM.from_pretrained(out)
    else:
        assert result["train_steps"] == 6 and (out / "results.json").is_file()
    # and a further resume is the no-op of a finished run
    before = folder_bytes(out)
    assert (run if name == "loopformer" else run_fprm)(out, "--resume_from_checkpoint", "last") is None
    assert folder_bytes(out) == before


# --- Ctrl-C during FPRM's final evaluation loses nothing -------------------------------------------------------------


def interrupt_final_evaluation(output_dir, *extra):
    """Run FPRM's tiny training in a subprocess that a real SIGINT (Ctrl-C) ends when its final evaluation starts,
    after the final save (tests/support/kill_during_save.py sigint:evaluation); the last line it printed."""
    module, args, _ = MODULES["fprm"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(TESTS_DIR / "support" / "kill_during_save.py"),
            "sigint:evaluation",
            str(output_dir) + "-log.jsonl",
            module,
            "--output_dir",
            str(output_dir),
            *args,
            *extra,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=sigint_as_in_a_terminal,
    )
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


# a length curriculum (2 -> 3 at step 3, -> 4 at step 6, of 8): its history and length are in the results
CURRICULUM = (
    "--train_length",
    "8",
    "--test_length",
    "8",
    "--curriculum_start_length",
    "2",
    "--curriculum_threshold",
    "1e-6",
    "--curriculum_check_steps",
    "3",
)


@pytest.mark.parametrize("save_strategy, extra", [("steps", ()), ("no", CURRICULUM)], ids=["steps", "no+curriculum"])
def test_an_fprm_run_interrupted_in_its_final_evaluation_is_evaluated_by_a_resume(
    save_strategy, extra, tmp_path, trained_steps, capsys
):
    # the resume was the no-op of a finished run (rc 0, "nothing written"): results.json and the plots never came
    out = tmp_path / "run"
    flags = ("--save_strategy", save_strategy, *extra)
    line = interrupt_final_evaluation(out, *flags)
    assert line.startswith("python -m looped_training.fprm.train: interrupted (Ctrl-C): ") and (
        "--resume_from_checkpoint last" in line
    ), line
    assert (out / "trainer_state.json").is_file() and not (out / "results.json").exists()
    check_checkpoint(str(out / "model"))
    model = folder_bytes(out / "model")
    # without a flag, the refusal says what is missing and that a resume finishes it without training
    with pytest.raises(
        ValueError,
        match=r"already holds a run \(trainer_state\.json, model.*\) that stopped after "
        r"its final save, before writing results\.json: .*Give "
        r"--resume_from_checkpoint last to finish it \(nothing is trained",
    ):
        run_fprm(out, *flags)
    capsys.readouterr()
    results = run_fprm(out, *flags, "--resume_from_checkpoint", "last")
    printed = capsys.readouterr().out
    assert trained_steps == []  # nothing trained again
    assert (
        f"{out} holds the final model but no results.json (a run stopped during its final evaluation?): "
        f"evaluating {out / 'model'}, without training." in printed
    )
    assert results["train_steps"] == 6 and [h["step"] for h in results["log_history"] if "loss" in h] == list(
        range(1, 7)
    )
    assert json.loads((out / "results.json").read_text())["halting"] == results["halting"]
    assert folder_bytes(out / "model") == model  # evaluated as saved, not written again
    if importlib.util.find_spec("matplotlib"):
        assert (out / "training_loss.png").is_file()
    if extra:  # what an uninterrupted run writes
        reference = run_fprm(tmp_path / "reference", *flags)
        assert [h["max_length"] for h in reference["curriculum"]] == [2, 3] and reference["max_train_length"] == 4
        assert results["max_train_length"] == 4 and len(results["curriculum"]) == 2
        for got, expected in zip(results["curriculum"], reference["curriculum"]):
            assert got == {**expected, "accuracy": pytest.approx(expected["accuracy"], rel=1e-4)}
    # and a further resume is the no-op of a finished run
    before = folder_bytes(out)
    assert run_fprm(out, *flags, "--resume_from_checkpoint", "last") is None
    assert folder_bytes(out) == before


# --- a checkpoint carries the run's record: a resume on other data is refused, a checkpoint evaluates alone ----------


def test_a_resume_with_other_data_flags_is_refused_and_a_checkpoint_carries_the_record(tmp_path, trained_steps):
    # --corpus_seed 1 went on silently on other data; `evaluate run/checkpoint-N` said it had no loopformer_training.json
    out = tmp_path / "run"
    run(out, "--max_steps", "3")
    record = json.loads((out / "checkpoint-3" / "loopformer_training.json").read_text())
    assert record["data"]["corpus_seed"] == 0 and record == {
        **json.loads((out / "loopformer_training.json").read_text()),
        "train_runtime_s": None,
    }
    trained_steps.clear()
    with pytest.raises(
        ValueError,
        match=r"data flags of this run differ from those .*checkpoint-3 was trained with "
        r"\(loopformer_training\.json\) in \['corpus_seed'\] \(e\.g\. --corpus_seed: "
        r"0 there, 1 here\)",
    ):
        run(out, "--resume_from_checkpoint", "last", "--corpus_seed", "1")
    assert trained_steps == []
    from looped_training.loopformer.metrics import load_checkpoint

    (out / "loopformer_training.json").unlink()  # as a run stranded in its final save left it
    assert load_checkpoint(str(out / "checkpoint-3"))[2]["variant"] == "loopformer"


def test_an_fprm_resume_with_other_data_flags_is_refused(tmp_path, trained_steps):
    # --data_seed_offset 1 (or another --seed) went on silently on other generated data
    out = tmp_path / "run"
    run_fprm(out, "--max_steps", "3")
    assert json.loads((out / "checkpoint-3" / "fprm_run.json").read_text())["data"]["data_seed_offset"] == 0
    trained_steps.clear()
    with pytest.raises(
        ValueError,
        match=r"data flags of this run differ from those .*checkpoint-3 was trained with "
        r"\(fprm_run\.json\) in \['data_seed_offset'\] \(e\.g\. --data_seed_offset: "
        r"0 there, 1 here\)",
    ):
        run_fprm(out, "--resume_from_checkpoint", "last", "--data_seed_offset", "1")
    with pytest.raises(ValueError, match=r"in \['seed'\] \(e\.g\. --seed: 0 there, 1 here\)"):
        run_fprm(out, "--resume_from_checkpoint", "last", "--seed", "1")
    assert trained_steps == []
