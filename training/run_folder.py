"""A run's `output_dir`: `output_dir_lock` keeps a second run from writing into the `output_dir` of a live one (and
releases the lock on SIGTERM), `claim_output_dir` keeps a new run from training over a saved one (unless
`--overwrite_output_dir`, a field of `looped_training.arguments.TrainingArguments`), and `start_final_save` /
`finish_final_save` move a run's final files in so that a kill at any point leaves each file whole. What ends a run
inside the lock ends it in one line (`looped_training.failures`)."""

import contextlib
import json
import logging
import os
import shutil
import socket
import time

from looped_training.checkpoints import RUN_RECORD, checkpoint_steps
from looped_training.failures import REFUSED_WRITE, ending_in_one_line, inside, not_writable

logger = logging.getLogger(__name__)

FINAL_STAGING = ".final-save"  # where a run writes its final files before `finish_final_save` moves them in


# what a run saves in its output_dir beside its checkpoint-N folders: its record and its final model (FPRM's in model/)
RUN_FILES = (RUN_RECORD, "results.json", "config.json", "model.safetensors", "model")


def saved_run(output_dir):
    """The names of what a run saved in `output_dir` (`RUN_FILES`, then its checkpoint-N folders by step), [] if
    nothing."""
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in RUN_FILES if os.path.exists(os.path.join(output_dir, n))]
    return names + [os.path.basename(folder) for _, folder in sorted(checkpoint_steps(output_dir).items())]


def unfinished_records(output_dir, records):
    """The files of `records` (what a run writes after its final save: FPRM's results.json) that `output_dir` lacks
    although its final save is complete (its trainer_state.json, moved in last, is there): the run was stopped
    (Ctrl-C, SIGTERM, a crash) between the two, and `--resume_from_checkpoint last` writes them from the saved model.
    [] when there is no final save or nothing is missing."""
    if not os.path.isfile(os.path.join(output_dir, RUN_RECORD)):
        return []
    return [name for name in records if not os.path.exists(os.path.join(output_dir, name))]


