"""FPRM compute benchmarks.

1. Peak training memory at 8 vs 64 loops, truncated BPTT (segments of `n_backward` iterations, state detached
   between them, one optimizer step each, through `FPRMTrainer`) against full BPTT (all loops in one graph).
   Measured three ways: autograd's saved activations (bytes of tensors kept for backward, the part that grows with
   the graph), the process's peak RSS above its footprint before training (one fresh process per run), and
   `torch.cuda.max_memory_allocated` when a GPU is present. The measured run is tests/support/instruments.py's
   `train_memory` (the tests run it small).
2. Halting vs always running the cap: mean iterations, wall-clock and accuracy of a trained model, with
   `halt_eps` against `halting=False` at the same `max_loops` (`--halting_model`, a folder written by
   training/fprm/train.py).

    python -m benchmarks.bench_fprm_memory                       # memory table, JSON to benchmarks/results/
    python -m benchmarks.bench_fprm_memory --halting_model outputs/fprm-sudoku-cpu/model --task sudoku6
"""

import argparse
import json
import os
import subprocess
import sys

import torch

from fprm_hf import FPRMForReasoning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_fresh_process(loops, mode, hidden, batch):
    code = (
        "import json; import torch; torch.set_num_threads(1);"
        "from tests.support.instruments import train_memory;"
        f"print('RESULT', json.dumps(train_memory({loops}, {mode!r}, hidden={hidden}, batch={batch})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.split("RESULT", 1)[1])


def halting_vs_cap(model_dir, task, num_test, max_loops, halt_eps, batch_size=100, seed=1):
    from looped_training.fprm.evaluate import accuracy, run_solver
    from looped_training.fprm.tasks import STATE_TRACKING_TASKS

    model = FPRMForReasoning.from_pretrained(model_dir).eval()
    if task.startswith("sudoku"):
        from looped_training.fprm.tasks.sudoku import build_sudoku_dataset

        test = build_sudoku_dataset(int(task[len("sudoku") :]), 0, num_test, seed=seed + 1000)["test"]
    elif task in STATE_TRACKING_TASKS:
        from looped_training.fprm.tasks.state_tracking import build_state_tracking_dataset

        test = build_state_tracking_dataset(task.upper(), 0, num_test, seed=seed + 1000)["test"]
    else:
        raise ValueError(f"`--task` must be sudoku4, sudoku6, sudoku9 or one of {STATE_TRACKING_TASKS}, got {task!r}.")
    rows = {}
    for name, kwargs in (("always_cap", dict(halting=False)), ("halting", dict(halt_eps=halt_eps))):
        preds, iters, conv, seconds = run_solver(model, test, batch_size, name, max_loops=max_loops, **kwargs)
        cell, exact, _, _ = accuracy(preds, test["labels"])
        rows[name] = {
            "cell_accuracy": cell,
            "exact_accuracy": exact,
            "mean_iterations": float(iters.float().mean()),
            "seconds": seconds,
            "converged_fraction": float(conv.float().mean()),
        }
    rows["iteration_ratio"] = rows["halting"]["mean_iterations"] / rows["always_cap"]["mean_iterations"]
    rows["wall_clock_ratio"] = rows["halting"]["seconds"] / rows["always_cap"]["seconds"]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loops", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--halting_model", default=None)
    parser.add_argument("--task", default="sudoku4")
    parser.add_argument("--num_test", type=int, default=300)
    parser.add_argument("--max_loops", type=int, default=200)
    parser.add_argument("--halt_eps", type=float, default=0.05)
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", "fprm_memory.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {"memory": [], "settings": vars(args)}
    for mode in ("truncated", "full"):
        for loops in args.loops:
            results["memory"].append(_in_fresh_process(loops, mode, args.hidden, args.batch))
    print(
        f"\nPeak training memory (hidden {args.hidden}, batch {args.batch}, 6x6 grid + 2 prefix tokens, n_backward 4)"
    )
    print(
        f"{'mode':<10}{'loops':>6}{'segments':>9}{'saved activations':>19}{'peak RSS increase':>19}{'cuda peak':>11}"
    )
    for r in results["memory"]:
        cuda = "-" if r["cuda_peak_bytes"] is None else f"{r['cuda_peak_bytes'] / 2**20:.1f} MiB"
        print(
            f"{r['mode']:<10}{r['loops']:>6}{r['segments']:>9}{r['saved_activation_bytes'] / 2**20:>15.1f} MiB"
            f"{r['rss_peak_increase_bytes'] / 2**20:>15.1f} MiB{cuda:>11}"
        )
    lo, hi = min(args.loops), max(args.loops)
    ratios = {}
    for mode in ("truncated", "full"):
        by = {r["loops"]: r for r in results["memory"] if r["mode"] == mode}
        ratios[mode] = {
            "saved_activation_ratio": by[hi]["saved_activation_bytes"] / by[lo]["saved_activation_bytes"],
            "rss_increase_ratio": by[hi]["rss_peak_increase_bytes"] / max(by[lo]["rss_peak_increase_bytes"], 1),
        }
        print(
            f"{mode}: {hi} vs {lo} loops -> saved activations x{ratios[mode]['saved_activation_ratio']:.2f}, "
            f"peak RSS increase x{ratios[mode]['rss_increase_ratio']:.2f}"
        )
    results["ratios"] = ratios
    if args.halting_model:
        rows = halting_vs_cap(args.halting_model, args.task, args.num_test, args.max_loops, args.halt_eps)
        results["halting_vs_cap"] = rows
        print(
            f"\nHalting (halt_eps={args.halt_eps}) vs always {args.max_loops} loops, {args.task}, {args.num_test} puzzles"
        )
        for name in ("halting", "always_cap"):
            r = rows[name]
            print(
                f"  {name:<11} mean iterations {r['mean_iterations']:7.1f}  {r['seconds']:6.1f}s  "
                f"cell acc {r['cell_accuracy']:.4f}  exact acc {r['exact_accuracy']:.4f}"
            )
        print(f"  ratio: iterations {rows['iteration_ratio']:.3f}, wall-clock {rows['wall_clock_ratio']:.3f}")
    else:
        print("\n(halting vs cap skipped: pass --halting_model <folder of a trained model>)")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
