"""The authors' FPRM checkpoints on their test data: a puzzle solved, or a test set evaluated.

    python -m looped_training.fprm.evaluate_authors fixed-point-reasoners/fprm --subfolder sudoku \
        --data data/sudoku-extreme-full --halt_scope batch
    python -m looped_training.fprm.evaluate_authors fixed-point-reasoners/fprm --subfolder maze \
        --dataset sapientinc/maze-30x30-hard-1k --num_test 200

The model is any folder `FPRMForReasoning.from_pretrained` reads (the authors' step files, `--step N` for another
than the newest, or a saved model). The data is what their `dataset/build_*_dataset.py` writes (`--data`: the output
folder or its `test/`: all__inputs.npy, all__labels.npy and, for Sudoku, all__group_difficulties.npy) or the source
dataset through `datasets` (`--dataset`: a Hub id or a CSV with their columns source, question, answer, rating).
Printed and written to `--output` (JSON): exact accuracy (every cell right), cell accuracy, iterations, the fraction
that converged, and iterations and exact accuracy against difficulty (the rating, and for Sudoku the blank count).
`--halt_scope batch` (or `--batching batch`) halts as their evaluation (every row of a batch at once); the default
halts each puzzle on its own; `--batching continuous` also gives a halted puzzle's row to the next puzzle
(fprm_hf/batching_fprm.py). z0 is drawn fresh per puzzle, as theirs, from `--seed`. Exit status 2: bad input, one
line naming it.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

PROG = "python -m looped_training.fprm.evaluate_authors"
PAPER = {"sudoku": "Sudoku-Extreme exact accuracy 94.2% (the paper, Table 1)", "maze": None}


# ---- their encodings (dataset/build_sudoku_dataset.py; the Maze-Hard builder's charset "# SGo") --------------------


class Task:
    """A task's codec: a puzzle string (their CSV's `question`) <-> token ids, pad 0."""

    def __init__(self, name, side, alphabet, blank):
        self.name, self.side, self.alphabet, self.blank = name, side, alphabet, blank

    @property
    def cells(self):
        return self.side * self.side

    def encode(self, puzzle):
        """Token ids (cells,) of a puzzle string; whitespace between rows and '|'/'-' separators are ignored for
        Sudoku, which also reads '.' or '0' as blank."""
        if not isinstance(puzzle, str):
            raise ValueError(f"a {self.name} puzzle must be a string, got {type(puzzle).__name__}.")
        text = puzzle
        if self.name == "sudoku":
            text = "".join(ch for ch in puzzle if not ch.isspace() and ch not in "|-+").replace(".", "0")
        else:
            text = puzzle.replace("\n", "")
        if len(text) != self.cells:
            raise ValueError(
                f"a {self.name} puzzle has {self.cells} cells ({self.side}x{self.side}), got {len(text)}"
                f" in {puzzle[:40]!r}{'...' if len(puzzle) > 40 else ''}."
            )
        unknown = sorted(set(text) - set(self.alphabet))
        if unknown:
            raise ValueError(f"a {self.name} puzzle uses the characters {self.alphabet!r}, got {unknown}.")
        return [self.alphabet.index(ch) + 1 for ch in text]

    def decode(self, ids):
        """The grid's rows as strings (token 0, pad, shown as '?')."""
        chars = [self.alphabet[i - 1] if 0 < i <= len(self.alphabet) else "?" for i in ids]
        return ["".join(chars[r * self.side : (r + 1) * self.side]) for r in range(self.side)]


TASKS = {"sudoku": Task("sudoku", 9, "0123456789", "0"), "maze": Task("maze", 30, "# SGo", " ")}


def task_at(name, config):
    """Task `name`'s codec at the model's (square) grid: folders built by their builders' logic can be any size (the
    CPU recipes train 11x11 mazes), the authors' models read 9x9 and 30x30."""
    grid = config.grid_size or []
    if len(grid) != 2 or grid[0] != grid[1]:
        raise ValueError(f"a {name} model reads a square grid, this one reads {config.grid_size}.")
    spec = TASKS[name]
    return Task(spec.name, grid[0], spec.alphabet, spec.blank)


