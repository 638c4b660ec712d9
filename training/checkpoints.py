"""Checks that a checkpoint folder is a complete save before it is loaded or resumed, shared by both models'
training code: a truncated or corrupt file raises `CheckpointError` naming the file instead of a deep load error.

`check_resume_config` refuses to resume a checkpoint with flags that build another model config.

`output_dir_lock` keeps a second run from writing into the `output_dir` of a live one, `claim_output_dir` keeps a new
run from training over a saved one (unless `--overwrite_output_dir`, a field of this module's `TrainingArguments`),
and `finished_run` says when a resumed checkpoint is already the end of its run.
What ends a run inside the lock ends it in one line that names the checkpoint a resume will start from: a disk that
fills during a save (torch's writer says only "unexpected pos" or "basic_ios::clear") as a `DiskFullError` naming the
file and the free space, an `output_dir` the run may not write as a `NotWritableError`, Ctrl-C as `RunInterrupted`.

`Trainer` writes a checkpoint in place, file by file (weights, optimizer, scheduler, RNG states, `trainer_state.json`
last), so a run killed during a save leaves a `checkpoint-N` folder that is incomplete. `resolve_resume` makes
`--resume_from_checkpoint last` take the newest checkpoint that passes `check_checkpoint`, logging a warning for each
newer one it skips, so a run killed at any point resumes from its last good checkpoint.
"""

import contextlib
import errno
import glob
import json
import logging
import os
import re
import shutil
import socket
import struct
import time
import zipfile
from dataclasses import dataclass, field

