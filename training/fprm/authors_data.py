"""The authors' data folders, read as their puzzle_dataset.py reads them (`python -m looped_training.fprm.train --data
DIR`).

A folder is what their dataset/build_sudoku_dataset.py and build_maze_dataset.py write, and what
`python -m looped_training.fprm.prepare` writes: `train/` and `test/`, each with `dataset.json` (their
PuzzleDatasetMetadata) and `all__inputs.npy`, `all__labels.npy`, `all__puzzle_identifiers.npy`,
`all__puzzle_indices.npy`, `all__group_indices.npy` (and `all__group_difficulties.npy`, Sudoku's ratings). Examples
belong to puzzles (`puzzle_indices`), puzzles to groups (`group_indices`: a Sudoku and its augmentations, a maze and
its dihedral copies). Inputs and labels are memory-mapped; the index arrays are read into memory, as theirs.

Training batches (`AuthorsTrainStream`) are drawn as their `PuzzleDataset._iter_train`: iteration k (Trainer's epoch
k - 1) shuffles the groups `epochs_per_iter` times with `Generator(Philox(seed + k))`, takes the groups in that order
and one puzzle of each drawn from the same generator, packs them into global batches, and drops the last short
batch. Labels equal to `ignore_label_id` become -100. The test split (`AuthorsSplit`) is read in order.
"""

import json
import math
import os

import numpy as np
from torch.utils.data import Dataset, IterableDataset, get_worker_info

IGNORE_LABEL_ID = -100  # their models/losses.py, and transformers'
FIELDS = ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices")
METADATA_KEYS = ("pad_id", "ignore_label_id", "vocab_size", "seq_len", "num_puzzle_identifiers", "sets")
# the tasks whose model layout a folder can feed, and the difficulty columns their evaluation reports
TASK_LAYOUTS = {
    "sudoku": dict(conv_type="2d", causal=False, position_embedding_type="rope"),
    "maze": dict(conv_type="causal_1d", causal=False, position_embedding_type="rope"),
}
MAZE_PATH = 5  # token of 'o' in "# SGo" (pad 0)
SUDOKU_BLANK = 1  # token of '0' (pad 0)


def _where(folder, split):
    return f"--data {folder}: {split}/"


