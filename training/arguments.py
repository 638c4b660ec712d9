"""Command lines of the training entry points, as transformers' examples: `HfArgumentParser` dataclasses with
underscore flags, and a JSON or YAML file of the same keys (`training/configs/`), given as `--config FILE` or as the first
argument. The file is read with `HfArgumentParser.parse_json_file` / `parse_yaml_file`, which reject a key no
dataclass has; a flag on the command line overrides the file's value.

    python -m looped_training.fprm.train my-s5.yaml --max_steps 500
    python -m looped_training.loopformer.train --config my-run.yaml --output_dir runs/lf
    python -m looped_training.loopformer.train --preset synthetic-tiny      # a shipped file, by name
"""

import errno
import json
import os
import sys

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


# errno of an OSError that is the user's to fix (a full disk, a folder the run may not write), and the exit status
USER_ERRNOS = {errno.ENOSPC: 1, errno.EACCES: 2, errno.EPERM: 2, errno.EROFS: 2}
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


def run_command(main, prog):
    """Run a command's `main()`: a user error (`ValueError`, which `CheckpointError` is, a model config's refused value,
    huggingface_hub's `StrictDataclassError`, or a folder it may not write,
    `NotWritableError`) prints one line and exits 2, as argparse does for a bad flag; a full disk (`DiskFullError`,
    errno ENOSPC) prints one line and exits 1; Ctrl-C prints one line (what the run saved, `RunInterrupted`) and
    exits 130. LOOPED_TRAINING_TRACEBACK=1 shows the traceback instead."""
    traceback = os.environ.get("LOOPED_TRAINING_TRACEBACK") == "1"
    try:
        return main()
    except KeyboardInterrupt as err:
        if traceback:
            raise
        print(f"{prog}: {err or 'interrupted'}", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except (ValueError, StrictDataclassError, OSError) as err:  # StrictDataclassError: a config's refused value
        status = USER_ERRNOS.get(err.errno) if isinstance(err, OSError) else 2
        if traceback or status is None:
            raise
        print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
        sys.exit(status)


def _one_line(err):
    """The message of `err`: an OSError's own sentence (this package's name their file in it), with the file added
    where it does not ("Permission denied: path")."""
    if isinstance(err, StrictDataclassError):
        from looped_training.checkpoints import first_line  # an error path: transformers is loaded by then

        return first_line(err)
    if not isinstance(err, OSError) or not err.strerror:
        return str(err)
    file = err.filename
    return err.strerror if file is None or os.fspath(file) in err.strerror else f"{err.strerror}: {file}"