import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from looped_training.arguments import NotWritableError, check_output_path  # noqa: F401  (NotWritableError: its home)

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, truncated or corrupt."""


class DiskFullError(OSError):
    """The disk filled while a run wrote `filename` (errno ENOSPC). The command-line entry points print it as one
    line; the checkpoint being written is incomplete, and `--resume_from_checkpoint last` skips it."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a run; its message says what the run saved and how to go on. The command-line entry
    points print it as one line and exit 130."""


def _check_safetensors(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): not a safetensors file.")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(
                f"{path} is truncated or corrupt: header of {header_len} bytes in a {size}-byte file."
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CheckpointError(f"{path} is corrupt: its safetensors header is not valid JSON ({e}).") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        raise CheckpointError(
            f"{path} is truncated or corrupt: the header describes {8 + header_len + end} bytes, the file has {size}."
        )


def _check_json(file, missing_message):
    """Raise `CheckpointError` if `file` is missing (with `missing_message`) or not valid JSON (naming it)."""
    try:
        with open(file) as f:
            json.load(f)
    except FileNotFoundError:
        raise CheckpointError(missing_message) from None
    except ValueError as e:
        raise CheckpointError(f"{file} is corrupt: {e}.") from None


def check_checkpoint(path, for_resume=False):
    """Raise `CheckpointError` naming the file if `path` is not a complete model (and, `for_resume`, trainer) save."""
    if not os.path.isdir(path):
        raise CheckpointError(f"Checkpoint {path!r} is not a folder.")
    _check_json(os.path.join(path, "config.json"), f"Checkpoint {path!r} has no config.json.")
    weights = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    if not weights and not os.path.exists(os.path.join(path, "pytorch_model.bin")):
        raise CheckpointError(f"Checkpoint {path!r} holds no weights (model.safetensors).")
    for name in weights:
        _check_safetensors(os.path.join(path, name))
    if for_resume:
        _check_json(
            os.path.join(path, "trainer_state.json"),
            f"{path!r} is not a Trainer checkpoint: it has no trainer_state.json.",
        )
        # the run's record (loopformer_training.json, fprm_run.json), the tokenizer's files: a resume reads each
        for name in sorted(n for n in os.listdir(path) if n.endswith(".json")):
            _check_json(os.path.join(path, name), None)
        for name in ("optimizer.pt", "scheduler.pt"):
            if not os.path.exists(os.path.join(path, name)):
                raise CheckpointError(f"Trainer checkpoint {path!r} lacks {name}; it cannot be resumed exactly.")
        # the RNG states (one per process) and the AMP scaler are optional for Trainer, but one that is there must load
        optional = sorted(n for n in os.listdir(path) if re.fullmatch(r"rng_state(_\d+)?\.pth|scaler\.pt", n))
        for name in ("optimizer.pt", "scheduler.pt", *optional):
            _check_torch_file(os.path.join(path, name))


def load_model(model_class, checkpoint, **kwargs):
    """`model_class.from_pretrained(checkpoint, **kwargs)`, refusing weights that do not fit the config: a tensor the
    config needs that the weights lack, or one of another shape, is a `CheckpointError` naming the files and the
    tensor, where transformers initialises it at random and only logs it (a model that evaluates, resumes or publishes
    as if trained)."""
    import transformers

    weights = ", ".join(sorted(glob.glob(os.path.join(glob.escape(str(checkpoint)), "*.safetensors")))) or checkpoint
    config_file = os.path.join(checkpoint, "config.json")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report would repeat, in a table, what the error says
    try:
        model, info = model_class.from_pretrained(
            checkpoint, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
    except (OSError, RuntimeError, ValueError, StrictDataclassError) as err:  # a value the config refuses, a bad file
        raise CheckpointError(f"{weights} could not be loaded with {config_file}: {first_line(err)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    if mismatched := sorted(info.get("mismatched_keys") or []):
        name, in_file, in_config = mismatched[0]
        raise CheckpointError(
            f"{weights} does not fit {config_file}: {len(mismatched)} tensor(s) differ in shape, "
            f"e.g. {name} is {list(in_file)} in the weights and {list(in_config)} by the config."
        )
    if missing := sorted(info.get("missing_keys") or []):
        raise CheckpointError(
            f"{weights} lacks {len(missing)} tensor(s) that {config_file} needs: "
            f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}."
        )
    return model


def first_line(err):
    """The first line of an exception's message, or its type name when the message is empty; a config's refused value
    (`StrictDataclassError`: "Validation error for field 'x':\n    ValueError: ...") whole, on one line."""
    if isinstance(err, StrictDataclassError):
        return " ".join(str(err).split())
    return (str(err).strip() or type(err).__name__).splitlines()[0]


def _check_torch_file(file):
    """A `torch.save` file is a zip archive: check its directory and every member's CRC without unpickling it (the RNG
    states hold numpy objects that `weights_only` loading refuses unless allow-listed)."""
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"{file} is truncated or corrupt ({type(e).__name__}: {e}).") from None
    if bad is not None:
        raise CheckpointError(f"{file} is corrupt: its member {bad} fails its CRC check.")


def _checkpoint_steps(output_dir):
    """{step: folder} of the `checkpoint-N` folders in `output_dir`."""
    pattern = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")
    found = {}
    for name in os.listdir(output_dir):
        match = pattern.fullmatch(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found[int(match.group(1))] = os.path.join(output_dir, name)
    return found


def last_complete_checkpoint(output_dir, warn=True):
    """The newest `checkpoint-N` folder of `output_dir` that `check_checkpoint(..., for_resume=True)` accepts, or None;
    each newer, incomplete one is skipped with a warning (`warn`) that names it and what is wrong."""
    if not os.path.isdir(output_dir):
        return None
    found = _checkpoint_steps(output_dir)
    for step in sorted(found, reverse=True):
        try:
            check_checkpoint(found[step], for_resume=True)
        except CheckpointError as e:
            if warn:
                logger.warning("Skipping incomplete checkpoint %s (a save that did not finish?): %s", found[step], e)
            continue
        return found[step]
    return None


def check_model_type(checkpoint, model_type):
    """Raise `ValueError` if `checkpoint`'s config.json is of another model type than `model_type` (an FPRM checkpoint
    given to the LoopFormer trainer), instead of a list of every field that differs or a missing tokenizer."""
    path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        saved = json.load(f).get("model_type")
    if saved != model_type:
        raise ValueError(
            f"{checkpoint} is a {saved!r} checkpoint (config.json model_type), not a {model_type!r} one: "
            f"give it to the {saved!r} model's trainer or evaluation, or give a {model_type!r} checkpoint "
            f"here."
        )


def resolve_resume(resume_from_checkpoint, output_dir, model_type):
    """The checkpoint a run resumes from, for `TrainingArguments.resume_from_checkpoint`: None (train from scratch),
    "last" (the newest complete checkpoint in `output_dir`, or None if there is none) or a path, which must be a
    complete checkpoint (else `CheckpointError` naming the bad file), of `model_type` (else `ValueError`)."""
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint == "last":
        resume = last_complete_checkpoint(output_dir)
        if resume is None:
            if run_record(output_dir) is not None:
                # a run saved without checkpoint-N (FPRM's default, --save_strategy no): its own record says whether
                # it is finished (`finished_run`); training from scratch would overwrite its model
                logger.info(
                    "No checkpoint in %s; it holds the record of a run (%s).", output_dir, run_record(output_dir)
                )
                return output_dir
            logger.warning(
                "No complete checkpoint in %s (an incomplete one is skipped, above): training from scratch.",
                output_dir,
            )
            return None
        logger.info("Resuming from %s.", resume)
    else:
        check_checkpoint(resume_from_checkpoint, for_resume=True)
        resume = resume_from_checkpoint
    check_model_type(resume, model_type)
    return resume


# the trainer state a run writes beside its final model, last of its final files (`save_final`)
RUN_RECORD = "trainer_state.json"
FINAL_STAGING = ".final-save"


def run_record(output_dir):
    """The path of the record a finished run wrote into `output_dir` itself (`trainer_state.json` beside its final
    model, or FPRM's `results.json` of earlier versions), or None."""
    for name in (RUN_RECORD, "results.json"):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            return path
    return None


def _step_and_epoch(folder):
    """(global_step, epoch) of a checkpoint's trainer_state.json or of a run's own record."""
    path = os.path.join(folder, RUN_RECORD)
    if not os.path.isfile(path):
        path = run_record(folder)
    with open(path) as f:
        state = json.load(f)
    if "global_step" not in state:  # FPRM's results.json
        epochs = [h["epoch"] for h in state.get("log_history", []) if h.get("epoch") is not None]
        return state["train_steps"], epochs[-1] if epochs else 0
    return state["global_step"], state.get("epoch") or 0


def finished_run(checkpoint, args, incomplete_save=None):
    """True (after logging a warning that says so) if `checkpoint` already ends the run `args` (`TrainingArguments`)
    asks for: `global_step` >= `--max_steps`, or (max_steps <= 0) `epoch` >= `--num_train_epochs`. Resuming it would
    train past the end: the Trainer takes one more step, the learning rate climbs again and `save_total_limit` rotates
    the finished checkpoint away.

    `checkpoint` may be the output_dir of a run saved without checkpoints (`resolve_resume` returns it): its own
    record counts, and if the run asks for more steps than it holds, `ValueError` (there is nothing to continue from,
    and training from scratch would overwrite the finished model). `incomplete_save`: the folder whose final save a
    kill interrupted, which the resume writes from `checkpoint` (the warning says so, not "nothing written")."""
    step, epoch = _step_and_epoch(checkpoint)
    if args.max_steps > 0:
        done = step >= args.max_steps
        goal = f"--max_steps {args.max_steps}"
    else:
        done = epoch >= args.num_train_epochs
        goal = f"--num_train_epochs {args.num_train_epochs}"
    if not done and not os.path.isfile(os.path.join(checkpoint, "optimizer.pt")):
        raise ValueError(
            f"{checkpoint} holds a finished run (step {step}, epoch {epoch:.2f}) and no checkpoint-N to continue it "
            f"from, and this run asks for {goal}: training would start from scratch and overwrite its model. Give "
            f"another --output_dir (with --save_strategy steps to keep checkpoints that a later run can continue), or "
            f"a {goal.split()[0]} the finished run already reached."
        )
    if not done:
        return False
    written = (
        "nothing written"
        if incomplete_save is None
        else f"but the final save in {incomplete_save} is incomplete (a run killed while writing it?): writing it "
        f"from this checkpoint"
    )
    logger.warning(
        "%s is the end of a finished run (step %d, epoch %.2f; this run asks for %s): nothing to train, "
        "%s. Raise %s to train further.",
        checkpoint,
        step,
        epoch,
        goal,
        written,
        goal.split()[0],
    )
    return True


def check_run_length(args):
    """Refuse `--max_steps 0` (`TrainingArguments`): the Trainer took one step and saved the model as a finished run
    of global_step 1, with exit 0."""
    if args.max_steps == 0:
        raise ValueError(
            "--max_steps 0 would train nothing (the Trainer took one step and saved it as a finished "
            "run): give --max_steps >= 1, or -1 (the default) to train --num_train_epochs."
        )


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' `TrainingArguments` (both trainers'), with the `--overwrite_output_dir` of transformers' example
    scripts, which transformers 5 removed from `TrainingArguments`: a training command refuses an `--output_dir` that
    holds a run unless it resumes it or this flag is given (`claim_output_dir`). No pinned memory without an
    accelerator."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train a new run in an --output_dir that holds one: the old run's checkpoint-N folders, final model and "
            "records are deleted first (without this flag such a folder is refused; --resume_from_checkpoint "
            "last continues its run)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        # before any work: a path under a file, or a new folder where none may be created (an existing read-only
        # one is the lock's to judge: a finished run resumed there writes nothing)
        check_output_path("--output_dir", self.output_dir, folder=True, existing_may_be_read_only=True)
        if self.device.type == "cpu":  # as transformers does for --use_cpu: torch warns that it pins nothing here
            self.dataloader_pin_memory = False


