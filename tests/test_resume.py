"""Faults: a run killed mid-way and resumed from its last checkpoint reproduces the uninterrupted loss curve and
shortcut trajectories; a truncated or corrupt checkpoint is a clear error."""

import json
import shutil

import pytest
import transformers

from looped_training.checkpoints import CheckpointError, check_checkpoint
from looped_training.loopformer import train as train_loopformer

TINY = ["--hidden_size", "32", "--num_attention_heads", "2", "--num_loops", "4", "--num_blocks", "1",
        "--num_train_problems", "256", "--num_eval_problems", "16", "--max_depth", "3",
        "--per_device_train_batch_size", "8", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--logging_steps", "1", "--learning_rate", "3e-3", "--seed", "0", "--max_steps", "6", "--save_steps", "3",
        "--log_trajectories", "true", "--consistency_warmup_steps", "2"]
TERMS = ("loss", "ce_full", "ce_short", "consistency", "grad_norm", "learning_rate", "lambda_short")


def run(output_dir, *extra):
    return train_loopformer.main(["--output_dir", str(output_dir), *TINY, *extra])


def curve(trainer):
    return {h["step"]: {k: h[k] for k in TERMS} for h in trainer.state.log_history if "loss" in h}


def trajectories(output_dir):
    lines = (output_dir / "shortcut_trajectories_rank0.jsonl").read_text().splitlines()
    return {r["micro_batch"]: r["trajectory"] for r in map(json.loads, lines)}


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

    resumed = run(tmp_path, "--resume_from_checkpoint", "last")
    ref_curve, new_curve = curve(ref), curve(resumed)
    assert sorted(new_curve) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        for term in TERMS:
            assert new_curve[step][term] == pytest.approx(ref_curve[step][term], rel=1e-4, abs=1e-6), (step, term)
    # the sampler continued at micro-batch 3 with the trajectories the uninterrupted run drew
    ref_traj, new_traj = trajectories(ref_dir), trajectories(tmp_path)
    assert sorted(new_traj) == [3, 4, 5]
    assert all(new_traj[i] == ref_traj[i] for i in new_traj)
    state = json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["ShortcutConsistencyCallback"]["attributes"]["micro_batches_seen"] == 6


def test_resuming_with_another_sampler_seed_is_refused(uninterrupted, tmp_path):
    ref_dir, _ = uninterrupted
    shutil.copytree(ref_dir / "checkpoint-3", tmp_path / "checkpoint-3")
    with pytest.raises(ValueError, match="seed 0"):
        run(tmp_path, "--resume_from_checkpoint", "last", "--shortcut_seed", "1")


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
