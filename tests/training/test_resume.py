"""Faults: a run killed mid-way and resumed from its last checkpoint reproduces the uninterrupted loss curve and
shortcut trajectories; a truncated or corrupt checkpoint is a clear error."""

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from looped_training.checkpoints import CheckpointError, check_checkpoint, last_complete_checkpoint
from looped_training.run_folder import LOCK_FILE, output_dir_lock
from looped_training.loopformer import train as train_loopformer
from looped_training.loopformer.data.tokenizer import train_bpe_tokenizer
from support import REPO_ROOT, TESTS_DIR
from support.tiny_runs import CHECKPOINTED as TINY, FPRM_CHECKPOINTED as FPRM_TINY, run_checkpointed as run, run_fprm

TERMS = ("loss", "ce_full", "ce_short", "consistency", "grad_norm", "learning_rate", "lambda_short")


def curve(trainer):
    return {h["step"]: {k: h[k] for k in TERMS} for h in trainer.state.log_history if "loss" in h}


def trajectories(output_dir):
    lines = (output_dir / "shortcut_trajectories_rank0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len({r["micro_batch"] for r in records}) == len(records)  # each micro-batch once
    return {r["micro_batch"]: r["trajectory"] for r in records}


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, run(out)


def test_killed_run_resumes_to_the_same_loss_curve_and_trajectories(uninterrupted, tmp_path, monkeypatch):
    ref_dir, ref = uninterrupted
    original = transformers.Trainer.training_step

    def dies_after_step_4(self, *args, **kwargs):
        if self.state.global_step >= 4:  # checkpoint-3 is on disk, step 4's progress is lost
            raise Killed()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "training_step", dies_after_step_4)
    with pytest.raises(Killed):
        run(tmp_path)
    monkeypatch.setattr(transformers.Trainer, "training_step", original)
    assert (tmp_path / "checkpoint-3").is_dir() and not (tmp_path / "checkpoint-6").exists()
    assert not (tmp_path / LOCK_FILE).exists()  # a crash releases the output_dir

    resumed = run(tmp_path, "--resume_from_checkpoint", "last")
    ref_curve, new_curve = curve(ref), curve(resumed)
    assert sorted(new_curve) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        for term in TERMS:
            assert new_curve[step][term] == pytest.approx(ref_curve[step][term], rel=1e-4, abs=1e-6), (step, term)
    # the sampler continued at micro-batch 3 with the trajectories the uninterrupted run drew; the log kept the first
    # segment's micro-batches (it held only the last segment's) and has micro-batch 3, trained twice, once
    ref_traj, new_traj = trajectories(ref_dir), trajectories(tmp_path)
    assert sorted(new_traj) == sorted(ref_traj) == [0, 1, 2, 3, 4, 5]
    assert new_traj == ref_traj
    state = json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["ShortcutConsistencyCallback"]["attributes"]["micro_batches_seen"] == 6


def test_resuming_with_another_sampler_seed_is_refused(uninterrupted, tmp_path):
    ref_dir, _ = uninterrupted
    shutil.copytree(ref_dir / "checkpoint-3", tmp_path / "checkpoint-3")
    with pytest.raises(ValueError, match="seed 0"):
        run(tmp_path, "--resume_from_checkpoint", "last", "--shortcut_seed", "1")


def test_resuming_with_other_model_flags_is_refused(uninterrupted, tmp_path):
    ref_dir, _ = uninterrupted
    shutil.copytree(ref_dir / "checkpoint-3", tmp_path / "checkpoint-3")
    # another width failed deep in load_state_dict; intermediate_size follows the width
    with pytest.raises(
        ValueError,
        match=r"model config that differs .* in \['hidden_size', 'intermediate_size'\] "
        r"\(e\.g\. hidden_size: 32 there, 64 here\)",
    ):
        run(tmp_path, "--resume_from_checkpoint", "last", "--hidden_size", "64")


