"""The YAML files shipped with the package, found by name so that no command needs a path into site-packages:
training presets (`loopformer/NAME.yaml`, `fprm/NAME.yaml`: `--preset NAME` of the training commands) and
accelerate launcher configs (`accelerate/NAME.yaml`).

    python -m looped_training.configs                     # every shipped file, by kind and name
    python -m looped_training.configs accelerate ddp      # the path of accelerate/ddp.yaml, for --config_file
    accelerate launch --config_file "$(python -m looped_training.configs accelerate ddp)" \
        -m looped_training.loopformer.train --preset synthetic-tiny
"""

import os

CONFIGS_DIR = os.path.dirname(os.path.abspath(__file__))
KINDS = ("loopformer", "fprm", "accelerate")


def config_names(kind):
    """The names of the shipped `kind` files (file names without .yaml), sorted."""
    if kind not in KINDS:
        raise ValueError(f"The kind of config must be one of {KINDS}, got {kind!r}.")
    folder = os.path.join(CONFIGS_DIR, kind)
    return sorted(name[: -len(".yaml")] for name in os.listdir(folder) if name.endswith(".yaml"))


def config_path(kind, name, what=None):
    """The absolute path of the shipped file `kind/name.yaml`; an unknown name is a ValueError listing the names, which
    calls it `what` (default: `--preset`, the flag that names a training preset)."""
    names = config_names(kind)
    if name not in names:
        flag = what or ("`--preset`" if kind != "accelerate" else "The accelerate config")
        raise ValueError(f"{flag} must be one of {names}, got {name!r}.")
    return os.path.join(CONFIGS_DIR, kind, f"{name}.yaml")


def find_preset(argv):
    """The NAME of `--preset NAME` / `--preset=NAME` in `argv`, or None."""
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--preset="):
            return arg.split("=", 1)[1]
    return None


def with_preset(argv, kind):
    """`argv` with `--config <the preset's file>` in front when it names `--preset NAME` (the flag stays, so that the
    run records its preset); flags given after it override the preset's values, as with `--config`."""
    argv = list(argv)
    preset = find_preset(argv)
    if preset is None:
        return argv
    return ["--config", config_path(kind, preset), *argv]
