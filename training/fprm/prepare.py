"""Build the authors' data folder from the source datasets, as their dataset/build_sudoku_dataset.py and
build_maze_dataset.py build it, through `datasets`.

    python -m looped_training.fprm.prepare --dataset sapientinc/sudoku-extreme \
        --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
    python -m looped_training.fprm.prepare --dataset sapientinc/maze-30x30-hard-1k \
        --output_dir data/maze-30x30-hard-1k-noaug

`--dataset` is a Hub dataset id or a local folder holding `train.csv` and `test.csv` (as the Hub repos do), or one
CSV file for one `--splits`; the rows are their columns source, question, answer, rating. The task follows the rows
(81 cells of digits and '.': Sudoku; a square grid over "# SGo": a maze), or `--task`. Written: `train/` and `test/`
with `dataset.json` and `all__{inputs,labels,puzzle_identifiers,puzzle_indices,group_indices}.npy` (Sudoku also
`all__group_difficulties.npy`, the ratings) and `identifiers.json`: their files, byte for byte.

Randomness: their builders draw from numpy's global generator, unseeded; here a `RandomState(--seed)` makes the same
calls in the same order, so a folder equals theirs run after `np.random.seed(SEED)`. `--subsample_size N` keeps N
training rows (`choice(rows, N, replace=False)`); Sudoku's `--num_aug N` adds N copies of each training puzzle with
their augmentation (a digit permutation, a transpose with probability 1/2, then the bands and the rows in each band,
the stacks and the columns in each, shuffled), one group per puzzle; the maze's `--aug` adds the 7 other dihedral
transforms of each training maze (their README trains on the unaugmented build). The test split is never
subsampled or augmented. Exit status 2: bad input, one line naming it (a CSV that is binary, not UTF-8, without the
header row, without rows, or with a bad value: the file and the row).

The splits are built whole in `OUTPUT_DIR/.prepare/` and moved in only once every split asked for is built: a bad
test.csv, a kill or any error leaves `--output_dir` as it was (a rerun starts the staging over), and a split folder
holds its `dataset.json` only beside all its rows. A lock (`OUTPUT_DIR/.prepare.lock`) keeps a second prepare out.
"""

import argparse
import csv
import json
import os
import shutil
import sys

import numpy as np

PROG = "python -m looped_training.fprm.prepare"
MAZE_CHARSET = "# SGo"
SUDOKU_CELLS = 81
CHUNK = 4096  # rows converted at a time: memory stays flat whatever the dataset
STAGING = ".prepare"  # in --output_dir: where the splits are built before they are moved in
COLUMNS = ("source", "question", "answer", "rating")


# ---- reading the source rows ---------------------------------------------------------------------------------------


def load_rows(dataset, split, single_split):
    """A split of `dataset` through `datasets`, with question and answer as text (pandas would read a Sudoku answer
    as an integer). A local CSV is checked first (`check_csv`): one line naming it for a file that is not one."""
    import datasets
    from datasets import load_dataset

    text = {"converters": {"question": str, "answer": str}, "keep_default_na": False}
    if os.path.isfile(dataset):
        if not single_split:
            raise ValueError(
                f"--dataset {dataset} is one CSV file: give the one split it holds with --splits train or --splits "
                f"test, or a folder holding train.csv and test.csv."
            )
        path, files = dataset, {split: dataset}
    elif os.path.isdir(dataset):
        path = os.path.join(dataset, f"{split}.csv")
        if not os.path.isfile(path):
            raise ValueError(
                f"--dataset {dataset} holds no {split}.csv (their Hub repos hold train.csv and test.csv)."
            )
        files = {split: path}
    else:  # their Hub datasets are CSV files too
        path, files = None, {split: f"{split}.csv"}
    if path is not None:
        check_csv(path)
    try:
        if path is not None:
            rows = load_dataset("csv", data_files=files, split=split, **text)
        else:
            rows = load_dataset(dataset, data_files=files, split=split, **text)
    except datasets.exceptions.DatasetGenerationError as e:
        cause = e.__cause__ or e
        raise ValueError(
            f"--dataset {dataset} ({split}): {path or split + '.csv'} does not read as CSV "
            f"({type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]})."
        ) from None
    missing = {"question", "answer", "rating"} - set(rows.column_names)
    if missing:
        raise ValueError(
            f"--dataset {dataset} ({split}): no columns {sorted(missing)} (their CSVs hold source, question, answer, "
            f"rating), got {rows.column_names}."
        )
    if len(rows) == 0:
        raise ValueError(f"--dataset {dataset} ({split}) holds no rows.")
    return rows


