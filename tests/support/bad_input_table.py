"""The bad-input registry: each row is an input a user may give (to a model, its config or a command line) and
the error it must raise, the one place a refusal is specified. The rows are written by area in tests/support/bad_inputs/
(`loopformer`, `fprm`, `commands`, `handled`; what they build rows with in `shared`) and assembled here, in the order
docs/bad_inputs.md lists them. tests/test_bad_inputs.py runs every row; a config row made with `refused_setting` is also
run however the value arrives (constructor, attribute set, config.json, `from_pretrained` kwargs, the Auto class) by
tests/fprm/test_fprm_conventions.py and tests/loopformer/test_loopformer_validation.py. `HANDLED` lists inputs and faults
that are not errors (what happens instead, and the test that shows it). This module renders both as
docs/bad_inputs.md, and a test fails when that file differs from what it would render:

    python -m tests.support.bad_input_table            # rewrite docs/bad_inputs.md
"""

import contextlib
import io
import os
import re
import sys
import tempfile
from pathlib import Path

# `support` and the tests' modules import alike under pytest and as `python -m tests.support.bad_input_table`
if (tests_dir := str(Path(__file__).resolve().parents[1])) not in sys.path:
    sys.path.insert(0, tests_dir)
from support import REPO_ROOT as REPO  # noqa: E402
from support.bad_inputs import commands as command_rows  # noqa: E402
from support.bad_inputs import corpora as corpus_rows  # noqa: E402
from support.bad_inputs import fprm as fprm_rows  # noqa: E402
from support.bad_inputs import loopformer as loopformer_rows  # noqa: E402
from support.bad_inputs.commands import (  # noqa: E402  (what tests of the commands run themselves)
    FPRM_TINY,
    FPRM_TRAIN,
    TRAIN,
    made_read_only_mid_run,
    train_unwritable,
)
from support.bad_inputs.handled import HANDLED as OTHER_HANDLED  # noqa: E402
from support.bad_inputs.loopformer import IDS, loopformer, loopformer_config  # noqa: E402
from support.bad_inputs.shared import AS_COMMAND, RAN_AS_COMMAND, Case, Handled, read_only  # noqa: E402

DOC = REPO / "docs" / "bad_inputs.md"

# each area's rows, then the weak rows of issue 64 (the published command's are among the commands'), as the table
# has always listed them
CASES = [
    *loopformer_rows.CASES,
    *fprm_rows.CASES,
    *command_rows.CASES,
    *fprm_rows.WEAK_ROWS,
    *loopformer_rows.WEAK_ROWS,
    *command_rows.OTHER_COMMANDS,
    *corpus_rows.CASES,
]
HANDLED = [*OTHER_HANDLED, *corpus_rows.HANDLED]


# ---- running a case and rendering the table ------------------------------------------------------------------------


def raise_of(case, tmp):
    """The exception `case.run(tmp)` raises (None if it returns) and its message; a command line's argparse error
    (SystemExit) is read from what it printed."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            case.run(Path(tmp))
    except BaseException as e:  # SystemExit included: argparse errors
        if isinstance(e, SystemExit):
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            return e, lines[-1] if lines else str(e.code)
        return e, str(e)
    return None, None


def clean(message, tmp):
    # argparse names the program by sys.argv[0] (pytest, this module, ...), run_command by `python -m NAME`: `error:` alone
    message = re.sub(r"^(python -m )?[\w.\-]+: error: ", "error: ", message)
    message = message.replace(os.path.realpath(tmp), "<tmp>").replace(str(tmp), "<tmp>")
    message = message.replace(str(REPO), "<repo>")  # the same table from any checkout
    message = " ".join(message.split())
    if len(message) > 220:
        message = message[:217] + "..."
    return message.replace("|", "\\|")


def render():
    rows = [
        "# Bad inputs and the errors they raise",
        "",
        "Generated from the registry in tests/support/bad_input_table.py (`python -m tests.support.bad_input_table`); "
        "tests/test_bad_inputs.py runs every row and fails when this file is out of date. Messages are "
        "shortened to 220 characters; `<tmp>` stands for the folder a case ran in, `<repo>` for the checkout. A config row holds however "
        "the value arrives: the constructor, an attribute set (the old value is kept), config.json, "
        "`from_pretrained` kwargs and the Auto class (tests/fprm/test_fprm_conventions.py, "
        "tests/loopformer/test_loopformer_validation.py).",
        "",
        "| where | input | error | message |",
        "|---|---|---|---|",
    ]
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            error, message = raise_of(case, tmp)
            name = "(none)" if error is None else type(error).__name__
            if isinstance(error, SystemExit):
                name = f"SystemExit({error.code})"
            rows.append(f"| {case.area} | `{case.given}` | {name} | {clean(message or '', tmp)} |")
    rows += [
        "",
        "## Inputs and faults handled without an error",
        "",
        "| where | input or fault | what happens | test |",
        "|---|---|---|---|",
    ]
    rows += [f"| {h.area} | {h.given} | {h.outcome} | `{h.test}` |" for h in HANDLED]
    return "\n".join(rows) + "\n"


def main():
    DOC.write_text(render())
    print("wrote", DOC)


__all__ = [
    "AS_COMMAND",
    "CASES",
    "DOC",
    "FPRM_TINY",
    "FPRM_TRAIN",
    "HANDLED",
    "IDS",
    "RAN_AS_COMMAND",
    "REPO",
    "TRAIN",
    "Case",
    "Handled",
    "loopformer",
    "loopformer_config",
    "made_read_only_mid_run",
    "raise_of",
    "read_only",
    "render",
    "train_unwritable",
]


if __name__ == "__main__":
    main()