# what a run saves in its output_dir beside its checkpoint-N folders: its record and its final model (FPRM's in model/)
RUN_FILES = (RUN_RECORD, "results.json", "config.json", "model.safetensors", "model")


def _inside(path, folder):
    """Whether `path` is `folder` or lies in it."""
    folder = os.path.realpath(folder)
    return os.path.commonpath([os.path.realpath(path), folder]) == folder


def saved_run(output_dir):
    """The names of what a run saved in `output_dir` (`RUN_FILES`, then its checkpoint-N folders by step), [] if
    nothing."""
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in RUN_FILES if os.path.exists(os.path.join(output_dir, n))]
    return names + [os.path.basename(folder) for _, folder in sorted(_checkpoint_steps(output_dir).items())]


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
    resumes_it = args.resume_from_checkpoint == "last" or (resume is not None and _inside(resume, output_dir))
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
        raise _not_writable(
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
            if err.errno not in _REFUSED_WRITE:
                raise
            # nothing to lock against: no run can write there either
            yield _not_writable(
                err,
                f"--output_dir {output_dir} is not writable ({err.strerror}: {path}); make it "
                f"writable (chmod u+w {output_dir}) or give another --output_dir",
            )
            return
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    try:
        with _released_on_sigterm(), _ending_in_one_line(output_dir):
            yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                if json.load(f) == me:
                    os.remove(path)


# torch's zip writer and its C++ streams report a failed write without the reason; safetensors says "os error 28"
_WRITE_FAILURES = ("unexpected pos", "basic_ios", "file write failed", "os error 28", "No space left on device")
_FULL_BYTES = 1 << 20  # a write failed and less than this is free: the disk is full


def _file_being_written(tb):
    """The innermost path a frame of `tb` was writing (torch.save's `f`, safetensors' `filename`, ...), or None."""
    path = None
    while tb is not None:
        local = {} if tb.tb_frame.f_code.co_filename == __file__ else tb.tb_frame.f_locals
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


def _not_writable(err, message):
    """`NotWritableError` of the refused write `err` (an OSError), saying `message`."""
    return NotWritableError(err.errno, message, err.filename)


# errno of a write the file system refused: no permission, a read-only mount
_REFUSED_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _what_a_resume_starts_from(output_dir):
    resume = last_complete_checkpoint(output_dir, warn=False)
    return f"the last complete checkpoint is {resume}" if resume else "no checkpoint is complete"


@contextlib.contextmanager
def _ending_in_one_line(output_dir):
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
        refused = isinstance(err, OSError) and err.errno in _REFUSED_WRITE
        if refused and _inside(err.filename or file, output_dir):  # not a file of the user's the run reads
            raise _not_writable(
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


class RunRecordCallback(TrainerCallback):
    """Writes the run's record `record` (a dict: its data flags, ...) as `filename` into each checkpoint (under a
    temporary name, renamed when complete), so that a checkpoint can be evaluated or published on its own, and a
    resume can check its data flags (`check_resume_data`)."""

    def __init__(self, filename, record):
        self.filename, self.record = filename, record

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            path = os.path.join(folder, self.filename)
            with open(path + ".tmp", "w") as f:
                json.dump(self.record, f, indent=2)
            os.replace(path + ".tmp", path)


def check_resume_data(checkpoint, filename, data, free_flags=()):
    """A resumed run rebuilds its data from the flags: refuse flags (`--corpus_seed`, ...) that build other data
    than the `data` section of the checkpoint's record `filename` says it was trained on (but for `free_flags`); it
    would go on silently on other rows. A checkpoint without a record (of an earlier version) is not checked."""
    path = os.path.join(checkpoint, filename)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        saved = json.load(f).get("data", {})
    different = sorted(k for k in data if k not in free_flags and k in saved and saved[k] != data[k])
    if different:
        raise ValueError(
            f"The data flags of this run differ from those {checkpoint} was trained with ({filename}) in "
            f"{different} (e.g. --{different[0]}: {saved[different[0]]!r} there, {data[different[0]]!r} here): "
            f"resume with the data flags of the run that wrote it, or give another --output_dir to train on other "
            f"data."
        )


# config.json keys that training itself (the Trainer turns the cache off) or saving may change
RESUME_FREE_CONFIG_KEYS = ("transformers_version", "architectures", "use_cache", "dtype", "torch_dtype")


def check_resume_config(checkpoint, config, free_keys=RESUME_FREE_CONFIG_KEYS):
    """A resumed run rebuilds its model config from the flags: it must be the checkpoint's (but for `free_keys`), or
    the restored weights would meet other shapes (deep in `load_state_dict`), other modules (their weights dropped
    with a warning) or another solver or objective (silently). Raises `ValueError` naming the keys that differ."""
    saved = type(config).get_config_dict(checkpoint)[0]  # config.json, read without building a model
    built = json.loads(config.to_json_string())  # as config.json holds it (lists, not tuples)
    different = sorted(key for key, value in built.items() if key not in free_keys and saved.get(key) != value)
    if different:
        raise ValueError(
            f"The flags of this run build a model config that differs from {checkpoint}'s in {different} (e.g. "
            f"{different[0]}: {saved.get(different[0])!r} there, {built[different[0]]!r} here): "
            f"resume with the model and data flags of the run that wrote it."
        )
