"""Solving at full batch: puzzles/s of a trained FPRM over >= 10k puzzles of mixed difficulty, with the batch's rows
filled three ways (fprm_hf/batching_fprm.py):

- batch: fixed batches, every row halts at once (the authors' evaluation), so a batch costs its slowest puzzle;
- sample: fixed batches, each puzzle halts on its own and its row is dropped (this package's default);
- continuous: a halted puzzle's row is taken by the next puzzle, so the batch stays full.

The model is a run of `python -m looped_training.fprm.train` (`--model`; without it the sudoku4-evidence recipe is
trained for 700 steps into outputs/bench-fprm-batching/, ~8 min on 2 CPU cores). The puzzles are 4x4 Sudoku with 4
to 12 blanks (the recipe's range) drawn with another seed than training's. Each round runs the three modes
interleaved on the same puzzles; ratios are medians of per-round ratios. Printed: puzzles/s, accuracy, mean
iterations, rows per solver step (how full the batch ran) and the ratios to batch-wide halting; written to
outputs/bench-fprm-batching/fprm_batching.json (untracked), or to `--output`: the figures the docs quote are
benchmarks/results/fprm_batching.json, which only `--output benchmarks/results/fprm_batching.json` replaces.

    nice .venv/bin/python -m benchmarks.bench_fprm_batching                  # trains the model first if needed
    nice .venv/bin/python -m benchmarks.bench_fprm_batching --model outputs/bench-fprm-batching/sudoku4 --rounds 3
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RUN = os.path.join(ROOT, "outputs", "bench-fprm-batching", "sudoku4")
RESULT = os.path.join(ROOT, "outputs", "bench-fprm-batching", "fprm_batching.json")  # not the tracked results/
MODES = ("batch", "sample", "continuous")
LADDER = (0.05, 0.02, 0.01, 0.005, 0.002, 0.001)  # τ tried for the per-sample modes at batch-wide's accuracy
# the sudoku4-evidence recipe, shortened to fit ~8 min on 2 CPU cores; its EMA shortened to match the steps
TRAIN = [
    "--preset",
    "sudoku4-evidence",
    "--max_steps",
    "700",
    "--ema_decay",
    "0.99",
    "--num_test",
    "100",
    "--compare_cap",
    "false",
    "--time_budget_minutes",
    "12",
    "--seed",
    "0",
    "--disable_tqdm",
    "true",
]


def train(output_dir):
    command = [sys.executable, "-m", "looped_training.fprm.train", *TRAIN, "--output_dir", output_dir]
    print("training:", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def run_mode(model, ids, labels, batch_size, mode, max_loops, halt_eps=None):
    """One pass of `solve_all` in `mode`: seconds, accuracy, iterations and the rows each solver step computed."""
    from fprm_hf.batching_fprm import solve_all

    rows = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    try:
        start = time.perf_counter()
        out = solve_all(model, ids, batch_size, mode, max_loops=max_loops, halt_eps=halt_eps)
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    correct = out.answers == labels
    return {
        "seconds": seconds,
        "puzzles_per_second": len(ids) / seconds,
        "exact_accuracy": float(correct.all(-1).float().mean()),
        "cell_accuracy": float(correct.float().mean()),
        "mean_iterations": float(out.iterations.float().mean()),
        "max_iterations": int(out.iterations.max()),
        "solver_steps": len(rows),
        "rows_per_step": sum(rows) / len(rows),
        "row_iterations": sum(rows),  # the work done: rows times iterations, over every step
        "iterations": out.iterations,
        "answers": out.answers,
    }


def matched_halt_eps(model, ids, labels, batch_size, max_loops, target):
    """The largest τ of `LADDER` at which continuous batching's exact accuracy on these puzzles reaches `target`
    (batch-wide halting's on the same puzzles): its rows keep iterating after they converge, which a smaller τ
    gives per-sample halting too. The smallest τ when none does."""
    for tau in LADDER:
        exact = run_mode(model, ids, labels, batch_size, "continuous", max_loops, tau)["exact_accuracy"]
        print(f"  calibration: τ {tau:g}: exact {exact:.4f} (batch-wide {target:.4f})", flush=True)
        if exact >= target:
            return tau
    return LADDER[-1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a training run's folder (or its model/); default: train one")
    p.add_argument("--num_puzzles", type=int, default=10000)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--max_loops", type=int, default=200, help="each puzzle's cap (the recipe's eval_max_loops)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the modes, interleaved")
    p.add_argument(
        "--calibration", type=int, default=2000, help="puzzles that pick the τ matching batch-wide's accuracy"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data_seed", type=int, default=1000, help="seed of the test puzzles (training used 0)")
    p.add_argument("--output", default=RESULT, help="default %(default)s; the tracked figures: benchmarks/results/")
    args = p.parse_args(argv)
    for name in ("num_puzzles", "batch_size", "max_loops", "rounds", "threads", "calibration"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    from fprm_hf import FPRMForReasoning
    from looped_training.fprm.tasks.sudoku import build_sudoku_dataset

    torch.set_num_threads(args.threads)
    run = args.model or DEFAULT_RUN
    if args.model is None and not os.path.isfile(os.path.join(run, "model", "config.json")):
        train(run)
    model_dir = os.path.join(run, "model") if os.path.isfile(os.path.join(run, "model", "config.json")) else run
    model = FPRMForReasoning.from_pretrained(model_dir).eval()
    size = model.config.grid_size[0]
    start = time.perf_counter()
    test = build_sudoku_dataset(size, 0, args.num_puzzles, seed=args.data_seed)["test"]
    ids, labels = torch.tensor(test["input_ids"]), torch.tensor(test["labels"])
    blanks = sorted(set(test["num_blanks"]))
    print(
        f"{args.num_puzzles} {size}x{size} puzzles with {blanks[0]}..{blanks[-1]} blanks "
        f"({time.perf_counter() - start:.1f} s to build); batch {args.batch_size}, cap {args.max_loops}, "
        f"{args.threads} thread(s)",
        flush=True,
    )
    run_mode(model, ids[:64], labels[:64], 32, "continuous", args.max_loops)  # warm-up
    # calibration on whole batches at the start, so that batch-wide halting ran the same batches there
    calibration = min(len(ids), -(-args.calibration // args.batch_size) * args.batch_size)
    rounds, tau = [], None
    for r in range(args.rounds):
        results = {mode: run_mode(model, ids, labels, args.batch_size, mode, args.max_loops) for mode in MODES}
        if tau is None:
            head = slice(0, calibration)
            target = float((results["batch"]["answers"][head] == labels[head]).all(-1).float().mean())
            tau = matched_halt_eps(model, ids[head], labels[head], args.batch_size, args.max_loops, target)
        for mode in ("sample", "continuous"):
            results[f"{mode}, τ {tau:g}"] = run_mode(model, ids, labels, args.batch_size, mode, args.max_loops, tau)
        for name, m in results.items():
            print(
                f"round {r + 1} {name:>18}: {m['puzzles_per_second']:8.1f} puzzles/s  exact {m['exact_accuracy']:.4f}"
                f"  cell {m['cell_accuracy']:.4f}  mean iterations {m['mean_iterations']:6.2f}  rows/step "
                f"{m['rows_per_step']:5.1f}  {m['seconds']:6.1f} s",
                flush=True,
            )
        rounds.append(results)
    first = rounds[0]
    # continuous and per-sample halting compute each puzzle as solved alone: the same answers and iterations
    same = all(torch.equal(first["continuous"][k], first["sample"][k]) for k in ("answers", "iterations"))
    keep = ("exact_accuracy", "cell_accuracy", "mean_iterations", "max_iterations", "rows_per_step", "row_iterations")
    summary = {}
    for name in first:
        summary[name] = {k: first[name][k] for k in keep}
        summary[name]["puzzles_per_second"] = [r[name]["puzzles_per_second"] for r in rounds]
        summary[name]["puzzles_per_second_median"] = statistics.median(summary[name]["puzzles_per_second"])
    ratios = {
        f"{name} / batch": statistics.median(
            r[name]["puzzles_per_second"] / r["batch"]["puzzles_per_second"] for r in rounds
        )
        for name in first
        if name != "batch"
    }
    ratios["continuous / sample"] = statistics.median(
        r["continuous"]["puzzles_per_second"] / r["sample"]["puzzles_per_second"] for r in rounds
    )
    headline = ratios[f"continuous, τ {tau:g} / batch"]
    print("puzzles/s ratios (median of rounds): " + "; ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(
        f"continuous = sample per puzzle: {same}; at batch-wide's accuracy (τ {tau:g}) continuous / batch "
        f"{headline:.2f}x, target >= 1.3: {'met' if headline >= 1.3 else 'NOT met'}"
    )
    record = {
        "command": "python -m benchmarks.bench_fprm_batching " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.threads} thread(s)",
        "model": os.path.relpath(model_dir, ROOT),
        "train_command": "python -m looped_training.fprm.train " + " ".join(TRAIN),
        "puzzles": args.num_puzzles,
        "grid": f"{size}x{size}",
        "blanks": [blanks[0], blanks[-1]],
        "batch_size": args.batch_size,
        "max_loops": args.max_loops,
        "rounds": args.rounds,
        "config_halt_eps": model.config.halt_eps,
        "matched_halt_eps": tau,
        "calibration_puzzles": calibration,
        "modes": summary,
        "ratios": ratios,
        "continuous_equals_sample_per_puzzle": same,
        "target_continuous_over_batch": 1.3,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.output}")
    return record


if __name__ == "__main__":
    main()
