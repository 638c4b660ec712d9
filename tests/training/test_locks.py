"""The output_dir lock: A run ended by SIGTERM or Ctrl-C releases it (Ctrl-C in one line, exit 130); a lock that is
empty or garbage is taken over once it is clearly a leftover; one that is refused says how to take it over ("process ?
on ?" said nothing)."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from looped_training.checkpoints import last_complete_checkpoint
from looped_training.run_folder import LOCK_FILE, STALE_UNREADABLE_LOCK_S, output_dir_lock
from support import sigint_as_in_a_terminal
from test_resume import MODULES, REPO


def start_long_run(name, out, ready):
    """`name`'s tiny training (tests/training/test_resume.py's MODULES) with --max_steps 100000, in a subprocess, once the file
    `ready` (a path under `out`) exists: the process and the file its stderr goes to."""
    module, args, _ = MODULES[name]
    args = [a if a != "6" else "100000" for a in args]  # --max_steps: long enough to be stopped
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    stderr = out.with_name(out.name + ".stderr")
    with open(stderr, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--output_dir", str(out), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=f,
            preexec_fn=sigint_as_in_a_terminal,
        )
    deadline = time.time() + 300
    while not ready.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    if not ready.exists():
        proc.kill()
        pytest.fail(f"no {ready}: {stderr.read_text()[-3000:]}")
    return proc, stderr


def test_a_run_ended_by_sigterm_releases_its_lock(tmp_path):
    # the lock stayed, and every later run was refused until it was deleted by hand
    out = tmp_path / "run"
    proc, _ = start_long_run("loopformer", out, out / LOCK_FILE)
    try:
        time.sleep(2)  # into the training
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / LOCK_FILE).exists()


@pytest.mark.parametrize("name", ["loopformer", "fprm"])
def test_ctrl_c_ends_a_run_in_one_line_that_names_its_last_checkpoint_with_exit_130(tmp_path, name):
    # a 42-line KeyboardInterrupt traceback and exit -2
    out = tmp_path / "run"
    proc, stderr = start_long_run(name, out, out / "checkpoint-3" / "trainer_state.json")  # a checkpoint's last file
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    err = stderr.read_text()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    saved = last_complete_checkpoint(str(out))
    assert err.strip().splitlines()[-1] == (
        f"python -m {MODULES[name][0]}: interrupted (Ctrl-C): the last complete checkpoint is {saved}. Run the same "
        f"command with --resume_from_checkpoint last to go on from it."
    )
    assert not (out / LOCK_FILE).exists()


@pytest.mark.parametrize("content", [b"", b"garbage", b"[1, 2]"])
def test_an_empty_or_garbage_lock_is_refused_while_fresh_and_taken_over_when_old(tmp_path, caplog, content):
    lock = tmp_path / LOCK_FILE
    lock.write_bytes(content)
    # just written: its writer may be filling it in right now
    with pytest.raises(
        ValueError,
        match=rf"a lock that is empty or unreadable, written just now, {lock}\): .*If it "
        rf"is gone .*delete {lock} to take the output_dir over",
    ):
        with output_dir_lock(str(tmp_path)):
            pass
    assert lock.read_bytes() == content
    old = time.time() - STALE_UNREADABLE_LOCK_S - 1
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="looped_training.run_folder"):
        with output_dir_lock(str(tmp_path)):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "that is empty or unreadable, written" in caplog.text and not lock.exists()


def test_a_lock_of_another_host_says_how_to_take_it_over(tmp_path):
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"pid": 1, "host": "another-host"}))
    with pytest.raises(
        ValueError,
        match=rf"process 1 on another-host, {lock}\): give another --output_dir, or wait "
        rf"for that run to end\. If it is gone .*delete {lock} to take the "
        rf"output_dir over",
    ):
        with output_dir_lock(str(tmp_path)):
            pass
