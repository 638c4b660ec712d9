"""FPRM evaluation: the solver over a test set (cell/exact accuracy, iterations against difficulty, the per-prefix
curve of state tracking, halting against always running the cap), the printed report and the PNG plots.

    python -m looped_training.fprm.evaluate outputs/fprm-s5-cpu                 # a training run's output folder
    python -m looped_training.fprm.evaluate outputs/fprm-s5-cpu/model --eval_max_loops 64 --output_dir runs/s5-eval

The command evaluates the run again on the test set its `results.json` (the training run's record) describes, rebuilt
from the same data flags and seed; the evaluation flags (`--eval_max_loops`, `--eval_halt_eps`, `--compare_cap`,
`--eval_iterations_curve`, ...) default to the run's. It writes `results.json` and the plots (skipped with a note
without matplotlib) to `--output_dir` (default: `eval/` in the run's folder); `looped_training.publish` reads that
file (or the run's own) for the card's model-index.

The printed report and the plots are written by `looped_training.fprm.report`.
"""

import json
import math
import os
import sys
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from fprm_hf.batching_fprm import gather, iter_solve
from looped_training.fprm.report import print_report, write_plots
from looped_training.fprm.tasks import STATE_TRACKING_TASKS

RESULTS_FILE = "results.json"  # the training run's record, and what this command writes
PROG = "python -m looped_training.fprm.evaluate"


@torch.no_grad()
def run_solver(model, dataset, batch_size, desc, batching=None, **solver_kwargs):
    """Predictions, per-sample iterations/convergence and wall-clock of the solver over a dataset, its batches
    filled as `batching` says (fprm_hf/batching_fprm.py: batch, sample, continuous; None: the config's halt_scope)."""
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor(dataset["input_ids"], device=device)
    pids = dataset["puzzle_identifiers"] if "puzzle_identifiers" in dataset.column_names else None
    model(ids[:2], max_loops=2)  # warm-up, outside the timing
    start = time.perf_counter()
    solved = iter_solve(model, ids, batch_size, batching, pids, **solver_kwargs)
    out = gather(tqdm(solved, total=len(ids), desc=desc, leave=False))
    seconds = time.perf_counter() - start
    return out.answers, out.iterations, out.converged, seconds


def accuracy(preds, labels):
    labels = torch.as_tensor(labels)
    valid = labels != -100
    correct = (preds == labels) & valid
    cell = float(correct.sum() / valid.sum())
    exact = float(((correct | ~valid).all(-1)).float().mean())
    return cell, exact, correct, valid


def by_difficulty(values, iterations, correct_rows, bins=6):
    """Mean iterations and exact accuracy grouped by a difficulty value (quantile bins when there are many). A puzzle
    without a value (NaN: an empty rating cell) is in no bin (as an edge, NaN would drop the top bin's puzzles)."""
    values = np.asarray(values, dtype=float)
    rated = values[np.isfinite(values)]
    distinct = np.unique(rated)
    if len(distinct) == 0:
        return []
    if len(distinct) <= bins:
        edges = list(distinct) + [distinct[-1] + 1]
    else:
        edges = list(np.unique(np.quantile(rated, np.linspace(0, 1, bins + 1))))
        edges[-1] += 1e-9
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        mask = (values >= lo) & (values < hi)
        if mask.any():
            rows.append(
                {
                    "low": float(lo),
                    "high": float(hi),
                    "count": int(mask.sum()),
                    "mean_value": float(values[mask].mean()),
                    "mean_iterations": float(iterations.numpy()[mask].mean()),
                    "exact_accuracy": float(correct_rows.numpy()[mask].mean()),
                }
            )
    return rows


def check_iteration_counts(counts):
    """Iteration counts for `accuracy_vs_iterations`: a non-empty, strictly increasing sequence of positive ints."""
    counts = list(counts) if isinstance(counts, (list, tuple)) else counts
    if (
        not isinstance(counts, list)
        or not counts
        or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)
        or any(b <= a for a, b in zip(counts, counts[1:]))
    ):
        raise ValueError(
            f"iteration counts must be a non-empty, strictly increasing list of positive ints, got {counts!r}."
        )
    return counts


def parse_iteration_counts(text):
    """'8,16,32' -> [8, 16, 32] (the `--eval_iterations_curve` flag)."""
    try:
        counts = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise ValueError(
            f"`--eval_iterations_curve` must be comma-separated positive ints such as '8,16,32', got {text!r}."
        ) from None
    return check_iteration_counts(counts)