def read_metadata(folder, split):
    """Their dataset.json of one split, checked for the fields the reader needs."""
    path = os.path.join(folder, split, "dataset.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"{_where(folder, split)}dataset.json is missing (a folder their dataset/build_*_dataset.py or "
            f"`python -m looped_training.fprm.prepare` writes holds train/ and test/, each with dataset.json and "
            f"all__{{{','.join(FIELDS)}}}.npy)."
        )
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{_where(folder, split)}dataset.json is not JSON ({error}).") from None
    missing = [k for k in METADATA_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"{_where(folder, split)}dataset.json has no {missing} (their PuzzleDatasetMetadata fields).")
    if meta["sets"] != ["all"]:
        raise ValueError(
            f"{_where(folder, split)}dataset.json lists the sets {meta['sets']}; their Sudoku and maze builders "
            f"write one, ['all'], the only kind read here."
        )
    return meta


def _load(folder, split, field, mmap):
    path = os.path.join(folder, split, f"all__{field}.npy")
    if not os.path.isfile(path):
        raise ValueError(
            f"{_where(folder, split)}all__{field}.npy is missing (each split holds dataset.json and "
            f"all__{{{','.join(FIELDS)}}}.npy, as their dataset/build_*_dataset.py writes)."
        )
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except ValueError as error:  # allow_pickle=False: an object array is refused, never unpickled
        raise ValueError(f"{_where(folder, split)}all__{field}.npy: {str(error).splitlines()[0]}") from None


class AuthorsSplit(Dataset):
    """One split of an authors' folder: examples in order, as their test loader reads them. Columns: `input_ids`,
    `labels` (ignore_label_id -> -100), `puzzle_identifiers` (the example's puzzle's), and the difficulty columns
    of the evaluation (`num_blanks`, `rating` for Sudoku, `path_length` for mazes). `limit`: the first N examples."""

    def __init__(self, folder, split, limit=None):
        self.folder, self.split = folder, split
        self.meta = read_metadata(folder, split)
        self.inputs = _load(folder, split, "inputs", mmap=True)
        self.labels = _load(folder, split, "labels", mmap=True)
        index = {k: _load(folder, split, k, mmap=False) for k in FIELDS[2:]}
        self.puzzle_identifiers, self.puzzle_indices, self.group_indices = (
            index["puzzle_identifiers"],
            index["puzzle_indices"],
            index["group_indices"],
        )
        path = os.path.join(folder, split, "all__group_difficulties.npy")
        self.group_difficulties = (
            _load(folder, split, "group_difficulties", mmap=False) if os.path.isfile(path) else None
        )
        self._check()
        self.size = len(self.inputs) if limit is None else min(limit, len(self.inputs))
        self.columns = ["input_ids", "labels", "puzzle_identifiers"]

    def _check(self):
        where, seq_len = _where(self.folder, self.split), self.meta["seq_len"]
        if self.inputs.ndim != 2 or self.inputs.shape != self.labels.shape:
            raise ValueError(
                f"{where}all__inputs.npy has shape {self.inputs.shape} and all__labels.npy {self.labels.shape}: "
                f"they must be the same (examples, seq_len) shape."
            )
        if self.inputs.shape[1] != seq_len:
            raise ValueError(
                f"{where}all__inputs.npy has {self.inputs.shape[1]} tokens per example, dataset.json's seq_len {seq_len}."
            )
        p, g = self.puzzle_indices, self.group_indices
        consistent = (
            p.ndim == g.ndim == 1
            and len(p) >= 2
            and len(g) >= 2
            and p[0] == 0
            and g[0] == 0
            and p[-1] == len(self.inputs)
            and g[-1] == len(p) - 1
            and len(self.puzzle_identifiers) == len(p) - 1
            and bool(np.all(np.diff(p) > 0))
            and bool(np.all(np.diff(g) > 0))
        )
        if not consistent:
            raise ValueError(
                f"{where}the index arrays do not describe {len(self.inputs)} examples: puzzle_indices must rise from 0 "
                f"to the example count, group_indices from 0 to the puzzle count, one puzzle_identifier per puzzle "
                f"(got {len(p)} puzzle_indices ending {p[-1] if len(p) else None}, {len(g)} group_indices ending "
                f"{g[-1] if len(g) else None}, {len(self.puzzle_identifiers)} puzzle_identifiers)."
            )

    # ---- the table the evaluation reads ------------------------------------------------------------------------

    def __len__(self):
        return self.size

    @property
    def column_names(self):
        return list(self.columns)

    def select_columns(self, columns):
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.columns = [c for c in self.columns if c in columns]
        return view

    def mapped_labels(self, rows):
        labels = np.asarray(rows, dtype=np.int64)
        if self.meta["ignore_label_id"] is not None:
            labels[labels == self.meta["ignore_label_id"]] = IGNORE_LABEL_ID
        return labels

    def puzzles_of(self, examples):
        return np.searchsorted(self.puzzle_indices, examples, side="right") - 1

    def column(self, name, rows):
        """Column `name` for the example indices `rows` (a slice or an index array)."""
        if name == "input_ids":
            return np.asarray(self.inputs[rows], dtype=np.int64)
        if name == "labels":
            return self.mapped_labels(self.labels[rows])
        examples = np.arange(self.size)[rows]
        if name == "puzzle_identifiers":
            return self.puzzle_identifiers[self.puzzles_of(examples)].astype(np.int64)
        if name == "num_blanks":
            return (np.asarray(self.inputs[rows]) == SUDOKU_BLANK).sum(1)
        if name == "path_length":  # the path's cells and S and G, as the generated mazes' path_length
            return (np.asarray(self.labels[rows]) == MAZE_PATH).sum(1) + 2
        if name == "rating":
            groups = np.searchsorted(self.group_indices, self.puzzles_of(examples), side="right") - 1
            return self.group_difficulties[groups]
        raise KeyError(name)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.column(key, slice(0, self.size))
        if isinstance(key, slice):
            rows = slice(*key.indices(self.size))
            return {c: self.column(c, rows) for c in self.columns}
        if not -self.size <= key < self.size:
            raise IndexError(f"example {key} of {self.size}")
        key = key % self.size
        return {c: self.column(c, slice(key, key + 1))[0] for c in self.columns}

    # ---- checks against a model ----------------------------------------------------------------------------------

    def check_vocabulary(self, vocab_size, chunk=1 << 16):
        """A ValueError if a token id (input, or a label that is not ignored) is >= `vocab_size` or < 0."""
        for name, array in (("inputs", self.inputs), ("labels", self.labels)):
            low, high = vocab_size, -1
            for start in range(0, len(array), chunk):
                block = np.asarray(array[start : start + chunk])
                if name == "labels" and self.meta["ignore_label_id"] is not None:
                    block = block[block != self.meta["ignore_label_id"]]
                if block.size:
                    low, high = min(low, int(block.min())), max(high, int(block.max()))
            if high >= 0 and (low < 0 or high >= vocab_size):
                raise ValueError(
                    f"{_where(self.folder, self.split)}all__{name}.npy holds token ids in [{low}, {high}]; the model "
                    f"reads ids in [0, {vocab_size - 1}] (vocab_size {vocab_size})."
                )


class AuthorsTrainStream(IterableDataset):
    """The training split as their `PuzzleDataset._iter_train` streams it (module docstring), one example at a time
    in the order of their global batches of `global_batch_size`: Trainer's DataLoader regroups them into the same
    batches (and, with several processes, gives rank r the r-th slice of each, as theirs). Trainer's `set_epoch(e)`
    selects their iteration e + 1, so a resumed run draws the same batches."""

    def __init__(self, split, global_batch_size, seed, epochs_per_iter=1):
        if np.any(np.diff(split.puzzle_indices) != 1):
            raise ValueError(
                f"{_where(split.folder, split.split)}some puzzles hold several examples (an ARC-style folder); "
                f"their Sudoku and maze builders write one example per puzzle, the only kind streamed here."
            )
        self.split, self.batch, self.seed, self.epochs_per_iter = split, global_batch_size, seed, epochs_per_iter
        self.groups = len(split.group_indices) - 1
        self.epoch = None  # Trainer's epoch; None: count the iterations, as theirs (`self._iters`)
        self._iters = 0
        self.columns = ["input_ids", "labels", "puzzle_identifiers"]
        if self.batches_per_iteration() < 1:
            raise ValueError(
                f"{_where(split.folder, split.split)}{self.groups} groups x --epochs_per_iter {epochs_per_iter} give "
                f"no batch of {global_batch_size} (per-device batch x processes): their loader drops a short batch."
            )

    @property
    def column_names(self):
        return list(self.columns)

    def select_columns(self, columns):
        self.columns = [c for c in self.columns if c in columns]
        return self

    def set_epoch(self, epoch):
        self.epoch = epoch

    def batches_per_iteration(self):
        return self.groups * self.epochs_per_iter // self.batch

    def __len__(self):
        return self.batches_per_iteration() * self.batch

    def batches(self, iteration):
        """Their iteration `iteration` (1, 2, ...): (example indices, puzzle indices) of each global batch."""
        rng = np.random.Generator(np.random.Philox(seed=self.seed + iteration))
        order = np.concatenate([rng.permutation(self.groups) for _ in range(self.epochs_per_iter)])
        g = self.split.group_indices
        for start in range(0, len(order) - self.batch + 1, self.batch):  # the last short batch is dropped
            groups = order[start : start + self.batch]
            puzzles = rng.integers(g[groups], g[groups + 1])  # one puzzle per group, their draws in their order
            yield self.split.puzzle_indices[puzzles], puzzles

    def __iter__(self):
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise ValueError(
                "The authors' sampler streams one ordered sequence: use --dataloader_num_workers 0 or 1 (theirs: 1)."
            )
        self._iters += 1
        iteration = self._iters if self.epoch is None else self.epoch + 1
        split = self.split
        for examples, puzzles in self.batches(iteration):
            order = np.argsort(examples, kind="stable")  # a memmap reads sorted rows fastest
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(order))
            columns = {
                "input_ids": np.asarray(split.inputs[examples[order]], dtype=np.int64)[inverse],
                "labels": split.mapped_labels(split.labels[examples[order]])[inverse],
                "puzzle_identifiers": split.puzzle_identifiers[puzzles].astype(np.int64),
            }
            for i in range(len(examples)):
                yield {c: columns[c][i] for c in self.columns}


