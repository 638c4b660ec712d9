"""What LoopFormer's and FPRM's `prepare` commands share: `folder_lock`, one writer at a time in the folder a command
builds, and `check_text_file`, the refusal in one line of a source file that is not UTF-8 text.

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


def check_text_file(path, chunk=1 << 22):
    """Refuse a text file that is not UTF-8 text (a binary file: NUL bytes, or bytes UTF-8 does not decode) in one
    line naming it and the offset, before any long work. Read in chunks: memory flat in the file's size."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(path, "rb") as f:
            while True:
                data = f.read(chunk)
                nul = data.find(b"\0")
                if nul >= 0:
                    raise ValueError(
                        f"{path} holds a NUL byte at byte {offset + nul}: a binary file, not UTF-8 text; "
                        f"leave it out of the corpus."
                    )
                pending = len(decoder.getstate()[0])  # bytes of a character the last chunk began
                try:
                    decoder.decode(data, final=not data)
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{path} is not UTF-8 text (byte {offset - pending + e.start} does not decode: {e.reason}); "
                        f"convert it "
                        f"to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out of the corpus."
                    ) from None
                if not data:
                    return
                offset += len(data)
    except PermissionError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror}).") from None