@torch.no_grad()
def accuracy_vs_iterations(
    model, dataset, counts=(8, 16, 32, 64, 128, 256), batch_size=100, halt_eps=None, gamma=None
):
    """Accuracy with halting off after each of `counts` iterations (the paper's stability test): every sample runs
    exactly that many solver iterations; one solver run per batch is continued from count to count
    (`solver_state`), so the total cost is max(counts) iterations. Returns, per count: cell/exact accuracy, the
    fraction converged (relative residual of the last iteration < τ), the fraction diverged (non-finite) and the
    median relative residual. `halt_eps` (τ) and `gamma` (the decay of η) default to the config's (`gamma_eval`)."""
    counts = check_iteration_counts(counts)
    if "labels" not in dataset.column_names or len(dataset) == 0:
        raise ValueError(
            f"`dataset` must be a non-empty dataset with a `labels` column, got columns "
            f"{dataset.column_names} and {len(dataset)} rows."
        )
    model.eval()
    device = next(model.parameters()).device
    tau = model.config.halt_eps if halt_eps is None else halt_eps
    gamma = model.config.gamma_eval if gamma is None else gamma
    preds = [[] for _ in counts]
    residuals = [[] for _ in counts]
    diverged = [[] for _ in counts]
    for i in range(0, len(dataset), batch_size):
        batch = dataset[i : i + batch_size]
        kwargs = {"input_ids": torch.tensor(batch["input_ids"], device=device)}
        if "puzzle_identifiers" in batch:
            kwargs["puzzle_identifiers"] = torch.tensor(batch["puzzle_identifiers"], device=device)
        state, done = None, 0
        for j, count in enumerate(counts):
            out = model(**kwargs, max_loops=count - done, halting=False, halt_eps=tau, gamma=gamma, solver_state=state)
            state, done = out.solver_state, count
            preds[j].append(out.logits.argmax(-1).cpu())
            residuals[j].append(out.residuals.cpu())
            diverged[j].append(out.diverged.cpu())
    result = {
        "iterations": counts,
        "halt_eps": tau,
        "gamma": gamma,
        "cell_accuracy": [],
        "exact_accuracy": [],
        "converged_fraction": [],
        "diverged_fraction": [],
        "median_residual": [],
    }
    for j in range(len(counts)):
        cell, exact, _, _ = accuracy(torch.cat(preds[j]), dataset["labels"])
        r = torch.cat(residuals[j])
        result["cell_accuracy"].append(cell)
        result["exact_accuracy"].append(exact)
        result["converged_fraction"].append(float((r < tau).float().mean()))
        result["diverged_fraction"].append(float(torch.cat(diverged[j]).float().mean()))
        result["median_residual"].append(float(r.median()))
    return result


def length_generalisation(correct, valid):
    """The authors' state-tracking metric (length_gen_eval.py) from one causal forward over the test sequences: for
    each k, accuracy = mean correctness over positions 1..k and sequence accuracy = all of positions 1..k correct,
    averaged over the sequences that have a label among them."""
    cum_correct = (correct & valid).float().cumsum(1)
    cum_valid = valid.float().cumsum(1)
    has = cum_valid > 0
    count = has.float().sum(0).clamp(min=1)
    acc = torch.where(has, cum_correct / cum_valid.clamp(min=1), torch.zeros_like(cum_correct)).sum(0) / count
    seq = (has & (cum_correct == cum_valid)).float().sum(0) / count
    return {"ks": list(range(1, correct.shape[1] + 1)), "accuracy": acc.tolist(), "sequence_accuracy": seq.tolist()}


