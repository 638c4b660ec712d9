"""Every row of the bad-input registry (tests/support/bad_input_table.py) raises the error it names, and
docs/bad_inputs.md is the table the registry renders."""

import re

import pytest

from support.bad_input_table import CASES, DOC, HANDLED, REPO, raise_of, render


@pytest.mark.parametrize("case", CASES, ids=[f"{c.area}: {c.given}" for c in CASES])
def test_bad_input_raises_the_error_it_names(case, tmp_path):
    error, message = raise_of(case, tmp_path)
    assert error is not None, f"{case.area} {case.given}: no error raised"
    assert isinstance(error, case.error), f"{case.area} {case.given}: {type(error).__name__}: {message}"
    assert re.search(case.message, message), f"{case.area} {case.given}: {message!r} !~ {case.message!r}"


@pytest.mark.parametrize("row", HANDLED, ids=[f"{h.area}: {h.given}" for h in HANDLED])
def test_each_handled_row_names_a_test_that_exists(row):
    path, name = row.test.split("::")
    assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M), f"{row.test} does not exist"


def test_docs_table_is_up_to_date(monkeypatch):
    from loopformer_hf import halting_loopformer

    # the library's rules only, as `python -m tests.support.bad_input_table` renders them (the lab's tests register more)
    rules = {name: halting_loopformer.HALTING_RULES[name] for name in halting_loopformer.LIBRARY_HALT_CRITERIA}
    monkeypatch.setattr(halting_loopformer, "HALTING_RULES", rules)
    assert DOC.read_text() == render(), "docs/bad_inputs.md is stale: run `python -m tests.support.bad_input_table`"