def test_resuming_with_a_tokenizer_of_other_ids_is_refused(uninterrupted, tmp_path):
    checkpoint = uninterrupted[0] / "checkpoint-3"
    config = train_loopformer.LoopFormerConfig.from_pretrained(checkpoint)
    train_loopformer.check_resume_matches(checkpoint, transformers.AutoTokenizer.from_pretrained(checkpoint), config)
    # other data flags of the text task train another BPE of the same size: the restored weights would meet other
    # token ids, silently
    saved = train_bpe_tokenizer([" ".join(f"cat{i} sat" for i in range(500))], 280)
    other = train_bpe_tokenizer([" ".join(f"dog{i} ran" for i in range(500))], 280)
    assert len(saved) == len(other) and saved.get_vocab() != other.get_vocab()
    saved.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer whose vocabulary differs .* tokens have other ids"):
        train_loopformer.check_resume_matches(tmp_path, other, config)


@pytest.fixture
def checkpoint_copy(uninterrupted, tmp_path):
    ref_dir, _ = uninterrupted
    return shutil.copytree(ref_dir / "checkpoint-3", tmp_path / "checkpoint-3")


def test_truncated_weights_are_a_clear_error(checkpoint_copy):
    weights = checkpoint_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        check_checkpoint(str(checkpoint_copy))
    with pytest.raises(CheckpointError, match="truncated"):
        run(checkpoint_copy.parent, "--resume_from_checkpoint", str(checkpoint_copy))


def test_corrupt_optimizer_state_and_missing_files_are_clear_errors(checkpoint_copy):
    (checkpoint_copy / "optimizer.pt").write_bytes(b"not a torch archive")
    with pytest.raises(CheckpointError, match="optimizer.pt is truncated or corrupt"):
        check_checkpoint(str(checkpoint_copy), for_resume=True)
    check_checkpoint(str(checkpoint_copy))  # the model itself is intact: loading for evaluation is fine
    (checkpoint_copy / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="config.json is corrupt"):
        check_checkpoint(str(checkpoint_copy))
    with pytest.raises(CheckpointError, match="is not a folder"):
        check_checkpoint(str(checkpoint_copy / "nope"))
    (checkpoint_copy / "model.safetensors").write_bytes(b"\x01\x02")
    (checkpoint_copy / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="truncated"):
        check_checkpoint(str(checkpoint_copy))


# --- the FPRM trainer, and runs killed while a checkpoint is being written -------------------------------------------
# FPRM keeps a sample for up to max_segments steps (the carry): with 2, a resumed run reproduces the killed run's
# curve only if the checkpoint restored the samples in flight as well as the weights and optimizer.

REPO = REPO_ROOT
FPRM_TERMS = ("loss", "grad_norm", "learning_rate", "segment_iterations")
MODULES = {
    "loopformer": ("looped_training.loopformer.train", TINY, TERMS),
    "fprm": ("looped_training.fprm.train", FPRM_TINY, FPRM_TERMS),
}


@pytest.fixture
def trained_steps(monkeypatch):
    """The global step at which each training step of this process started."""
    steps, original = [], transformers.Trainer.training_step

    def counting(self, *args, **kwargs):
        steps.append(self.state.global_step)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "training_step", counting)
    return steps


def test_fprm_resume_last_goes_on_from_the_newest_checkpoint(tmp_path, trained_steps):
    # `--resume_from_checkpoint last` was ignored: the run restarted at step 0 and overwrote the checkpoints
    run_fprm(tmp_path, "--max_steps", "3")
    assert (tmp_path / "checkpoint-3" / "fprm_carry.safetensors").is_file()  # the samples in flight, for the resume
    first = (tmp_path / "checkpoint-3" / "trainer_state.json").read_text()
    trained_steps.clear()
    results = run_fprm(tmp_path, "--resume_from_checkpoint", "last")
    assert trained_steps == [3, 4, 5]
    assert results["train_steps"] == 6 and [h["step"] for h in results["log_history"] if "loss" in h] == list(
        range(1, 7)
    )
    assert (tmp_path / "checkpoint-3" / "trainer_state.json").read_text() == first


def train_and_kill(name, killed_file, output_dir):
    """Run `name`'s training in a subprocess that dies while writing `killed_file` (tests/support/kill_during_save.py); the
    curve {step: log entry} it logged before dying."""
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
            killed_file,
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
    assert proc.returncode == 137, proc.stderr[-3000:]
    return {h["step"]: h for h in map(json.loads, log.read_text().splitlines()) if "loss" in h}


