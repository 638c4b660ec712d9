"""A disk that fills during a checkpoint save. torch's zip writer says only "unexpected pos ..." and the
C++ streams "basic_ios::clear"; the run must end with one line naming ENOSPC and the file, and lose nothing that a
resume needs."""

import errno
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
import torch

from looped_training import failures, run_folder
from looped_training.failures import DiskFullError
from looped_training.run_folder import output_dir_lock

from support.tiny_runs import TINY

TORCH_WRITE_FAILURE = "[enforce fail at inline_container.cc:672] . unexpected pos 806272 vs 806160"
Usage = namedtuple("Usage", "total used free")


def _write(f, message):  # stands for torch.save: `f` is the path it writes when the stream fails
    raise RuntimeError(message)


def test_a_failed_torch_write_on_a_full_disk_names_enospc_the_file_and_the_resume_point(tmp_path, monkeypatch):
    (tmp_path / "checkpoint-3").mkdir()
    target = str(tmp_path / "checkpoint-3" / "optimizer.pt")
    monkeypatch.setattr(failures.shutil, "disk_usage", lambda path: Usage(10 << 20, 10 << 20, 0))
    with pytest.raises(DiskFullError) as info:
        with output_dir_lock(str(tmp_path)):
            _write(target, TORCH_WRITE_FAILURE)
    err = info.value
    assert err.errno == errno.ENOSPC and err.filename == target
    assert target in err.strerror and "0.0 MiB free" in err.strerror and "no checkpoint is complete" in err.strerror
    assert "--resume_from_checkpoint last" in err.strerror
    assert isinstance(err.__cause__, RuntimeError)  # the writer's own error stays reachable
    assert not (tmp_path / run_folder.LOCK_FILE).exists()  # the lock goes with the run


def test_the_same_writer_failure_with_free_space_is_not_called_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(failures.shutil, "disk_usage", lambda path: Usage(10 << 30, 1 << 30, 9 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos") as info:
        with output_dir_lock(str(tmp_path)):
            _write(str(tmp_path / "optimizer.pt"), TORCH_WRITE_FAILURE)
    assert not isinstance(info.value, DiskFullError)


def test_an_enospc_oserror_is_named_whatever_the_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(failures.shutil, "disk_usage", lambda path: Usage(10 << 30, 1 << 30, 9 << 30))
    path = str(tmp_path / "checkpoint-1" / "scheduler.pt")
    with pytest.raises(DiskFullError, match="scheduler.pt"):
        with output_dir_lock(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device", path)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only): the real disk-full path, through torch, safetensors and shutil."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        shutil.which("mount") is None
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_training_run_that_fills_the_disk_says_so_in_one_line_and_resumes_after_space_is_freed(small_disk):
    out = small_disk / "run"
    ballast = small_disk / "ballast"
    args = [*TINY, "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--output_dir", str(out)]
    cmd = [sys.executable, "-m", "looped_training.loopformer.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # leave less free than one checkpoint needs (its modeling files alone are ~100 KiB)
    ballast.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - (64 << 10)))
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert "No space left on device while writing" in line and str(out / "checkpoint-2") in line, line
    ballast.unlink()
    resumed = subprocess.run(
        [*cmd, "--resume_from_checkpoint", "last"], capture_output=True, text=True, env=env, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(out / "checkpoint-4" / "rng_state.pth", weights_only=False) is not None
    assert (out / "model.safetensors").exists()
