"""`python -m looped_training.configs [KIND NAME]`: with a kind and a name, print the shipped file's path (for
`accelerate launch --config_file`); with a kind, its names; with nothing, every kind and its names."""

import sys

from looped_training.configs import KINDS, config_names, config_path

PROG = "python -m looped_training.configs"


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if len(args) > 2:
        raise ValueError(f"usage: {PROG} [KIND [NAME]] with KIND one of {KINDS}; got {' '.join(args)!r}.")
    if len(args) == 2:
        print(config_path(*args, what=f"NAME (a shipped {args[0]} config)"))
    elif len(args) == 1:
        print("\n".join(config_names(args[0])))
    else:
        for kind in KINDS:
            print(f"{kind}: {' '.join(config_names(kind))}")


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, PROG)
