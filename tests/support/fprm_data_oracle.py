"""The authors' data code, re-implemented for the tests from their repository (nilskiKonjIzDunava/fprm:
dataset/build_sudoku_dataset.py, puzzle_dataset.py; their maze builder and dataset/common.py are TRM's, which their
README runs as dataset/build_maze_dataset.py): their builders over local CSV files (their `hf_hub_download` replaced
by a path, their unseeded global generator seeded by the caller), and their training and test loaders' order.
Independent of the package: it imports nothing of it.

Also source CSVs in the Hub datasets' columns (source, question, answer, rating), written from puzzles generated
here, since the Hub cannot be reached from the tests.
"""

import csv
import json
import math
import os

import numpy as np

# ---- dataset/common.py -----------------------------------------------------------------------------------------------

METADATA_FIELDS = (  # their PuzzleDatasetMetadata, in declaration order (pydantic's model_dump order)
    "pad_id",
    "ignore_label_id",
    "blank_identifier_id",
    "vocab_size",
    "seq_len",
    "num_puzzle_identifiers",
    "total_groups",
    "mean_puzzle_examples",
    "total_puzzles",
    "sets",
)


def metadata_dump(**values):
    out = {k: values[k] for k in METADATA_FIELDS}
    out["mean_puzzle_examples"] = float(out["mean_puzzle_examples"])  # a pydantic float field
    return out


def dihedral_transform(arr, tid):
    if tid == 0:
        return arr
    if tid == 1:
        return np.rot90(arr, k=1)
    if tid == 2:
        return np.rot90(arr, k=2)
    if tid == 3:
        return np.rot90(arr, k=3)
    if tid == 4:
        return np.fliplr(arr)
    if tid == 5:
        return np.flipud(arr)
    if tid == 6:
        return arr.T
    if tid == 7:
        return np.fliplr(np.rot90(arr, k=1))
    return arr


# ---- dataset/build_sudoku_dataset.py ---------------------------------------------------------------------------------


