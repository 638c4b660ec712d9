"""`python -m looped_training.fprm.evaluate_authors`: an authors' checkpoint on their test data (the folder their
dataset/build_sudoku_dataset.py writes, or the source CSV through `datasets`), and one puzzle solved.

The checkpoint is a small stand-in in their published layout (tests/support/fprm_reference_oracle.py); the data are
a few puzzles written in their formats here. The report is checked against the model's own forward run in the test."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fprm_hf import FPRMForReasoning
from looped_training.fprm.evaluate_authors import TASKS, main, solve
from support import REPO_ROOT
from support.fprm_reference_oracle import write_published_folder

# Sudoku-Extreme rows as in their CSV (question with '.', answer, rating): one real puzzle and variants of it
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


def _question(blanks, seed):
    rng = np.random.default_rng(seed)
    cells = list(SOLUTION)
    for i in rng.choice(81, size=blanks, replace=False):
        cells[i] = "."
    return "".join(cells)


ROWS = [(_question(b, s), SOLUTION, r) for s, (b, r) in enumerate([(30, 0), (45, 3), (55, 12), (60, 40), (20, 1)])]


CAP = ["--max_loops", "40"]  # random stand-in weights converge slowly; the report is checked at this cap


def their_encoding(text):
    """dataset/build_sudoku_dataset.py: '.' -> '0', digits as uint8, then + 1 (pad 0)."""
    return np.frombuffer(text.replace(".", "0").encode(), dtype=np.uint8).astype(np.int64) - ord("0") + 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fprm-published-small")
    write_published_folder(root / "sudoku", "sudoku", steps=(10,), hidden_size=64, num_heads=4, puzzle_emb_ndim=64)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Their builder's output folder and their source CSV, holding ROWS."""
    root = tmp_path_factory.mktemp("sudoku-data")
    test = root / "built" / "test"
    test.mkdir(parents=True)
    np.save(test / "all__inputs.npy", np.stack([their_encoding(q) for q, _, _ in ROWS]).astype(np.uint8))
    np.save(test / "all__labels.npy", np.stack([their_encoding(a) for _, a, _ in ROWS]).astype(np.uint8))
    np.save(test / "all__group_difficulties.npy", np.array([r for _, _, r in ROWS], dtype=np.int32))
    (test / "dataset.json").write_text(json.dumps({"seq_len": 81, "vocab_size": 11, "pad_id": 0}))
    csv = root / "test.csv"
    csv.write_text("source,question,answer,rating\n" + "".join(f"x,{q},{a},{r}\n" for q, a, r in ROWS))
    return root / "built", csv


def _expected(model, halt_scope=None, batch_size=64):
    ids = torch.tensor(np.stack([their_encoding(q) for q, _, _ in ROWS]))
    labels = torch.tensor(np.stack([their_encoding(a) for _, a, _ in ROWS]))
    generator = torch.Generator().manual_seed(0)
    outs = [
        model(ids[i : i + batch_size], halt_scope=halt_scope, generator=generator, max_loops=40)
        for i in range(0, len(ids), batch_size)
    ]
    preds = torch.cat([o.logits.argmax(-1) for o in outs])
    return dict(
        cell=float((preds == labels).float().mean()),
        exact=float((preds == labels).all(-1).float().mean()),
        iterations=torch.cat([o.iterations for o in outs]).tolist(),
    )


