"""What ends a run inside its locked `output_dir` (`looped_training.run_folder.output_dir_lock`), as one line that
names the checkpoint a resume will start from: a disk that fills during a save (torch's writer says only "unexpected
pos" or "basic_ios::clear") as a `DiskFullError` naming the file and the free space, an `output_dir` the run may not
write as a `NotWritableError`, Ctrl-C as `RunInterrupted`. The command-line entry points print each as one line
(`looped_training.arguments.run_command`)."""

import contextlib
import errno
import os
import shutil

from looped_training.arguments import NotWritableError
from looped_training.checkpoints import last_complete_checkpoint, run_record


class DiskFullError(OSError):
    """The disk filled while a run wrote `filename` (errno ENOSPC). The command-line entry points print it as one
    line; the checkpoint being written is incomplete, and `--resume_from_checkpoint last` skips it."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a run; its message says what the run saved and how to go on. The command-line entry
    points print it as one line and exit 130."""


def inside(path, folder):
    """Whether `path` is `folder` or lies in it."""
    folder = os.path.realpath(folder)
    return os.path.commonpath([os.path.realpath(path), folder]) == folder


# torch's zip writer and its C++ streams report a failed write without the reason; safetensors says "os error 28"
_WRITE_FAILURES = ("unexpected pos", "basic_ios", "file write failed", "os error 28", "No space left on device")
_FULL_BYTES = 1 << 20  # a write failed and less than this is free: the disk is full


# the lock's module and this one: their frames' locals (the lock file's `path`) name no file being written
_OWN_MODULES = (__name__, "looped_training.run_folder")


def _file_being_written(tb):
    """The innermost path a frame of `tb` was writing (torch.save's `f`, safetensors' `filename`, ...), or None."""
    path = None
    while tb is not None:
        local = {} if tb.tb_frame.f_globals.get("__name__") in _OWN_MODULES else tb.tb_frame.f_locals
        for name in ("filename", "f", "dst", "path", "file", "save_path"):
            value = local.get(name)
            if isinstance(value, (str, os.PathLike)):
                path = os.fspath(value)
                break
        tb = tb.tb_next
    return path


def _is_disk_full(err, output_dir):
    for e in (err, err.__cause__, err.__context__):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
    if not any(text in str(err) for text in _WRITE_FAILURES):
        return False
    try:
        return shutil.disk_usage(output_dir).free < _FULL_BYTES
    except OSError:
        return False


def not_writable(err, message):
    """`NotWritableError` of the refused write `err` (an OSError), saying `message`."""
    return NotWritableError(err.errno, message, err.filename)


# errno of a write the file system refused: no permission, a read-only mount
REFUSED_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _what_a_resume_starts_from(output_dir):
    resume = last_complete_checkpoint(output_dir, warn=False)
    return f"the last complete checkpoint is {resume}" if resume else "no checkpoint is complete"


@contextlib.contextmanager
def ending_in_one_line(output_dir):
    """A run's end by a full disk, a refused write in `output_dir` or Ctrl-C as the error the entry points print in
    one line (`DiskFullError`, `NotWritableError`, `RunInterrupted`), naming the checkpoint a resume starts from."""
    try:
        yield
    except KeyboardInterrupt as err:
        if isinstance(err, RunInterrupted):
            raise
        resume, final = last_complete_checkpoint(output_dir, warn=False), run_record(output_dir)
        if resume:
            saved = (
                f"the last complete checkpoint is {resume}. Run the same command with --resume_from_checkpoint "
                f"last to go on from it"
            )
        elif final:  # a run without checkpoints, after its final save (FPRM: in its evaluation)
            saved = (
                f"the run's final model and {os.path.basename(final)} are in {output_dir}. Run the same command "
                f"with --resume_from_checkpoint last to write anything it had left to write (FPRM: the "
                f"evaluation's results.json), without training"
            )
        else:
            saved = "no checkpoint is complete, so there is nothing to resume: run the same command to start over"
        raise RunInterrupted(f"interrupted (Ctrl-C): {saved}.") from None
    except Exception as err:
        if isinstance(err, (DiskFullError, NotWritableError)):
            raise
        file = _file_being_written(err.__traceback__) or output_dir
        refused = isinstance(err, OSError) and err.errno in REFUSED_WRITE
        if refused and inside(err.filename or file, output_dir):  # not a file of the user's the run reads
            raise not_writable(
                err,
                f"A write in --output_dir {output_dir} was refused during the run "
                f"({err.strerror}: {err.filename or file}): "
                f"{_what_a_resume_starts_from(output_dir)}. Make it writable and run the same "
                f"command with --resume_from_checkpoint last",
            ) from err
        if not _is_disk_full(err, output_dir):
            raise
        free = shutil.disk_usage(output_dir).free
        raise DiskFullError(
            errno.ENOSPC,
            f"No space left on device while writing {file} ({free / 2**20:.1f} MiB free): that checkpoint is incomplete "
            f"and a resume skips it; {_what_a_resume_starts_from(output_dir)}. "
            f"Free space (or give an --output_dir on another disk) and run again with --resume_from_checkpoint last",
            file,
        ) from err
