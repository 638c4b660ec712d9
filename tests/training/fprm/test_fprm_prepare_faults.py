"""`python -m looped_training.fprm.prepare` (issue 70): the splits are built in a staging folder and moved in whole,
so a bad split, an error or a kill leaves `--output_dir` as it was and a rerun writes the bytes of an uninterrupted
build; a CSV that is binary, not UTF-8, header-less or header-only, or a rating that is not an integer, is answered
in one line naming the file (and the row)."""

import os

import pytest
from looped_training.fprm import prepare
from support import fprm_data_oracle as oracle


def folder_bytes(folder):
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = f.read()
    return found


@pytest.fixture
def sudoku(tmp_path):
    folder = tmp_path / "sudoku"
    folder.mkdir()
    oracle.write_csv(folder / "train.csv", oracle.sudoku_rows(8, seed=1))
    oracle.write_csv(folder / "test.csv", oracle.sudoku_rows(3, seed=2))
    return folder


def run(dataset, out, *flags):
    return prepare.main(["--dataset", str(dataset), "--output_dir", str(out), "--num_aug", "2", *flags])


def killed_at(k, dataset, out):
    """prepare in a forked child that dies by `os._exit` (a kill -9) at its k-th phase boundary."""
    pid = os.fork()
    if pid == 0:
        calls = []

        def die(name):
            calls.append(name)
            if len(calls) == k + 1:
                os._exit(9)

        prepare.phase = die
        try:
            run(dataset, out)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_kill_at_every_phase_boundary_then_a_rerun_gives_the_bytes_of_an_uninterrupted_build(
    sudoku, tmp_path, monkeypatch
):
    seen = []
    monkeypatch.setattr(prepare, "phase", seen.append)
    assert run(sudoku, tmp_path / "reference") == 0
    monkeypatch.undo()
    assert seen == ["built train", "built test", "moved train", "moved test", "moved identifiers.json"]
    reference = folder_bytes(tmp_path / "reference")
    assert "train/dataset.json" in reference and not any(n.startswith(".prepare") for n in reference)
    for k, name in enumerate(seen):
        out = tmp_path / f"killed{k}"
        assert killed_at(k, sudoku, out) == 9
        # a split folder is there whole (its dataset.json beside all its rows) or not at all
        for split in ("train", "test"):
            if (out / split).exists():
                assert folder_bytes(out / split) == {
                    n.split("/", 1)[1]: b for n, b in reference.items() if n.startswith(split + "/")
                }, name
        assert run(sudoku, out) == 0
        assert folder_bytes(out) == reference, f"killed after {name!r}"


def test_a_bad_test_csv_leaves_the_output_dir_as_it_was(sudoku, tmp_path, capsys):
    assert run(sudoku, tmp_path / "out") == 0
    before = folder_bytes(tmp_path / "out")
    (sudoku / "test.csv").write_text("source,question,answer,rating\ns,123,456,1\n")
    assert run(sudoku, tmp_path / "out", "--seed", "3", "--task", "sudoku") == 2
    assert "(test): row 0 has a question of 3 characters" in capsys.readouterr().err
    assert folder_bytes(tmp_path / "out") == before  # train/ was not rebuilt half-way, nothing staged is left
    assert run(sudoku, tmp_path / "new") == 2
    assert not (tmp_path / "new").exists()


PUZZLE, ANSWER = "." * 81, "1" * 81


@pytest.mark.parametrize(
    "content, message",
    [
        (
            f"s,{PUZZLE},{ANSWER},3\ns,{PUZZLE},{ANSWER},4\n".encode(),
            r"train\.csv has no header row: its first row is ",
        ),
        (b"\x7fELF\x02\x01\x01\x00\x00binary", r"train\.csv holds a NUL byte at byte 7: a binary file"),
        (b"source,question,answer,rating\ns,caf\xe9,x,1\n", r"train\.csv is not UTF-8 text \(byte 35 does not decode"),
        (b"source,question,answer,rating\n", r"train\.csv holds the header row and no puzzle: nothing to build"),
        (
            f"source,question,answer,rating\ns,{PUZZLE},{ANSWER},3\ns,{PUZZLE},{ANSWER},hard\n".encode(),
            r"\(train\): row 1 has the rating 'hard', not an integer",
        ),
    ],
    ids=["no-header", "binary", "latin-1", "header-only", "rating"],
)
def test_a_bad_csv_is_answered_in_one_line_naming_the_file_or_the_row(sudoku, tmp_path, capsys, content, message):
    import re

    (sudoku / "train.csv").write_bytes(content)
    assert run(sudoku, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, err[-1]), err[-1]
    assert "Traceback" not in "\n".join(err) and not (tmp_path / "out").exists()


def test_a_second_prepare_into_a_locked_folder_is_refused(sudoku, tmp_path, capsys):
    from looped_training.prepare_folder import folder_lock

    with folder_lock(str(tmp_path / "out")):
        assert run(sudoku, tmp_path / "out") == 2
    assert "is being written by another prepare" in capsys.readouterr().err
    assert run(sudoku, tmp_path / "out") == 0