@pytest.mark.parametrize(
    "name, killed_file",
    [
        ("loopformer", "checkpoint-6/rng_state.pth"),
        pytest.param("loopformer", "checkpoint-6/model.safetensors", marks=pytest.mark.slow),
        ("fprm", "checkpoint-6/trainer_state.json"),
        pytest.param("fprm", "checkpoint-3/optimizer.pt", marks=pytest.mark.slow),  # the first save: nothing to resume
    ],
)
def test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint(
    name, killed_file, tmp_path, trained_steps, caplog
):
    out = tmp_path / "run"
    killed = train_and_kill(name, killed_file, out)
    partial = out / killed_file.split("/")[0]
    killed_at = int(partial.name.split("-")[1])
    assert sorted(killed) == list(range(1, killed_at + 1))  # it had trained and logged up to the save, then died
    with pytest.raises(CheckpointError, match="checkpoint-"):
        check_checkpoint(str(partial), for_resume=True)

    with caplog.at_level(logging.WARNING, logger="looped_training.checkpoints"):
        resumed = (run if name == "loopformer" else run_fprm)(out, "--resume_from_checkpoint", "last")
    assert f"Skipping incomplete checkpoint {partial}" in caplog.text
    start = 3 if partial.name == "checkpoint-6" else 0
    if start == 0:
        assert "No complete checkpoint" in caplog.text
    # this process trained from the last good checkpoint on, and reproduced what the killed run had trained
    assert trained_steps == list(range(start, 6))
    history = resumed.state.log_history if name == "loopformer" else resumed["log_history"]
    new = {h["step"]: h for h in history if "loss" in h}
    assert sorted(new) == [1, 2, 3, 4, 5, 6]
    for step in killed:
        for term in MODULES[name][2]:
            assert new[step][term] == pytest.approx(killed[step][term], rel=1e-4, abs=1e-6), (step, term)
    check_checkpoint(str(out / "checkpoint-6"), for_resume=True)  # written whole this time
    check_checkpoint(str(partial), for_resume=True)
    if name == "loopformer":  # the killed run's log lines and the resumed run's: each micro-batch once
        assert sorted(trajectories(out)) == list(range(6))


def test_a_truncated_rng_state_is_a_clear_error_or_skipped(checkpoint_copy, caplog):
    # torch.load raised an OSError that named no file
    rng = checkpoint_copy / "rng_state.pth"
    rng.write_bytes(rng.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"checkpoint-3/rng_state.pth is truncated"):
        run(checkpoint_copy.parent, "--resume_from_checkpoint", str(checkpoint_copy))
    with caplog.at_level(logging.WARNING, logger="looped_training.checkpoints"):
        assert last_complete_checkpoint(str(checkpoint_copy.parent)) is None
    assert "rng_state.pth is truncated" in caplog.text and f"Skipping incomplete checkpoint {checkpoint_copy}" in (
        caplog.text
    )


def test_a_truncated_run_record_in_the_last_checkpoint_is_skipped_with_a_warning_naming_it(
    uninterrupted, tmp_path, trained_steps, caplog
):
    # `error: Unterminated string ...`, printed twice and naming no file, where a truncated model, optimizer, rng,
    # scheduler or trainer_state file makes `last` skip the checkpoint
    out = shutil.copytree(uninterrupted[0], tmp_path / "run")
    damaged = out / "checkpoint-6" / "loopformer_training.json"
    damaged.write_text(damaged.read_text()[:40])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(damaged))} is corrupt: "):
        run(out, "--resume_from_checkpoint", str(damaged.parent))
    with caplog.at_level(logging.WARNING, logger="looped_training.checkpoints"):
        run(out, "--resume_from_checkpoint", "last")
    assert f"Skipping incomplete checkpoint {damaged.parent} (a save that did not finish?): {damaged} is corrupt" in (
        caplog.text
    )
    assert trained_steps == [3, 4, 5]  # from checkpoint-3, which is whole
    check_checkpoint(str(damaged.parent), for_resume=True)  # written again, whole


# --- a finished run resumed, and two runs on one output_dir ----------------------------------------------------------


