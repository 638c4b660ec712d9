"""Checks that a checkpoint folder is a complete save before it is loaded or resumed, shared by both models'
training code: a truncated or corrupt file raises `CheckpointError` naming the file instead of a deep load error.

`check_resume_config` refuses to resume a checkpoint with flags that build another model config, `check_resume_data`
one with flags that build other data, and `finished_run` says when a resumed checkpoint is already the end of its run.

`Trainer` writes a checkpoint in place, file by file (weights, optimizer, scheduler, RNG states, `trainer_state.json`
last), so a run killed during a save leaves a `checkpoint-N` folder that is incomplete. `resolve_resume` makes
`--resume_from_checkpoint last` take the newest checkpoint that passes `check_checkpoint`, logging a warning for each
newer one it skips, so a run killed at any point resumes from its last good checkpoint.

The run's folder (its lock, the claim on it, the final save) is `looped_training.run_folder`'s; what ends a run in one
line (a full disk, a refused write, Ctrl-C) is `looped_training.failures`'.
"""

import glob
import json
import logging
import os
import re
import struct
import zipfile

from huggingface_hub.errors import StrictDataclassError
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, truncated or corrupt."""


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


def checkpoint_steps(output_dir):
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
    found = checkpoint_steps(output_dir)
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