def claim_output_dir(args, resume, after_final=()):
    """Refuse to train a new run into an `--output_dir` that holds a saved one (`TrainingArguments` `args`), as
    transformers' example scripts do: it would replace a finished model, overwrite checkpoints and leave the old
    run's later ones beside the new (a resume would take them). Allowed: a run that resumes this folder's run
    (`--resume_from_checkpoint last`, or `resume` a checkpoint inside it), or `--overwrite_output_dir`, which deletes
    the old run's files first (the main process), for that reason. `after_final`: the files the run writes after its
    final save (`unfinished_records`), which the refusal names when they are missing."""
    output_dir = args.output_dir
    if args.overwrite_output_dir and args.resume_from_checkpoint is not None:
        raise ValueError(
            f"--overwrite_output_dir (train a new run over {output_dir!r}) and --resume_from_checkpoint "
            f"{args.resume_from_checkpoint} (continue a run) do not combine: give one."
        )
    saved = saved_run(output_dir)
    resumes_it = args.resume_from_checkpoint == "last" or (resume is not None and inside(resume, output_dir))
    if not saved or resumes_it:
        return
    listed = ", ".join(saved[:6]) + (", ..." if len(saved) > 6 else "")
    if not args.overwrite_output_dir:
        missing = unfinished_records(output_dir, after_final)
        state, resume_does = (
            (
                f" that stopped after its final save, before writing {', '.join(missing)}",
                "to finish it (nothing is trained: what is missing is written from the saved model)",
            )
            if missing
            else ("", "to continue it (a finished run is then left as it is)")
        )
        raise ValueError(
            f"--output_dir {output_dir!r} already holds a run ({listed}){state}: a new run would train over it. Give "
            f"--resume_from_checkpoint last {resume_does}, --overwrite_output_dir to delete it and train a new run "
            f"there, or another --output_dir."
        )
    if args.should_save:
        logger.warning("--overwrite_output_dir: deleting the run in %s (%s).", output_dir, listed)
        for name in saved:
            path = os.path.join(output_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


def start_final_save(output_dir):
    """An empty staging folder inside `output_dir` for a run's final files (`finish_final_save` moves them in)."""
    staging = os.path.join(output_dir, FINAL_STAGING)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def finish_final_save(output_dir, last=(RUN_RECORD,)):
    """Move the files `start_final_save`'s folder holds into `output_dir`, one `os.replace` each (a folder replaces
    the old one by two renames): a run killed at any point leaves each file whole, old or new. The `last` files (the
    run's record) are removed first and moved in last, so `output_dir` holds a record only beside a whole final model;
    without it a resume finishes the save from the last checkpoint."""
    staging = os.path.join(output_dir, FINAL_STAGING)
    for name in last:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(output_dir, name))
    names = sorted(os.listdir(staging), key=lambda n: last.index(n) + 1 if n in last else 0)
    for name in names:
        source, target = os.path.join(staging, name), os.path.join(output_dir, name)
        if os.path.isdir(source):
            old = target + ".old"
            shutil.rmtree(old, ignore_errors=True)
            if os.path.exists(target):
                os.replace(target, old)
            os.replace(source, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(source, target)
    os.rmdir(staging)


LOCK_FILE = "training.lock"


def _holder_alive(holder):
    """Whether the process named in a lock file still runs (one of another host counts as alive: its pid says
    nothing here)."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


# a lock file that is empty or not JSON this long after it was made is a leftover (its writer writes it at once)
STALE_UNREADABLE_LOCK_S = 30


def _stale_lock(path, holder):
    """Why the lock at `path` (its content `holder`, {} if unreadable) is a leftover to take over, or None."""
    if holder:
        return None if _holder_alive(holder) else f"of process {holder['pid']}, which is gone (a killed run)"
    try:
        age = time.time() - os.path.getmtime(path)
    except OSError:
        return None
    if age >= STALE_UNREADABLE_LOCK_S:
        return f"that is empty or unreadable, written {age:.0f} s ago (a run killed while taking it?)"
    return None


@contextlib.contextmanager
def _released_on_sigterm():
    """SIGTERM (a scheduler's or `kill`'s) raises SystemExit(143) in the main thread, so that the `finally` clauses
    above release the lock instead of leaving it to the next run."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def output_dir_lock(output_dir, hold=True):
    """Hold `output_dir/training.lock` ({"pid", "host"}) while a run writes there (`hold`: only the main process of a
    distributed run takes it): two runs on one output_dir rotate away and overwrite each other's checkpoints. A lock
    of a live process (or of another host, whose pids say nothing here) raises `ValueError` naming its pid, host and
    file, and how to take it over; one of a dead process (a killed run) or an empty or unreadable one older than
    `STALE_UNREADABLE_LOCK_S` is taken over with a warning. The lock goes when the block ends, by an exception or a
    SIGTERM too. It yields None, or, where an existing output_dir may not be written (a read-only mount, no
    permission), the `NotWritableError` the run raises before it writes: resuming a finished run there writes nothing
    and ends as it would elsewhere."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir!r} is a file, not a folder: give a folder (new or of this run).")
    if not hold:
        yield None
        return
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        os.makedirs(output_dir, exist_ok=True)
    except PermissionError as err:
        raise not_writable(
            err,
            f"--output_dir {output_dir} cannot be created: {os.path.dirname(err.filename)} is not "
            f"writable ({err.strerror}); give an --output_dir in a folder you can write",
        ) from None
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    for attempt in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                with open(path) as f:
                    holder = json.load(f)
                if not isinstance(holder, dict) or "pid" not in holder:
                    holder = {}
            except (OSError, ValueError):
                holder = {}  # unreadable or half written: its writer is gone, or is writing it right now
            stale = _stale_lock(path, holder) if attempt == 0 else None
            if stale:
                logger.warning("Taking over %s %s.", path, stale)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                continue
            who = (
                f"process {holder['pid']} on {holder.get('host', '?')}"
                if holder
                else "a lock that is empty or unreadable, written just now"
            )
            raise ValueError(
                f"--output_dir {output_dir!r} is being written by another run ({who}, {path}): give another "
                f"--output_dir, or wait for that run to end. If it is gone (killed, or its machine stopped), delete "
                f"{path} to take the output_dir over; a lock of a process of this host that has ended is taken over "
                f"by itself."
            ) from None
        except OSError as err:
            if err.errno not in REFUSED_WRITE:
                raise
            # nothing to lock against: no run can write there either
            yield not_writable(
                err,
                f"--output_dir {output_dir} is not writable ({err.strerror}: {path}); make it "
                f"writable (chmod u+w {output_dir}) or give another --output_dir",
            )
            return
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    try:
        with _released_on_sigterm(), ending_in_one_line(output_dir):
            yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                if json.load(f) == me:
                    os.remove(path)
