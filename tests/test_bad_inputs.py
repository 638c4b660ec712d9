"""Every row of the bad-input registry (tests/support/bad_input_table.py) raises the error it names, every row of a
command's table is one line and exit status 2 as a user runs it (`python -m ...`), and docs/bad_inputs.md is the
table the registry renders."""

import re

import pytest

from support.bad_input_table import AS_COMMAND, CASES, DOC, HANDLED, RAN_AS_COMMAND, REPO, raise_of, render

# the commands' areas in the registry: every `python -m looped_training…`, `loopformer_hf…`, `fprm_hf…` command
COMMANDS = (
    "loopformer.train",
    "loopformer.evaluate",
    "loopformer.prepare",
    "loopformer.lm_eval",
    "fprm.train",
    "fprm.evaluate",
    "fprm.evaluate_authors",
    "finetune_lora",
    "publish",
    "configs",
    "loopformer_hf.convert_authors",
    "fprm_hf.convert_authors",
)
COMMAND_CASES = [c for c in CASES if c.area in COMMANDS and c.command]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.area}: {c.given}" for c in CASES])
def test_bad_input_raises_the_error_it_names(case, tmp_path):
    error, message = raise_of(case, tmp_path)
    assert error is not None, f"{case.area} {case.given}: no error raised"
    assert isinstance(error, case.error), f"{case.area} {case.given}: {type(error).__name__}: {message}"
    assert re.search(case.message, message), f"{case.area} {case.given}: {message!r} !~ {case.message!r}"


@pytest.mark.parametrize("case", COMMAND_CASES, ids=[f"{c.area}: {c.given}" for c in COMMAND_CASES])
def test_every_command_answers_a_mistake_in_one_line_with_exit_status_2(case, tmp_path):
    """The rule of every command (issue 64): run as `python -m` runs it (its `run_command`), the row ends with exit
    status 2 and its message as the last line of stderr, no traceback, before any long work."""
    import contextlib
    import io

    err = io.StringIO()
    AS_COMMAND.append(True)
    RAN_AS_COMMAND.clear()
    try:
        with contextlib.redirect_stderr(err):
            case.run(tmp_path)
    except SystemExit as exit:
        status = exit.code
    else:
        status = 0
    finally:
        AS_COMMAND.clear()
    text = err.getvalue()
    assert case.error is SystemExit or RAN_AS_COMMAND, f"{case.area} {case.given}: the row runs no command line"
    assert "Traceback" not in text, text[-3000:]
    assert status == 2, f"{case.area} {case.given}: exit status {status}: {text[-2000:]}"
    last = text.strip().splitlines()[-1]
    assert re.search(r"error: ", last) and re.search(case.message, last), f"{last!r} !~ {case.message!r}"


@pytest.mark.parametrize("row", HANDLED, ids=[f"{h.area}: {h.given}" for h in HANDLED])
def test_each_handled_row_names_a_test_that_exists(row):
    path, name = row.test.split("::")
    assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M), f"{row.test} does not exist"


def test_docs_table_is_up_to_date():
    assert DOC.read_text() == render(), "docs/bad_inputs.md is stale: run `python -m tests.support.bad_input_table`"
