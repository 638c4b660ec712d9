"""The output_dir lock: A run ended by SIGTERM releases it; a lock that is empty or garbage is taken over
once it is clearly a leftover; one that is refused says how to take it over ("process ? on ?" said nothing)."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from looped_training.checkpoints import LOCK_FILE, STALE_UNREADABLE_LOCK_S, output_dir_lock
from test_resume import REPO, TINY


def test_a_run_ended_by_sigterm_releases_its_lock(tmp_path):
    # the lock stayed, and every later run was refused until it was deleted by hand
    out = tmp_path / "run"
    args = [a if a != "6" else "100000" for a in TINY]  # --max_steps: long enough to be stopped
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "looped_training.loopformer.train", "--output_dir", str(out), *args,
                             "--save_steps", "100000"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (out / LOCK_FILE).exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert (out / LOCK_FILE).exists(), proc.stderr.read()[-3000:] if proc.poll() is not None else "no lock"
        time.sleep(2)  # into the training
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / LOCK_FILE).exists()


@pytest.mark.parametrize("content", [b"", b"garbage", b"[1, 2]"])
def test_an_empty_or_garbage_lock_is_refused_while_fresh_and_taken_over_when_old(tmp_path, caplog, content):
    lock = tmp_path / LOCK_FILE
    lock.write_bytes(content)
    # just written: its writer may be filling it in right now
    with pytest.raises(ValueError, match=rf"a lock that is empty or unreadable, written just now, {lock}\): .*If it "
                                         rf"is gone .*delete {lock} to take the output_dir over"):
        with output_dir_lock(str(tmp_path)):
            pass
    assert lock.read_bytes() == content
    old = time.time() - STALE_UNREADABLE_LOCK_S - 1
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="looped_training.checkpoints"):
        with output_dir_lock(str(tmp_path)):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "that is empty or unreadable, written" in caplog.text and not lock.exists()


def test_a_lock_of_another_host_says_how_to_take_it_over(tmp_path):
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"pid": 1, "host": "another-host"}))
    with pytest.raises(ValueError, match=rf"process 1 on another-host, {lock}\): give another --output_dir, or wait "
                                         rf"for that run to end\. If it is gone .*delete {lock} to take the "
                                         rf"output_dir over"):
        with output_dir_lock(str(tmp_path)):
            pass