def folder_bytes(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_finished_run_resumed_is_a_no_op_that_says_so(uninterrupted, tmp_path, trained_steps, caplog):
    # it trained on past max_steps (checkpoint-7), the lr climbed again and save_total_limit rotated checkpoint-6 away
    out = shutil.copytree(uninterrupted[0], tmp_path / "run")
    before = folder_bytes(out)
    with caplog.at_level(logging.WARNING, logger="looped_training.checkpoints"):
        assert run(out, "--resume_from_checkpoint", "last", "--save_total_limit", "1") is None
    assert f"{out / 'checkpoint-6'} is the end of a finished run (step 6" in caplog.text and "--max_steps 6" in (
        caplog.text
    )
    assert trained_steps == [] and folder_bytes(out) == before


def test_a_finished_fprm_run_resumed_is_a_no_op_that_says_so(tmp_path, trained_steps, caplog):
    run_fprm(tmp_path)
    before = folder_bytes(tmp_path)
    trained_steps.clear()
    with caplog.at_level(logging.WARNING, logger="looped_training.checkpoints"):
        assert run_fprm(tmp_path, "--resume_from_checkpoint", "last") is None
    assert "is the end of a finished run (step 6" in caplog.text
    assert trained_steps == [] and folder_bytes(tmp_path) == before


def test_a_second_run_on_a_live_runs_output_dir_is_refused_naming_its_pid(tmp_path, trained_steps):
    # nothing kept a second run out: one died in a FileNotFoundError after the other's rotation deleted its checkpoint
    with output_dir_lock(str(tmp_path)):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(ValueError, match=rf"being written by another run \(process {os.getpid()} on "):
            run(tmp_path)
        with pytest.raises(ValueError, match=rf"process {os.getpid()} "):
            run_fprm(tmp_path)
    assert trained_steps == [] and os.listdir(tmp_path) == []  # refused before any work; the lock went with the block


def test_a_dead_runs_lock_is_taken_over_with_a_warning_and_an_exception_releases_it(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    with caplog.at_level(logging.WARNING, logger="looped_training.checkpoints"):
        with pytest.raises(RuntimeError, match="crash"):
            with output_dir_lock(str(tmp_path)):
                assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
                raise RuntimeError("crash")
    assert f"of process {dead.pid}, which is gone" in caplog.text
    assert not (tmp_path / LOCK_FILE).exists()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "another-host"}))  # its pid means nothing here
    with pytest.raises(ValueError, match="process 1 on another-host"):
        with output_dir_lock(str(tmp_path)):
            pass


def test_resuming_a_checkpoint_of_the_other_model_says_which_model_it_is(uninterrupted, tmp_path):
    # it listed 20 differing config fields (or failed on the missing tokenizer), never the model type
    loopformer_ckpt = uninterrupted[0] / "checkpoint-6"
    with pytest.raises(
        ValueError,
        match=r"checkpoint-6 is a 'loopformer' checkpoint \(config.json model_type\), not "
        r"a 'fprm' one",
    ):
        run_fprm(tmp_path / "fprm", "--resume_from_checkpoint", str(loopformer_ckpt))
    fprm_ckpt = shutil.copytree(loopformer_ckpt, tmp_path / "checkpoint-6")
    config = json.loads((fprm_ckpt / "config.json").read_text())
    (fprm_ckpt / "config.json").write_text(json.dumps({**config, "model_type": "fprm"}))
    with pytest.raises(ValueError, match="is a 'fprm' checkpoint"):
        run(tmp_path / "lf", "--resume_from_checkpoint", str(fprm_ckpt))


def test_an_output_dir_that_is_a_file_is_refused_before_any_work(tmp_path):
    target = tmp_path / "taken"
    target.write_text("keep me")
    for train in (run, run_fprm):
        with pytest.raises(ValueError, match=rf"--output_dir '?{target}'? is a file, not a folder"):
            train(target)
    assert target.read_text() == "keep me"


def test_a_resume_does_not_report_the_tied_head_as_missing(uninterrupted, tmp_path, caplog):
    # "There were missing keys in the checkpoint model loaded: ['lm_head.weight']": the tied head is saved once, as
    # the embedding, and the Trainer re-ties it when the model names it as a key it never saves (issue 55)
    out = shutil.copytree(uninterrupted[0], tmp_path / "run")
    shutil.rmtree(out / "checkpoint-6")
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            trainer = run(out, "--resume_from_checkpoint", "last")
    finally:
        transformers.logging.disable_propagation()
    assert trainer.state.global_step == 6 and "missing keys" not in caplog.text, caplog.text
    model = trainer.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