def evaluate(model, ds, data_args, eval_args, difficulty_columns):
    test = ds["test"]
    knobs = dict(max_loops=eval_args.eval_max_loops)
    if eval_args.eval_halt_eps is not None:
        knobs["halt_eps"] = eval_args.eval_halt_eps
    if eval_args.eval_gamma is not None:
        knobs["gamma"] = eval_args.eval_gamma
    trm = getattr(model.config, "recursion", "fixed_point") == "trm"
    if trm:  # TRM's evaluation runs its halt_max_steps ACT steps, theirs; the solver's knobs do not apply
        knobs = {}
        if eval_args.eval_batching not in (None, "batch"):
            raise ValueError(
                f"--eval_batching {eval_args.eval_batching}: a TRM model (recursion='trm') runs every row its "
                "halt_max_steps ACT steps, so its batches are filled one way; give --eval_batching batch or leave it out."
            )
    results = {"solver": knobs, "recursion": model.config.recursion}
    # TRM's rows all run the same steps: its batches are filled one way ("batch")
    batching = {"batching": "batch" if trm else eval_args.eval_batching}
    preds, iters, conv, seconds = run_solver(
        model, test, eval_args.eval_batch_size, "eval (halting)", **batching, **knobs
    )
    cell, exact, correct, valid = accuracy(preds, test["labels"])
    exact_rows = (correct | ~valid).all(-1).float()
    results["halting"] = {
        "cell_accuracy": cell,
        "exact_accuracy": exact,
        "mean_iterations": float(iters.float().mean()),
        "converged_fraction": float(conv.float().mean()),
        "seconds": seconds,
        "batching": batching["batching"] or model.config.halt_scope,
    }
    for column in difficulty_columns:
        if column != "length":
            results[f"iterations_vs_{column}"] = by_difficulty(test[column], iters, exact_rows)
            solved = exact_rows.bool()
            if solved.any():  # the paper's plot: iterations against difficulty on the puzzles solved
                results[f"iterations_vs_{column}_solved"] = by_difficulty(
                    np.asarray(test[column])[solved.numpy()], iters[solved], exact_rows[solved]
                )
    if data_args.task in STATE_TRACKING_TASKS:
        per_position = (correct.float().sum(0) / valid.float().sum(0).clamp(min=1)).tolist()
        results["per_prefix_accuracy"] = per_position  # index k-1: accuracy of the running product of k elements
        results["accuracy_at_length"] = {
            str(k): per_position[k - 1] for k in (2, 8, 16, 32, 64, 128) if k <= len(per_position)
        }
        results["length_generalisation"] = length_generalisation(correct, valid)
        results["iterations_vs_length"] = []
        for length in (8, 16, 32, 64, 128):
            if length > data_args.test_length:
                continue
            subset = test.select(range(min(len(test), 50))).select_columns(["input_ids"])
            prefix = subset.map(lambda r: {"input_ids": r["input_ids"][:length]})
            _, it, cv, _ = run_solver(
                model, prefix, eval_args.eval_batch_size, f"eval length {length}", **batching, **knobs
            )
            results["iterations_vs_length"].append(
                {
                    "length": length,
                    "mean_iterations": float(it.float().mean()),
                    "converged_fraction": float(cv.float().mean()),
                }
            )
    if eval_args.eval_iterations_curve:
        results["accuracy_vs_iterations"] = accuracy_vs_iterations(
            model,
            test,
            parse_iteration_counts(eval_args.eval_iterations_curve),
            eval_args.eval_batch_size,
            knobs.get("halt_eps"),
            knobs.get("gamma"),
        )
    if data_args.task == "arc":
        from looped_training.fprm.tasks.arc import pass_at_2

        score, count = pass_at_2(preds.tolist(), test, data_args.arc_max_grid)
        results["arc_pass_at_2"] = {"score": score, "test_inputs": count}
    if eval_args.compare_cap and not trm:  # TRM always runs its cap
        cap_preds, cap_iters, _, cap_seconds = run_solver(
            model, test, eval_args.eval_batch_size, "eval (always cap)", halting=False, **batching, **knobs
        )
        cap_cell, cap_exact, _, _ = accuracy(cap_preds, test["labels"])
        results["always_cap"] = {
            "cell_accuracy": cap_cell,
            "exact_accuracy": cap_exact,
            "mean_iterations": float(cap_iters.float().mean()),
            "seconds": cap_seconds,
        }
        results["halting_vs_cap"] = {
            "iteration_ratio": results["halting"]["mean_iterations"] / results["always_cap"]["mean_iterations"],
            "wall_clock_ratio": seconds / cap_seconds,
            "cell_accuracy_difference": cell - cap_cell,
        }
    return results


# ---- the command ------------------------------------------------------------------------------------------------


def find_run(path):
    """(model folder, the run's record) of a training output folder or of its `model/` folder."""
    from looped_training.checkpoints import check_checkpoint, check_model_type

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a folder: give an FPRM training output folder (or its model/ folder).")
    model_dir = os.path.join(path, "model") if os.path.isfile(os.path.join(path, "model", "config.json")) else path
    check_checkpoint(model_dir)
    check_model_type(model_dir, "fprm")
    record_path = os.path.join(os.path.dirname(model_dir), RESULTS_FILE)
    if not os.path.isfile(record_path):
        raise ValueError(
            f"{path!r} has no {RESULTS_FILE} beside its model/ folder (written by python -m "
            f"looped_training.fprm.train), so the test set it was trained for is unknown."
        )
    with open(record_path) as f:
        record = json.load(f)
    if not isinstance(record.get("args"), dict) or "data" not in record["args"]:
        raise ValueError(
            f"{record_path} holds no data arguments ('args' -> 'data'): it is not a training run's record."
        )
    return model_dir, record


def _known(cls, values):
    """The entries of `values` that are fields of the dataclass `cls` (a record may hold fields of other versions)."""
    names = {f.name for f in cls.__dataclass_fields__.values()}
    return {k: v for k, v in (values or {}).items() if k in names}