# ---- the task a folder feeds -------------------------------------------------------------------------------------


def task_of_folder(meta):
    """The task a folder's dataset.json describes: their Sudoku (vocab 11, 81 tokens) or maze (vocab 6, a square
    grid); None if neither."""
    side = math.isqrt(meta["seq_len"])
    if side * side != meta["seq_len"]:
        return None
    return {11: "sudoku", 6: "maze"}.get(meta["vocab_size"])


def open_folder(data_args):
    """(train split, test split, task) of `--data`, checked: every file there, shapes that agree, a task the
    folder's dataset.json and `--task` agree on."""
    folder = data_args.data
    if not os.path.isdir(folder):
        raise ValueError(f"--data {folder}: no such folder (give the folder their dataset/build_*_dataset.py wrote).")
    train = AuthorsSplit(folder, "train")
    test = AuthorsSplit(folder, "test", limit=data_args.num_test)
    task = task_of_folder(train.meta)
    if task is None or task != data_args.task:
        raise ValueError(
            f"--data {folder} holds {train.meta['seq_len']} tokens per example over vocab_size "
            f"{train.meta['vocab_size']} ({task or 'neither their Sudoku (81, 11) nor their maze (a square grid, 6)'}); "
            f"--task is {data_args.task!r}: give --task {task}" + ("." if task else " or another folder.")
        )
    if test.meta["seq_len"] != train.meta["seq_len"] or test.meta["vocab_size"] != train.meta["vocab_size"]:
        raise ValueError(f"--data {folder}: train/ and test/ dataset.json disagree on seq_len or vocab_size.")
    return train, test, task