def task_of(config):
    """The task a model reads, from the grid it was built for."""
    grid = config.grid_size or [None]
    for task in TASKS.values():
        if grid == [task.side, task.side] and config.vocab_size == len(task.alphabet) + 1:
            return task
    raise ValueError(
        f"this model reads grid {config.grid_size} with vocab_size {config.vocab_size}; the published "
        f"tasks are sudoku (9x9, 11) and maze (30x30, 6)."
    )


@torch.no_grad()
def solve(model, puzzle, **solver_kwargs):
    """Solve one puzzle string: (the solved grid's rows, iterations, converged)."""
    task = task_of(model.config)
    device = next(model.parameters()).device
    ids = torch.tensor([task.encode(puzzle)], device=device)
    out = model.eval()(ids, **solver_kwargs)
    return task.decode(out.logits.argmax(-1)[0].tolist()), int(out.iterations[0]), bool(out.converged[0])


# ---- their test data ------------------------------------------------------------------------------------------------


def read_built_folder(path):
    """(inputs, labels, ratings or None) of their builder's output folder (or its `test/`)."""
    split = path if os.path.isfile(os.path.join(path, "all__inputs.npy")) else os.path.join(path, "test")
    files = {k: os.path.join(split, f"all__{k}.npy") for k in ("inputs", "labels", "group_difficulties")}
    for key in ("inputs", "labels"):
        if not os.path.isfile(files[key]):
            raise ValueError(
                f"--data {path}: no {files[key]} (give the folder their dataset/build_*_dataset.py wrote, "
                f"or its test/ split)."
            )
    try:
        inputs, labels = np.load(files["inputs"], allow_pickle=False), np.load(files["labels"], allow_pickle=False)
        ratings = (
            np.load(files["group_difficulties"], allow_pickle=False)
            if os.path.isfile(files["group_difficulties"])
            else None
        )
    except ValueError as error:  # allow_pickle=False: an object array is refused, never unpickled
        raise ValueError(f"--data {split}: {str(error).splitlines()[0]}") from None
    if inputs.ndim != 2 or inputs.shape != labels.shape:
        raise ValueError(
            f"--data {split}: inputs {inputs.shape} and labels {labels.shape} must be the same (puzzles, cells) shape."
        )
    if ratings is not None and len(ratings) != len(inputs):
        ratings = None  # one rating per group; groups of several puzzles (augmented splits) have no per-row rating
    return inputs.astype(np.int64), labels.astype(np.int64), ratings


def read_source_dataset(name, task, split="test"):
    """(inputs, labels, ratings) of their source dataset (Hub id or CSV: source, question, answer, rating)."""
    from datasets import load_dataset

    text = {"converters": {"question": str, "answer": str}}  # pandas would read a Sudoku answer as an int
    try:
        if os.path.isfile(name):
            check_csv_header(name)
            data = load_dataset("csv", data_files={split: name}, split=split, **text)
        else:  # their Hub datasets are CSV files too
            data = load_dataset(name, split=split, **text)
    except Exception as error:  # datasets' DatasetGenerationError, a Hub error: one line naming the file
        if isinstance(error, ValueError) and str(error).startswith("--dataset"):
            raise
        reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ValueError(f"--dataset {name}: not readable as their CSV ({reason}).") from None
    missing = {"question", "answer"} - set(data.column_names)
    if missing:
        raise ValueError(
            f"--dataset {name}: no columns {sorted(missing)} (their CSVs hold source, question, answer, "
            f"rating), got {data.column_names}."
        )
    if len(data) == 0:
        raise ValueError(f"--dataset {name} has no rows in its {split} split.")
    inputs = np.array(_column(data, "question", task.encode, name), dtype=np.int64)
    labels = np.array(_column(data, "answer", task.encode, name), dtype=np.int64)
    ratings = None
    if "rating" in data.column_names:
        ratings = np.array(_column(data, "rating", _rating, name), dtype=float)
    return inputs, labels, ratings