def check_csv(path):
    """Refuse, in one line naming `path`, a file that is not UTF-8 text, one whose first row is not the header of
    their CSVs (source, question, answer, rating; a header-less file's first row would be taken for one), and one
    with a header and no row."""
    from looped_training.prepare_folder import check_text_file

    check_text_file(path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path} is empty: their CSVs hold a header ({', '.join(COLUMNS)}) and one puzzle a row.")
        if not {"question", "answer", "rating"} <= {h.strip() for h in header}:
            shown = ", ".join(h[:20] for h in header[:4])
            raise ValueError(
                f"{path} has no header row: its first row is [{shown}], where their CSVs begin with the column names "
                f"{', '.join(COLUMNS)}; add that line."
            )
        if next(reader, None) is None:
            raise ValueError(f"{path} holds the header row and no puzzle: nothing to build.")


def ratings_of(rows, dataset, split):
    """The rating column as integers, refusing a value that is not one with its row."""
    values = rows["rating"]
    try:
        return np.asarray(values, dtype=np.int64)
    except (ValueError, TypeError):
        for i, v in enumerate(values):
            try:
                int(v)
            except (ValueError, TypeError):
                raise ValueError(
                    f"--dataset {dataset} ({split}): row {i} has the rating {v!r}, not an integer (their CSVs rate "
                    f"each puzzle with a whole number)."
                ) from None
        raise


def infer_task(rows):
    question = rows[0]["question"]
    return "sudoku" if len(question) == SUDOKU_CELLS and set(question) <= set("0123456789.") else "maze"


def grids(rows, split, cells, alphabets, dataset):
    """(questions, answers) of every row as uint8 character codes (rows, cells), checked: `cells` characters each,
    of `alphabets` (the questions', the answers')."""
    questions = np.empty((len(rows), cells), np.uint8)
    answers = np.empty((len(rows), cells), np.uint8)
    for start in range(0, len(rows), CHUNK):
        batch = rows[start : start + CHUNK]
        for column, out in (("question", questions), ("answer", answers)):
            for i, text in enumerate(batch[column]):
                if len(text) != cells:
                    raise ValueError(
                        f"--dataset {dataset} ({split}): row {start + i} has a {column} of {len(text)} characters; "
                        f"the rows of this dataset have {cells}."
                    )
            codes = np.frombuffer("".join(batch[column]).encode("latin-1", "replace"), np.uint8)  # 1 byte a char
            out[start : start + len(batch[column])] = codes.reshape(-1, cells)
    for name, codes, alphabet in (("question", questions, alphabets[0]), ("answer", answers, alphabets[1])):
        unknown = sorted(set(map(chr, np.unique(codes))) - set(alphabet))
        if unknown:
            raise ValueError(
                f"--dataset {dataset} ({split}): the {name}s hold the characters {unknown}; theirs are {alphabet!r}."
            )
    return questions, answers


# ---- their augmentations -------------------------------------------------------------------------------------------


def shuffle_sudoku(board, solution, rng):
    """Their `shuffle_sudoku`, with `rng` making their global generator's calls in their order."""
    digit_map = np.pad(rng.permutation(np.arange(1, 10)), (1, 0))
    transpose = rng.rand() < 0.5
    bands = rng.permutation(3)
    rows = np.concatenate([b * 3 + rng.permutation(3) for b in bands])
    stacks = rng.permutation(3)
    cols = np.concatenate([s * 3 + rng.permutation(3) for s in stacks])

    def apply(x):  # new cell (r, c) takes old (rows[r], cols[c]) of the (transposed) grid, then the digit map
        x = x.T if transpose else x
        return digit_map[x[np.ix_(rows, cols)]]

    return apply(board), apply(solution)


def dihedral(grid, tid):
    """Their `dihedral_transform` (dataset/common.py): the 8 symmetries of the square, in their order."""
    return [
        lambda a: a,
        lambda a: np.rot90(a, 1),
        lambda a: np.rot90(a, 2),
        lambda a: np.rot90(a, 3),
        np.fliplr,
        np.flipud,
        lambda a: a.T,
        lambda a: np.fliplr(np.rot90(a, 1)),
    ][tid](grid)


# ---- writing their files -------------------------------------------------------------------------------------------