def shuffle_sudoku(board, solution):
    digit_map = np.pad(np.random.permutation(np.arange(1, 10)), (1, 0))
    transpose_flag = np.random.rand() < 0.5
    bands = np.random.permutation(3)
    row_perm = np.concatenate([b * 3 + np.random.permutation(3) for b in bands])
    stacks = np.random.permutation(3)
    col_perm = np.concatenate([s * 3 + np.random.permutation(3) for s in stacks])
    mapping = np.array([row_perm[i // 9] * 9 + col_perm[i % 9] for i in range(81)])

    def apply_transformation(x):
        if transpose_flag:
            x = x.T
        new_board = x.flatten()[mapping].reshape(9, 9).copy()
        return digit_map[new_board]

    return apply_transformation(board), apply_transformation(solution)


def build_sudoku(source_dir, output_dir, subsample_size=None, min_difficulty=None, num_aug=0):
    for set_name in ("train", "test"):
        inputs, labels, ratings = [], [], []
        with open(os.path.join(source_dir, f"{set_name}.csv"), newline="") as csvfile:
            reader = csv.reader(csvfile)
            next(reader)
            for source, q, a, rating in reader:
                if min_difficulty is None or int(rating) >= min_difficulty:
                    assert len(q) == 81 and len(a) == 81
                    inputs.append(np.frombuffer(q.replace(".", "0").encode(), dtype=np.uint8).reshape(9, 9) - ord("0"))
                    labels.append(np.frombuffer(a.encode(), dtype=np.uint8).reshape(9, 9) - ord("0"))
                    ratings.append(int(rating))
        if set_name == "train" and subsample_size is not None:
            total_samples = len(inputs)
            if subsample_size < total_samples:
                indices = np.random.choice(total_samples, size=subsample_size, replace=False)
                inputs = [inputs[i] for i in indices]
                labels = [labels[i] for i in indices]
                ratings = [ratings[i] for i in indices]
        num_augments = num_aug if set_name == "train" else 0
        results = {k: [] for k in ["inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices"]}
        group_difficulties = []
        puzzle_id = example_id = 0
        results["puzzle_indices"].append(0)
        results["group_indices"].append(0)
        for orig_inp, orig_out, rating in zip(inputs, labels, ratings):
            for aug_idx in range(1 + num_augments):
                if aug_idx == 0:
                    inp, out = orig_inp, orig_out
                else:
                    inp, out = shuffle_sudoku(orig_inp, orig_out)
                results["inputs"].append(inp)
                results["labels"].append(out)
                example_id += 1
                puzzle_id += 1
                results["puzzle_indices"].append(example_id)
                results["puzzle_identifiers"].append(0)
            results["group_indices"].append(puzzle_id)
            group_difficulties.append(int(rating))

        def _seq_to_numpy(seq):
            arr = np.concatenate(seq).reshape(len(seq), -1)
            assert np.all((arr >= 0) & (arr <= 9))
            return arr + 1

        results = {
            "inputs": _seq_to_numpy(results["inputs"]),
            "labels": _seq_to_numpy(results["labels"]),
            "group_indices": np.array(results["group_indices"], dtype=np.int32),
            "puzzle_indices": np.array(results["puzzle_indices"], dtype=np.int32),
            "puzzle_identifiers": np.array(results["puzzle_identifiers"], dtype=np.int32),
        }
        metadata = metadata_dump(
            seq_len=81,
            vocab_size=10 + 1,
            pad_id=0,
            ignore_label_id=0,
            blank_identifier_id=0,
            num_puzzle_identifiers=1,
            total_groups=len(results["group_indices"]) - 1,
            mean_puzzle_examples=1,
            total_puzzles=len(results["group_indices"]) - 1,
            sets=["all"],
        )
        save_dir = os.path.join(output_dir, set_name)
        os.makedirs(save_dir, exist_ok=True)
        with open(os.path.join(save_dir, "dataset.json"), "w") as f:
            json.dump(metadata, f)
        for k, v in results.items():
            np.save(os.path.join(save_dir, f"all__{k}.npy"), v)
        np.save(os.path.join(save_dir, "all__group_difficulties.npy"), np.array(group_difficulties, dtype=np.int32))
        with open(os.path.join(output_dir, "identifiers.json"), "w") as f:
            json.dump(["<blank>"], f)


# ---- dataset/build_maze_dataset.py (TRM's) ---------------------------------------------------------------------------

CHARSET = "# SGo"


def build_maze(source_dir, output_dir, subsample_size=None, aug=False):
    for set_name in ("train", "test"):
        all_chars = set()
        grid_size = None
        inputs, labels = [], []
        with open(os.path.join(source_dir, f"{set_name}.csv"), newline="") as csvfile:
            reader = csv.reader(csvfile)
            next(reader)
            for source, q, a, rating in reader:
                all_chars.update(q)
                all_chars.update(a)
                if grid_size is None:
                    n = int(len(q) ** 0.5)
                    grid_size = (n, n)
                inputs.append(np.frombuffer(q.encode(), dtype=np.uint8).reshape(grid_size))
                labels.append(np.frombuffer(a.encode(), dtype=np.uint8).reshape(grid_size))
        if set_name == "train" and subsample_size is not None:
            total_samples = len(inputs)
            if subsample_size < total_samples:
                indices = np.random.choice(total_samples, size=subsample_size, replace=False)
                inputs = [inputs[i] for i in indices]
                labels = [labels[i] for i in indices]
        results = {k: [] for k in ["inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices"]}
        puzzle_id = example_id = 0
        results["puzzle_indices"].append(0)
        results["group_indices"].append(0)
        for inp, out in zip(inputs, labels):
            for aug_idx in range(8 if (set_name == "train" and aug) else 1):
                results["inputs"].append(dihedral_transform(inp, aug_idx))
                results["labels"].append(dihedral_transform(out, aug_idx))
                example_id += 1
                puzzle_id += 1
                results["puzzle_indices"].append(example_id)
                results["puzzle_identifiers"].append(0)
            results["group_indices"].append(puzzle_id)
        assert len(all_chars - set(CHARSET)) == 0
        char2id = np.zeros(256, np.uint8)
        char2id[np.array(list(map(ord, CHARSET)))] = np.arange(len(CHARSET)) + 1

        def _seq_to_numpy(seq):
            return np.vstack([char2id[s.reshape(-1)] for s in seq])

        results = {
            "inputs": _seq_to_numpy(results["inputs"]),
            "labels": _seq_to_numpy(results["labels"]),
            "group_indices": np.array(results["group_indices"], dtype=np.int32),
            "puzzle_indices": np.array(results["puzzle_indices"], dtype=np.int32),
            "puzzle_identifiers": np.array(results["puzzle_identifiers"], dtype=np.int32),
        }
        metadata = metadata_dump(
            seq_len=int(math.prod(grid_size)),
            vocab_size=len(CHARSET) + 1,
            pad_id=0,
            ignore_label_id=0,
            blank_identifier_id=0,
            num_puzzle_identifiers=1,
            total_groups=len(results["group_indices"]) - 1,
            mean_puzzle_examples=1,
            total_puzzles=len(results["group_indices"]) - 1,
            sets=["all"],
        )
        save_dir = os.path.join(output_dir, set_name)
        os.makedirs(save_dir, exist_ok=True)
        with open(os.path.join(save_dir, "dataset.json"), "w") as f:
            json.dump(metadata, f)
        for k, v in results.items():
            np.save(os.path.join(save_dir, f"all__{k}.npy"), v)
        with open(os.path.join(output_dir, "identifiers.json"), "w") as f:
            json.dump(["<blank>"], f)


# ---- puzzle_dataset.py -----------------------------------------------------------------------------------------------


def _sample_batch(rng, group_order, puzzle_indices, group_indices, start_index, global_batch_size):
    batch, batch_puzzle_indices, current_size = [], [], 0
    while start_index < group_order.size and current_size < global_batch_size:
        group_id = group_order[start_index]
        puzzle_id = rng.integers(group_indices[group_id], group_indices[group_id + 1])
        start_index += 1
        puzzle_start = puzzle_indices[puzzle_id]
        puzzle_size = int(puzzle_indices[puzzle_id + 1] - puzzle_start)
        append_size = min(puzzle_size, global_batch_size - current_size)
        batch_puzzle_indices.append(np.full(append_size, puzzle_id, dtype=np.int32))
        batch.append(puzzle_start + np.random.choice(puzzle_size, append_size, replace=False))
        current_size += append_size
    return start_index, np.concatenate(batch), np.concatenate(batch_puzzle_indices)


def _load(folder, split):
    modes = {"inputs": "r", "labels": "r", "puzzle_identifiers": None, "puzzle_indices": None, "group_indices": None}
    return {k: np.load(os.path.join(folder, split, f"all__{k}.npy"), mmap_mode=m) for k, m in modes.items()}


def _collate(batch, ignore_label_id):
    batch = {k: v.astype(np.int32) for k, v in batch.items()}
    if ignore_label_id is not None:
        batch["labels"][batch["labels"] == ignore_label_id] = -100
    return batch


def train_batches(folder, seed, global_batch_size, epochs_per_iter, iters):
    """Their `_iter_train` for iterations 1..iters (one set, one rank): the list of batches (dicts of int32 arrays;
    the batches are full, the last short one dropped)."""
    with open(os.path.join(folder, "train", "dataset.json")) as f:
        meta = json.load(f)
    dataset = _load(folder, "train")
    out = []
    for it in range(1, iters + 1):
        rng = np.random.Generator(np.random.Philox(seed=seed + it))
        group_order = np.concatenate(
            [rng.permutation(dataset["group_indices"].size - 1) for _ in range(epochs_per_iter)]
        )
        start_index = 0
        while start_index < group_order.size:
            start_index, batch_indices, batch_puzzle_indices = _sample_batch(
                rng, group_order, dataset["puzzle_indices"], dataset["group_indices"], start_index, global_batch_size
            )
            if batch_puzzle_indices.size < global_batch_size:
                break
            out.append(
                _collate(
                    {
                        "inputs": dataset["inputs"][batch_indices],
                        "labels": dataset["labels"][batch_indices],
                        "puzzle_identifiers": dataset["puzzle_identifiers"][batch_puzzle_indices],
                    },
                    meta["ignore_label_id"],
                )
            )
    return out


def test_examples(folder):
    """Their `_iter_test`, every batch concatenated (one rank): the test split's examples in their order."""
    with open(os.path.join(folder, "test", "dataset.json")) as f:
        meta = json.load(f)
    dataset = _load(folder, "test")
    total = len(dataset["inputs"])
    puzzle_index = np.searchsorted(dataset["puzzle_indices"], 0, side="right") - 1
    puzzles = []
    for i in range(total):
        while puzzle_index + 1 < len(dataset["puzzle_indices"]) and i >= dataset["puzzle_indices"][puzzle_index + 1]:
            puzzle_index += 1
        puzzles.append(puzzle_index)
    return _collate(
        {
            "inputs": dataset["inputs"][:],
            "labels": dataset["labels"][:],
            "puzzle_identifiers": dataset["puzzle_identifiers"][puzzles],
        },
        meta["ignore_label_id"],
    )


# ---- source CSVs in the Hub datasets' columns ------------------------------------------------------------------------


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["source", "question", "answer", "rating"])
        writer.writerows(rows)


def sudoku_rows(count, seed):
    """Sudoku-Extreme rows (question with '.' for blanks, answer, rating) of puzzles generated with a seeded digit
    relabelling and cell blanking of one solved grid (their CSV holds no structure beyond this)."""
    solution = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        digits = rng.permutation(9) + 1
        answer = "".join(str(digits[int(c) - 1]) for c in solution)
        blanks = set(rng.choice(81, size=int(rng.integers(20, 60)), replace=False).tolist())
        question = "".join("." if j in blanks else c for j, c in enumerate(answer))
        rows.append((f"gen{i}", question, answer, int(rng.integers(0, 50))))
    return rows


def maze_rows(count, side, seed):
    """Maze-Hard rows: a grid of '#' walls with open corridors, S and G, and the answer marking a path of 'o'."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        grid = np.full((side, side), "#")
        r = int(rng.integers(1, side - 1))
        grid[r, 1 : side - 1] = " "
        c = int(rng.integers(1, side - 1))
        grid[1 : side - 1, c] = " "
        question = grid.copy()
        question[r, 1], question[side - 2, c] = "S", "G"
        answer = question.copy()
        lo, hi = sorted((1, c))
        answer[r, lo + 1 : hi] = "o"
        answer[r + 1 : side - 2, c] = "o"
        rows.append((f"gen{i}", "".join(question.reshape(-1)), "".join(answer.reshape(-1)), int(rng.integers(0, 9))))
    return rows