def test_the_built_folder_and_the_source_csv_give_the_report_of_the_models_forward(checkpoint, data, tmp_path, capsys):
    built, csv = data
    model = FPRMForReasoning.from_pretrained(checkpoint / "sudoku").eval()
    with torch.no_grad():
        want = _expected(model)
    for source in (["--data", str(built)], ["--dataset", str(csv)]):
        out = tmp_path / "report.json"
        assert main([str(checkpoint), "--subfolder", "sudoku", *source, *CAP, "--output", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["puzzles"] == 5 and report["step"] == 10 and report["halt_scope"] == "sample"
        assert report["cell_accuracy"] == pytest.approx(want["cell"]) and report["exact_accuracy"] == want["exact"]
        assert report["mean_iterations"] == pytest.approx(np.mean(want["iterations"]))
        assert sum(row["count"] for row in report["by_rating"]) == 5
        assert [row["count"] for row in report["by_blanks"]] == [1] * 5  # five distinct blank counts
        assert "Sudoku-Extreme exact accuracy 94.2%" in capsys.readouterr().out


def test_halt_scope_batch_runs_their_protocol(checkpoint, data, tmp_path):
    built, _ = data
    model = FPRMForReasoning.from_pretrained(checkpoint / "sudoku").eval()
    with torch.no_grad():
        want = _expected(model, halt_scope="batch", batch_size=2)
    out = tmp_path / "batch.json"
    assert (
        main(
            [
                str(checkpoint / "sudoku"),
                "--data",
                str(built / "test"),
                "--halt_scope",
                "batch",
                "--batch_size",
                "2",
                *CAP,
                "--output",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["halt_scope"] == "batch" and report["mean_iterations"] == pytest.approx(np.mean(want["iterations"]))
    assert want["iterations"][0] == want["iterations"][1] and want["iterations"][2] == want["iterations"][3]


def test_continuous_batching_gives_each_puzzle_its_per_sample_result(checkpoint, data, tmp_path):
    """`--batching continuous` (a halted puzzle's row taken by the next one, batch 2 over 5 puzzles) reports what
    per-sample halting does: each puzzle's z0 is drawn in puzzle order from the same seed."""
    built, _ = data
    model = FPRMForReasoning.from_pretrained(checkpoint / "sudoku").eval()
    with torch.no_grad():
        want = _expected(model)
    out = tmp_path / "continuous.json"
    argv = [str(checkpoint / "sudoku"), "--data", str(built), "--batching", "continuous", "--batch_size", "2", *CAP]
    assert main([*argv, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["batching"] == "continuous" and report["halt_scope"] == "sample"
    assert report["cell_accuracy"] == pytest.approx(want["cell"]) and report["exact_accuracy"] == want["exact"]
    assert report["mean_iterations"] == pytest.approx(np.mean(want["iterations"]))
    assert report["max_iterations"] == max(want["iterations"])


def test_solve_a_puzzle_string_and_the_cli(checkpoint):
    model = FPRMForReasoning.from_pretrained(checkpoint / "sudoku").eval()
    grid, iterations, converged = solve(model, ROWS[0][0], max_loops=40)
    ids = torch.tensor(their_encoding(ROWS[0][0]))[None]
    with torch.no_grad():
        out = model(ids, max_loops=40)
    assert grid == TASKS["sudoku"].decode(out.logits.argmax(-1)[0].tolist())
    assert (iterations, converged) == (int(out.iterations[0]), bool(out.converged[0]))
    assert len(grid) == 9 and all(len(row) == 9 for row in grid)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "looped_training.fprm.evaluate_authors",
            str(checkpoint / "sudoku"),
            "--puzzle",
            ROWS[0][0],
            *CAP,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[:9] == grid and f"iterations {iterations}, converged {converged}" in done.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--puzzle", "123"], r"a sudoku puzzle has 81 cells \(9x9\), got 3 in '123'"),
        (["--puzzle", "x" * 81], r"a sudoku puzzle uses the characters '0123456789', got \['x'\]"),
        (["--data", "{tmp}/nowhere"], r"--data .*nowhere: no .*all__inputs.npy"),
        (["--data", "{built}", "--num_test", "0"], r"--num_test must be >= 1, got 0"),
        (["--data", "{built}", "--step", "99"], r"has no step_99; its steps: \[10\]"),
        (
            ["--data", "{built}", "--batching", "continuous", "--halt_scope", "batch"],
            r"--batching continuous halts each puzzle on its own, --halt_scope batch the other way",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(checkpoint, data, tmp_path, capsys, args, message):
    import re

    args = [a.format(tmp=tmp_path, built=data[0]) for a in args]
    assert main([str(checkpoint / "sudoku"), *args, "--output", str(tmp_path / "r.json")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), errors
    assert not (tmp_path / "r.json").exists()


# ---- issue 64 ------------------------------------------------------------------------------------------------------


def test_an_output_in_a_folder_not_yet_there_is_created_and_the_report_written(checkpoint, data, tmp_path):
    # bug 1: FileNotFoundError after every puzzle was solved, and the report was lost
    out = tmp_path / "new" / "reports" / "r.json"
    assert main([str(checkpoint / "sudoku"), "--data", str(data[0]), *CAP, "--output", str(out)]) == 0
    assert json.loads(out.read_text())["puzzles"] == 5


def test_an_empty_rating_cell_leaves_every_rated_puzzle_in_the_by_rating_table(checkpoint, data, tmp_path):
    # bug 5: the NaN of the empty cell became a bin edge, and the top bin's puzzles were dropped without a word
    from looped_training.fprm.evaluate import by_difficulty

    csv = tmp_path / "test.csv"
    rated = [(q, a, r) for q, a, r in ROWS]
    csv.write_text(
        "source,question,answer,rating\n"
        + "".join(f"x,{q},{a},{'' if i == 2 else r}\n" for i, (q, a, r) in enumerate(rated))
    )
    out = tmp_path / "r.json"
    assert main([str(checkpoint / "sudoku"), "--dataset", str(csv), *CAP, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    ratings = [r for i, (_, _, r) in enumerate(rated) if i != 2]
    assert report["unrated"] == 1 and sum(row["count"] for row in report["by_rating"]) == 4
    assert [row["low"] for row in report["by_rating"]] == sorted(ratings)
    # the quantile bins (more distinct values than bins) hold every rated puzzle as well, as without the NaN
    values = np.array([*np.arange(20.0), np.nan])
    iterations, solved = torch.arange(21), torch.ones(21, dtype=torch.bool)
    rows = by_difficulty(values, iterations, solved)
    assert sum(row["count"] for row in rows) == 20
    assert rows == by_difficulty(values[:20], iterations[:20], solved[:20])