def build_authors_task(data_args, seed, global_batch_size):
    """What `tasks.build_task` gives for generated data, from `--data`: ({"train": stream, "test": split}, the
    model configuration the data needs, the difficulty columns)."""
    train, test, task = open_folder(data_args)
    seed = seed + data_args.data_seed_offset
    stream = AuthorsTrainStream(train, global_batch_size, seed, data_args.epochs_per_iter)
    side = math.isqrt(train.meta["seq_len"])
    difficulty = ["num_blanks"] + (["rating"] if test.group_difficulties is not None else [])
    if task == "maze":
        difficulty = ["path_length"]
    test.columns += difficulty
    config = dict(
        vocab_size=train.meta["vocab_size"],
        grid_size=side,
        num_puzzle_identifiers=train.meta["num_puzzle_identifiers"],
        **TASK_LAYOUTS[task],
    )
    return {"train": stream, "test": test}, config, difficulty


def check_fits(ds, config):
    """A ValueError if the folder's data cannot feed the model of `config`: token ids beyond its vocabulary, another
    grid, puzzle identifiers it has no row for."""
    train, test = ds["train"].split, ds["test"]
    tokens = train.inputs.shape[1]
    grid = config.grid_size if isinstance(config.grid_size, (list, tuple)) else [config.grid_size] * 2
    if grid[0] is None or grid[0] * grid[1] != tokens:
        raise ValueError(
            f"--data {train.folder} holds {tokens} tokens per example; the model reads a grid of {config.grid_size}."
        )
    for split in (train, test):
        split.check_vocabulary(config.vocab_size)
        if split.puzzle_identifiers.size and int(split.puzzle_identifiers.max()) >= config.num_puzzle_identifiers:
            raise ValueError(
                f"{_where(split.folder, split.split)}all__puzzle_identifiers.npy reaches "
                f"{int(split.puzzle_identifiers.max())}; the model has {config.num_puzzle_identifiers} puzzle "
                f"identifier(s)."
            )


__all__ = ["AuthorsSplit", "AuthorsTrainStream", "build_authors_task", "check_fits", "open_folder", "task_of_folder"]