def write_split(save_dir, total, examples, puzzles_per_group, dtype, seq_len, vocab_size, group_difficulties=None):
    """Their files for one split: `examples` yields `total` (input, label) rows of `seq_len` token ids in order,
    each its own puzzle, `puzzles_per_group` puzzles per group (an original and its augmentations). The rows go
    straight to the memory-mapped files (np.save's format, byte for byte)."""
    from numpy.lib.format import open_memmap

    os.makedirs(save_dir, exist_ok=True)
    files = {}
    for name in ("inputs", "labels"):
        files[name] = open_memmap(
            os.path.join(save_dir, f"all__{name}.npy"), "w+", dtype=dtype, shape=(total, seq_len)
        )
    for i, (inp, out) in enumerate(examples):
        files["inputs"][i], files["labels"][i] = inp, out
    for array in files.values():
        array.flush()
    del files
    groups = total // puzzles_per_group
    metadata = {  # their PuzzleDatasetMetadata.model_dump(), fields in its order
        "pad_id": 0,
        "ignore_label_id": 0,
        "blank_identifier_id": 0,
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "num_puzzle_identifiers": 1,
        "total_groups": groups,
        "mean_puzzle_examples": 1.0,
        "total_puzzles": groups,
        "sets": ["all"],
    }
    with open(os.path.join(save_dir, "dataset.json"), "w") as f:
        json.dump(metadata, f)
    index = {
        "group_indices": np.arange(groups + 1, dtype=np.int32) * puzzles_per_group,
        "puzzle_indices": np.arange(total + 1, dtype=np.int32),
        "puzzle_identifiers": np.zeros(total, dtype=np.int32),
    }
    for name, array in index.items():
        np.save(os.path.join(save_dir, f"all__{name}.npy"), array)
    if group_difficulties is not None:
        np.save(os.path.join(save_dir, "all__group_difficulties.npy"), np.asarray(group_difficulties, dtype=np.int32))


def subsample(count, size, rng):
    """Their training subsample: indices of `size` of `count` rows, or all in order when `size` is None or >= count."""
    if size is None or size >= count:
        return np.arange(count)
    return rng.choice(count, size=size, replace=False)


def build_sudoku(args, split, rng, root):
    rows = load_rows(args.dataset, split, len(args.splits) == 1)
    questions, answers = grids(rows, split, SUDOKU_CELLS, ("0123456789.", "0123456789"), args.dataset)
    questions[questions == ord(".")] = ord("0")
    ratings = ratings_of(rows, args.dataset, split)
    keep = np.arange(len(ratings))
    if args.min_difficulty is not None:
        keep = keep[ratings >= args.min_difficulty]
        if not len(keep):
            raise ValueError(
                f"--min_difficulty {args.min_difficulty} keeps no {split} row (ratings up to {ratings.max()})."
            )
    if split == "train":
        keep = keep[subsample(len(keep), args.subsample_size, rng)]
    augments = args.num_aug if split == "train" else 0
    digits = (questions[keep] - ord("0")).reshape(-1, 9, 9), (answers[keep] - ord("0")).reshape(-1, 9, 9)

    def examples():
        for board, solution in zip(*digits):
            yield board.reshape(-1) + 1, solution.reshape(-1) + 1  # the original, not augmented
            for _ in range(augments):
                inp, out = shuffle_sudoku(board, solution, rng)
                yield inp.reshape(-1) + 1, out.reshape(-1) + 1

    # theirs concatenates uint8 originals with the int64 augmented grids: int64 as soon as one is augmented
    dtype = np.int64 if augments else np.uint8
    write_split(
        os.path.join(root, split),
        len(keep) * (1 + augments),
        examples(),
        1 + augments,
        dtype,
        SUDOKU_CELLS,
        11,  # pad + "0".."9"
        ratings[keep],
    )


def build_maze(args, split, rng, root):
    rows = load_rows(args.dataset, split, len(args.splits) == 1)
    first = len(rows[0]["question"])
    side = int(first**0.5)
    if side * side != first:
        raise ValueError(f"--dataset {args.dataset} ({split}): row 0 has {first} cells, not a square grid.")
    questions, answers = grids(rows, split, first, (MAZE_CHARSET, MAZE_CHARSET), args.dataset)
    keep = subsample(len(questions), args.subsample_size, rng) if split == "train" else np.arange(len(questions))
    copies = 8 if split == "train" and args.aug else 1
    char2id = np.zeros(256, np.uint8)
    char2id[np.array([ord(c) for c in MAZE_CHARSET])] = np.arange(len(MAZE_CHARSET)) + 1

    def examples():
        for i in keep:
            q, a = questions[i].reshape(side, side), answers[i].reshape(side, side)
            for tid in range(copies):
                yield char2id[dihedral(q, tid).reshape(-1)], char2id[dihedral(a, tid).reshape(-1)]

    write_split(
        os.path.join(root, split),
        len(keep) * copies,
        examples(),
        copies,
        np.uint8,
        first,
        len(MAZE_CHARSET) + 1,
    )