def build_parser(argv):
    """The command's parser, its evaluation defaults taken from the run's record, and the run (model folder, record)."""
    from transformers import HfArgumentParser

    from looped_training.fprm.arguments import EvalArguments

    parser = HfArgumentParser((EvalArguments,), prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="an FPRM training output folder (holding model/ and results.json)")
    parser.add_argument("--output_dir", default=None, help="where results.json and the plots go (default: <run>/eval)")
    parser.add_argument("--num_test", type=int, default=None, help="score the first N test samples (default: all)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the training run's seed, which the test set is drawn with (default: the record's, else 42)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    run = find_run(parser.parse_known_args(argv)[0].checkpoint)  # argparse's usage error without one
    parser.set_defaults(**_known(EvalArguments, run[1]["args"].get("eval")))
    return parser, run


def card_results(data, path, checkpoint, record, _):
    """A results.json of this command or of training as the card's model-index (`looped_training.model_cards`): exact
    and cell accuracy and mean iterations, halting and at the cap."""
    from looped_training.model_cards import describe_dataset, eval_result, is_number

    name, kind = describe_dataset("fprm", record or data)
    solver = [f"{k}={v}" for k, v in sorted((data.get("solver") or {}).items())]
    task = {"type": "token-classification", "name": "Puzzle solving"}
    dataset = {"name": name, "type": kind, "split": "test"}
    return [
        eval_result(task, dataset, metric, block[metric], ",".join([setting, *solver]))
        for key, setting in (("halting", "halting"), ("always_cap", "halting=False"))
        if isinstance(block := data.get(key), dict)
        for metric in ("exact_accuracy", "cell_accuracy", "mean_iterations")
        if is_number(block.get(metric))
    ]


def _strict_json(value):
    """`value` with every non-finite float (an accuracy of no sample, a diverged residual) as None: NaN and Infinity
    are not JSON, and strict readers (JavaScript, jq) refuse the file."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def main(argv=None):
    import torch

    from transformers import set_seed

    from fprm_hf import FPRMForReasoning
    from looped_training.arguments import check_device, check_output_path
    from looped_training.checkpoints import load_model
    from looped_training.fprm.tasks import build_task
    from looped_training.fprm.arguments import DataArguments, EvalArguments, check_run_flags

    argv = list(sys.argv[1:] if argv is None else argv)
    parser, run = build_parser(argv)
    eval_args, extra = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    model_dir, record = run
    data_args = DataArguments(**_known(DataArguments, record["args"]["data"]))
    check_run_flags(data_args, eval_args)
    if extra.num_test is not None and extra.num_test < 1:
        raise ValueError(f"--num_test must be >= 1, got {extra.num_test}.")
    output_dir = extra.output_dir or os.path.join(os.path.dirname(model_dir), "eval")
    check_output_path("--output_dir", output_dir, folder=True)  # written last, after the whole evaluation
    device = check_device("--device", extra.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    seed = extra.seed if extra.seed is not None else record["args"].get("seed", 42)
    if eval_args.torch_threads:
        torch.set_num_threads(eval_args.torch_threads)
    set_seed(seed)
    if data_args.data is not None:  # the authors' folder the run trained on: the first --num_test of its test split
        from looped_training.fprm.authors_data import build_authors_task

        data_args.num_test = extra.num_test or data_args.num_test
        ds, _, difficulty_columns = build_authors_task(data_args, seed, global_batch_size=1)
    else:
        ds, _, difficulty_columns = build_task(data_args, seed)
    if extra.num_test is not None and data_args.data is None:
        ds["test"] = ds["test"].select(range(min(extra.num_test, len(ds["test"]))))
    model = load_model(FPRMForReasoning, model_dir).to(device).eval()
    results = evaluate(model, ds, data_args, eval_args, difficulty_columns)
    results.update(
        {
            key: record.get(key)
            for key in ("preset", "task", "train_seconds", "train_steps", "parameters", "max_train_length")
            if key in record
        }
    )
    results["args"] = {**record["args"], "eval": _known(EvalArguments, vars(eval_args))}
    results["evaluated"] = {
        "checkpoint": os.path.basename(os.path.dirname(model_dir)),
        "seed": seed,
        "test_samples": len(ds["test"]),
    }
    if data_args.task in STATE_TRACKING_TASKS and "max_train_length" not in results:
        results["max_train_length"] = data_args.train_length
    print_report(results, record.get("train_seconds") or 0.0)
    os.makedirs(output_dir, exist_ok=True)
    plots = write_plots(results, [], output_dir)
    with open(os.path.join(output_dir, RESULTS_FILE), "w") as f:
        json.dump(_strict_json(results), f, indent=1, default=str, allow_nan=False)
    print(f"wrote {os.path.join(output_dir, RESULTS_FILE)}" + (f" and {', '.join(plots)}" if plots else ""))
    return results


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, PROG)