def check_csv_header(path):
    """Refuse a file that is not their CSV before `datasets` reads it: a binary file, or a first row that is not a
    header naming question and answer (a CSV without its header would lose its first puzzle to it)."""
    import csv

    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    try:
        first = head.decode("utf-8", "strict" if len(head) < 1 << 16 else "ignore").splitlines()[:1] or [""]
    except UnicodeDecodeError:
        first = None
    if first is None or b"\0" in head:
        raise ValueError(
            f"--dataset {path} is not a text file; give their CSV (header source,question,answer,rating)."
        )
    first = first[0]
    header = next(csv.reader([first]), [])
    if not {"question", "answer"} <= {column.strip() for column in header}:
        raise ValueError(
            f"--dataset {path}: its first row {first[:60]!r} is not a header naming the columns question and answer; "
            f"their CSVs start with the row source,question,answer,rating."
        )
    if len(head) < 1 << 16 and not any(line.strip() for line in head.decode("utf-8").splitlines()[1:]):
        raise ValueError(f"--dataset {path} has no rows, only its header.")


def _rating(value):
    """A rating cell: a number, or None (empty) for a puzzle without one."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number") from None


def _column(data, column, read, name):
    """`read` of every cell of `column`; a cell it refuses is named by file, row (1 = the first after the header) and
    column."""
    values = []
    for row, cell in enumerate(data[column], start=1):
        try:
            values.append(read(cell))
        except ValueError as error:
            raise ValueError(f"--dataset {name}, row {row}, column {column}: {str(error).rstrip('.')}.") from None
    return values


# ---- the evaluation ---------------------------------------------------------------------------------------------


def batching_mode(batching, halt_scope):
    """The batching mode of `--batching` and `--halt_scope` (fprm_hf/batching_fprm.py; None: the model's halt_scope):
    `--batching` names how rows are filled, `--halt_scope` only fixed batches' halting rule, so the two must agree."""
    if batching is None or halt_scope is None:
        return batching or halt_scope
    if halt_scope != ("batch" if batching == "batch" else "sample"):
        raise ValueError(
            f"--batching {batching} halts {'every row at once' if batching == 'batch' else 'each puzzle on its own'}"
            f", --halt_scope {halt_scope} the other way: give one of them."
        )
    return batching


@torch.no_grad()
def evaluate(
    model, inputs, labels, ratings, task, batch_size=64, halt_scope=None, seed=0, batching=None, **solver_kwargs
):
    """The report (a dict) of the model over the puzzles, with a progress bar."""
    from tqdm.auto import tqdm

    from fprm_hf.batching_fprm import gather, iter_solve
    from looped_training.fprm.evaluate import accuracy, by_difficulty

    if inputs.shape[1] != task.cells:
        raise ValueError(
            f"the data has {inputs.shape[1]} cells per puzzle, the model reads {task.cells} ({task.side}x{task.side})."
        )
    model.eval()
    mode = batching_mode(batching, halt_scope) or model.config.halt_scope
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    start = time.perf_counter()
    solved = iter_solve(model, inputs, batch_size, mode, generator=generator, **solver_kwargs)
    out = gather(tqdm(solved, total=len(inputs), desc=f"{task.name} ({len(inputs)} puzzles)", unit="puzzle"))
    seconds = time.perf_counter() - start
    preds, iterations, converged = out.answers, out.iterations, out.converged
    cell, exact, correct, valid = accuracy(preds, labels)
    rows = (correct | ~valid).all(-1)
    report = {
        "task": task.name,
        "puzzles": len(inputs),
        "exact_accuracy": exact,
        "cell_accuracy": cell,
        "mean_iterations": float(iterations.float().mean()),
        "max_iterations": int(iterations.max()),
        "converged": float(converged.float().mean()),
        "seconds": seconds,
        "halt_scope": "batch" if mode == "batch" else "sample",
        "batching": mode,
        "paper": PAPER[task.name],
    }
    if ratings is not None:
        report["by_rating"] = by_difficulty(ratings, iterations, rows)
        report["unrated"] = int(np.isnan(np.asarray(ratings, dtype=float)).sum())  # in no by_rating row
    if task.name == "sudoku":
        report["by_blanks"] = by_difficulty((inputs == 1).sum(1), iterations, rows)
    return report


def print_report(report, out=None):
    out = out or sys.stdout
    print(
        f"{report['task']}: {report['puzzles']} puzzles, exact accuracy {report['exact_accuracy']:.4f}, cell "
        f"accuracy {report['cell_accuracy']:.4f}, mean iterations {report['mean_iterations']:.1f} (max "
        f"{report['max_iterations']}), converged {report['converged']:.3f}, {report['batching']} batching, "
        f"{report['seconds']:.1f} s",
        file=out,
    )
    if report["paper"]:
        print(f"  compare: {report['paper']}", file=out)
    for key in ("by_rating", "by_blanks"):
        for row in report.get(key) or ():
            print(
                f"  {key[3:]} {row['low']:g}..{row['high']:g}: {row['count']} puzzles, mean iterations "
                f"{row['mean_iterations']:.1f}, exact {row['exact_accuracy']:.3f}",
                file=out,
            )


def _parser():
    from fprm_hf.batching_fprm import BATCHING_MODES

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="an authors' FPRM folder or Hub repo (their step files), or a saved model folder")
    p.add_argument("--subfolder", default=None, help="the task folder of the repo: sudoku or maze")
    p.add_argument("--step", type=int, default=None, help="the step_N file to read (default: the newest)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="the folder their dataset/build_*_dataset.py wrote (or its test/ split)")
    source.add_argument("--dataset", help="their source dataset: a Hub id (sapientinc/sudoku-extreme) or a CSV")
    source.add_argument("--puzzle", help="solve one puzzle string and print the grid")
    p.add_argument("--split", default="test", help="the split of --dataset (default: test)")
    p.add_argument("--num_test", type=int, default=None, help="the first N puzzles only")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument(
        "--halt_scope",
        choices=("sample", "batch"),
        default=None,
        help="batch: halt as their evaluation (every row at once); default: the model's (per sample)",
    )
    p.add_argument(
        "--batching",
        choices=BATCHING_MODES,
        default=None,
        help="how batches are filled: batch (their evaluation: every row halts at once), sample (each puzzle halts "
        "on its own, the batch shrinks), continuous (a halted puzzle's row is taken by the next one); "
        "default: --halt_scope's",
    )
    p.add_argument("--max_loops", type=int, default=None, help="iteration cap (default: the model's, 1000 for theirs)")
    p.add_argument("--halt_eps", type=float, default=None, help="τ (default: the model's, 0.1 for theirs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-puzzle z0 draws")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--output", default=None, help="write the report here as JSON")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    from huggingface_hub.errors import StrictDataclassError

    from fprm_hf import FPRMForReasoning
    from looped_training.arguments import check_device, check_model_source, check_output_path

    try:
        if args.num_test is not None and args.num_test < 1:
            raise ValueError(f"--num_test must be >= 1, got {args.num_test}.")
        if args.batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {args.batch_size}.")
        mode = batching_mode(args.batching, args.halt_scope)
        # before any puzzle is solved: the report is written last
        check_output_path("--output", args.output)
        check_model_source("model", args.model)
        if args.dataset and os.path.isfile(args.dataset):
            check_csv_header(args.dataset)
        kwargs = {k: v for k, v in (("subfolder", args.subfolder), ("step", args.step)) if v is not None}
        device = check_device("--device", args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = FPRMForReasoning.from_pretrained(args.model, dtype=getattr(torch, args.dtype), **kwargs).to(device)
        task = task_of(model.config)
        solver = {k: v for k, v in (("max_loops", args.max_loops), ("halt_eps", args.halt_eps)) if v is not None}
        if args.puzzle is not None:
            scope = None if mode is None else "batch" if mode == "batch" else "sample"  # one puzzle: a batch of one
            grid, iterations, converged = solve(model, args.puzzle, halt_scope=scope, **solver)
            print("\n".join(grid))
            print(f"iterations {iterations}, converged {converged}")
            return 0
        if args.data:
            inputs, labels, ratings = read_built_folder(args.data)
        else:
            inputs, labels, ratings = read_source_dataset(args.dataset, task, args.split)
        if args.num_test:
            inputs, labels = inputs[: args.num_test], labels[: args.num_test]
            ratings = None if ratings is None else ratings[: args.num_test]
        report = evaluate(model, inputs, labels, ratings, task, args.batch_size, None, args.seed, mode, **solver)
    except (ValueError, OSError, StrictDataclassError) as error:
        from looped_training.arguments import one_line

        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    print_report(report)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as handle:
            json.dump(
                {
                    **report,
                    "model": args.model,
                    "subfolder": args.subfolder,
                    "step": (getattr(model.config, "authors_checkpoint", None) or {}).get("step"),
                },
                handle,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, PROG)
