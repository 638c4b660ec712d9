"""What every area of the bad-input registry (tests/support/bad_input_table.py) builds its rows with: the row types
(`Case`, `Handled`), config rows (`refused_setting`, `field_error`), command lines run in-process or as `python -m`
runs them (`cli`, `command`), and files and folders a row breaks."""

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from huggingface_hub.errors import StrictDataclassError


@dataclass
class Case:
    area: str  # the model, config or command the input goes to
    given: str  # the input, as a user writes it
    run: Callable  # run(tmp: Path) must raise `error`
    error: type
    message: str  # regex the message must match (searched)
    setting: tuple | None = None  # (field, value) of a config row that must hold however the value arrives
    command: bool = True  # a row of a command's area that runs its command line (False: a function it calls)


@dataclass
class Handled:
    area: str
    given: str  # the input or fault
    outcome: str  # what happens instead of an error
    test: str  # "tests/FILE.py::test_name", the test that asserts it


def refused_setting(area, make_config, field, value, message):
    """A config row: `make_config(field=value)` raises huggingface_hub's strict-dataclass error (as transformers'
    configs do: a field's own rule, or a rule between fields) matching `message`."""
    return Case(
        area,
        f"{field}={value!r}",
        lambda t: make_config(**{field: value}),
        StrictDataclassError,
        message,
        setting=(field, value),
    )


def field_error(field, rule):
    """The message of a field's refused value: huggingface_hub names the field, then the rule and the value."""
    return rf"(?s)field '{field}'.*{rule}"


# set while tests/test_bad_inputs.py runs the rows of `cli` as `python -m` (`AS_COMMAND`); the modules so run
AS_COMMAND, RAN_AS_COMMAND = [], []


def cli(module):
    """run(tmp) of a command line: its `main(argv)` called in-process; `{tmp}` in an argument is the case's folder.
    A nonzero status that `main` returns is raised as SystemExit, as `python -m` (`sys.exit(main())`) does. While
    `AS_COMMAND` is set, the command line runs as a user runs it (`run_as_command`)."""

    def make(*argv):
        def run(tmp):
            import importlib

            args = [a.replace("{tmp}", str(tmp)) for a in argv]
            if AS_COMMAND:
                RAN_AS_COMMAND.append(module)
                return run_as_command(module, args)
            main = importlib.import_module(module).main
            status = main(args)
            if isinstance(status, int) and status:
                raise SystemExit(status)

        return run

    return make


def run_as_command(module, argv, missing=()):
    """`python -m MODULE ARGV` in this process: the module run as `__main__` (its `run_command`: the one rule of every
    command), its exit status raised as SystemExit. `missing`: optional packages made unimportable for the run."""
    import runpy
    import warnings

    hidden = {name: sys.modules[name] for name in list(sys.modules) if name.split(".")[0] in missing}
    unimportable = set(hidden) | set(missing)
    saved_argv, sys.argv = sys.argv, [module, *argv]
    sys.modules.update(dict.fromkeys(unimportable))  # None: its import raises ModuleNotFoundError
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" (imported by the tests)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
        for name in unimportable:
            sys.modules.pop(name, None)
        sys.modules.update(hidden)


def command(module, missing=()):
    """run(tmp) of `python -m MODULE ARGV` as a user runs it (`run_as_command`); `{tmp}` as in `cli`."""

    def make(*argv):
        return lambda tmp: run_as_command(module, [a.replace("{tmp}", str(tmp)) for a in argv], missing)

    return make


def file_in(tmp, name, content=b"x"):
    path = Path(tmp) / name
    path.write_bytes(content)
    return path


def _truncated(file):
    """`file` cut to half its size, as an interrupted download leaves it."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return file


# Linux capabilities by which root writes where the permission bits say no: CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH,
# CAP_FOWNER (the ones `setpriv --bounding-set -dac_override,-dac_read_search,-fowner` takes from a new process)
ROOT_OVERRIDES = (1 << 1) | (1 << 2) | (1 << 3)


@contextlib.contextmanager
def without_root_override():
    """Run the block as a user without root's override of permission bits: this thread's effective capabilities
    lose `ROOT_OVERRIDES` until it ends (capget/capset, per thread and reversible; a user who is not root has none)."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    effective = data[0].effective
    data[0].effective &= ~ROOT_OVERRIDES
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    try:
        yield
    finally:
        data[0].effective = effective
        libc.capset(ctypes.byref(header), data)


@contextlib.contextmanager
def read_only(folder):
    """`folder` with mode 555 for the block, as a user without root's override (its mode is restored after)."""
    folder.chmod(0o555)
    try:
        with without_root_override():
            yield folder
    finally:
        folder.chmod(0o755)


LF, FP = "LoopFormer", "FPRM"


def under_a_file(tmp, name):
    """A path `name` under a regular file (NotADirectoryError where it is created)."""
    return str(file_in(tmp, "taken") / name)
