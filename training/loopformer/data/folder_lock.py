"""`folder_lock`: one writer at a time in a folder that a command builds (LoopFormer's and FPRM's `prepare`).

The lock is an advisory `flock` on a file in the folder, which the kernel releases when its holder ends however it
ends (a kill included): no stale lock is ever left to take over. The file is removed when the lock is released."""

import contextlib
import fcntl
import json
import os
import socket


@contextlib.contextmanager
def folder_lock(folder, flag="--output_dir", name=".prepare.lock"):
    """Hold `folder/name` while the block runs; a folder another live process holds raises a one-line ValueError
    naming its pid and host. `folder` is created (and removed again if the block leaves it empty by an error)."""
    created = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ValueError(
                f"{flag} {folder!r} is being written by another prepare ({holder}, lock {path}); wait for it to end, "
                f"or give another {flag}."
            ) from None
        try:  # a holder that ended removed the file after we opened it: lock the new one instead
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    failed = True
    try:
        yield
        failed = False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        os.close(fd)
        if failed and created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only if empty: nothing was written


def _holder(fd):
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {data['pid']} on {data['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process starting"