# ---- the command ---------------------------------------------------------------------------------------------------


def parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="a Hub dataset id, a folder with train.csv and test.csv, or a CSV")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--task", choices=("sudoku", "maze"), default=None, help="default: what the rows are")
    p.add_argument("--splits", default="train,test", help="train, test or both (comma-separated)")
    p.add_argument("--subsample_size", type=int, default=None, help="keep this many training rows (theirs: random)")
    p.add_argument("--num_aug", type=int, default=0, help="Sudoku: augmented copies of each training puzzle")
    p.add_argument("--aug", action="store_true", help="maze: the 8 dihedral transforms of each training maze")
    p.add_argument("--min_difficulty", type=int, default=None, help="Sudoku: keep rows rated at least this")
    p.add_argument("--seed", type=int, default=0, help="seed of the generator their builders leave unseeded")
    return p


def check(args):
    """One-line errors for flags that cannot work, before any row is read (`check_task` once the task is known)."""
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    if not splits or set(splits) - {"train", "test"} or len(set(splits)) != len(splits):
        raise ValueError(f"--splits must be train, test or train,test, got {args.splits!r}.")
    args.splits = sorted(splits, reverse=True)  # train first: their order of draws
    if args.num_aug < 0:
        raise ValueError(f"--num_aug must be >= 0, got {args.num_aug}.")
    if "train" not in args.splits and (args.num_aug or args.aug or args.subsample_size is not None):
        flag = "--num_aug" if args.num_aug else "--aug" if args.aug else "--subsample_size"
        raise ValueError(
            f"{flag} is for the training split (their builders never augment or subsample the test split), and "
            f"--splits is {','.join(args.splits)}."
        )
    if args.subsample_size is not None and args.subsample_size < 1:
        raise ValueError(f"--subsample_size must be >= 1, got {args.subsample_size}.")
    if os.path.isfile(args.output_dir):
        raise ValueError(f"--output_dir {args.output_dir} is a file, not a folder.")
    if args.task is not None:
        check_task(args, args.task)


def check_task(args, task):
    if task == "maze" and (args.num_aug or args.min_difficulty is not None):
        raise ValueError("--num_aug and --min_difficulty are Sudoku's; the maze's augmentation is --aug.")
    if task == "sudoku" and args.aug:
        raise ValueError("--aug is the maze's (8 dihedral transforms); Sudoku's augmentation is --num_aug N.")


def phase(name):
    """A boundary between two steps of the build (the kill-point test stops the process at each)."""


def build(args, staging):
    """Every split asked for, built whole in `staging` (their files and identifiers.json)."""
    rng = np.random.RandomState(args.seed)
    for split in args.splits:
        task = args.task or infer_task(load_rows(args.dataset, split, len(args.splits) == 1))
        check_task(args, task)
        (build_sudoku if task == "sudoku" else build_maze)(args, split, rng, staging)
        phase(f"built {split}")
    with open(os.path.join(staging, "identifiers.json"), "w") as f:
        json.dump(["<blank>"], f)


def move_in(output_dir, staging, names):
    """Move each staged split (and identifiers.json) into `output_dir`, replacing the one there: the old one is
    moved aside into the staging folder first, so a folder in `output_dir` is always a whole split."""
    for name in names:
        new, final, old = (
            os.path.join(staging, name),
            os.path.join(output_dir, name),
            os.path.join(staging, "old-" + name),
        )
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(new, final)
        phase(f"moved {name}")
    shutil.rmtree(staging)


def main(argv=None):
    from looped_training.prepare_folder import folder_lock

    args = parser().parse_args(argv)
    try:
        check(args)
        with folder_lock(args.output_dir):
            staging = os.path.join(args.output_dir, STAGING)
            if os.path.isdir(staging):  # a killed or failed build: its rows are not trusted, it starts over
                shutil.rmtree(staging)
            os.makedirs(staging)
            try:
                build(args, staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            move_in(args.output_dir, staging, [*args.splits, "identifiers.json"])
        for split in args.splits:
            print(f"wrote {os.path.join(args.output_dir, split)}")
    except (ValueError, OSError) as error:
        print(f"{PROG}: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
