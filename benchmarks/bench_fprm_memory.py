"""FPRM compute benchmarks.

1. Peak training memory at 8 vs 64 loops, truncated BPTT (segments of `n_backward` iterations, state detached
   between them, one optimizer step each, through `FPRMTrainer`) against full BPTT (all loops in one graph).
   Measured three ways: autograd's saved activations (bytes of tensors kept for backward, the part that grows with
   the graph), the process's peak RSS above its footprint before training (one fresh process per run), and
   `torch.cuda.max_memory_allocated` when a GPU is present.
2. Halting vs always running the cap: mean iterations, wall-clock and accuracy of a trained model, with
   `halt_eps` against `halting=False` at the same `max_loops` (`--halting_model`, a folder written by
   training/fprm/train.py).

    python -m benchmarks.bench_fprm_memory                       # memory table, JSON to benchmarks/results/
    python -m benchmarks.bench_fprm_memory --halting_model outputs/fprm-sudoku-cpu/model --task sudoku6
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from transformers import TrainerCallback

from fprm_hf import FPRMConfig, FPRMForReasoning
from looped_training.fprm.trainer import FPRMTrainer, FPRMTrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SavedActivations:
    """Bytes of distinct tensors autograd saves for backward, per optimizer step; `peak` over the steps."""

    def __init__(self):
        self.step_bytes, self.peak, self._seen = 0, 0, set()

    def pack(self, tensor):
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in self._seen:
            self._seen.add(key)
            self.step_bytes += key[1]
        return tensor

    def new_step(self):
        self.peak = max(self.peak, self.step_bytes)
        self.step_bytes, self._seen = 0, set()


class _StepBoundary(TrainerCallback):
    def __init__(self, meter):
        self.meter = meter

    def on_step_begin(self, args, state, control, **kwargs):
        self.meter.new_step()

    def on_step_end(self, args, state, control, **kwargs):
        self.meter.new_step()


def tiny_sudoku_like(batch, seed=0, size=6, vocab=8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch * 4, size * size), generator=g)
    labels = torch.randint(0, vocab, (batch * 4, size * size), generator=g)
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def train_memory(loops, mode, hidden=64, batch=16, n_backward=4, size=6, seed=0, output_dir="/tmp/fprm_bench"):
    """Train a small grid model for `loops` solver iterations per sample and return the memory it took.

    truncated: loops / n_backward segments of n_backward iterations (one optimizer step each);
    full:      one segment of `loops` iterations (backprop through all of them)."""
    if mode not in ("truncated", "full"):
        raise ValueError(f"`mode` must be 'truncated' or 'full', got {mode!r}.")
    if mode == "truncated" and loops % n_backward:
        raise ValueError(f"`loops` ({loops}) must be a multiple of n_backward ({n_backward}) for truncated BPTT.")
    torch.manual_seed(seed)
    config = FPRMConfig(vocab_size=8, hidden_size=hidden, num_attention_heads=4, intermediate_size=2 * hidden,
                        grid_size=size, num_prefix_tokens=2, init_std=1.0)
    model = FPRMForReasoning(config)
    segment = n_backward if mode == "truncated" else loops
    args = FPRMTrainingArguments(
        output_dir=output_dir, use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no",
        per_device_train_batch_size=batch, max_steps=loops // segment, n_backward=segment,
        max_segments=loops // segment, train_halt_eps=1e-12, learning_rate=1e-4, disable_tqdm=True,
        logging_strategy="no", dataloader_drop_last=True,
    )
    meter = SavedActivations()
    trainer = FPRMTrainer(model=model, args=args, train_dataset=tiny_sudoku_like(batch, seed, size),
                          callbacks=[_StepBoundary(meter)])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        trainer.train()
    meter.new_step()
    iterations = int(trainer.carry.state.iterations.max())
    return {
        "loops": loops, "mode": mode, "segments": loops // segment, "iterations_per_sample": iterations,
        "saved_activation_bytes": meter.peak,
        "rss_peak_increase_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "seconds": time.perf_counter() - start,
    }


def _in_fresh_process(loops, mode, hidden, batch):
    code = ("import json; import torch; torch.set_num_threads(1);"
            "from benchmarks.bench_fprm_memory import train_memory;"
            f"print('RESULT', json.dumps(train_memory({loops}, {mode!r}, hidden={hidden}, batch={batch})))")
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

        test = build_sudoku_dataset(int(task[len("sudoku"):]), 0, num_test, seed=seed + 1000)["test"]
    elif task in STATE_TRACKING_TASKS:
        from looped_training.fprm.tasks.state_tracking import build_state_tracking_dataset

        test = build_state_tracking_dataset(task.upper(), 0, num_test, seed=seed + 1000)["test"]
    else:
        raise ValueError(f"`--task` must be sudoku4, sudoku6, sudoku9 or one of {STATE_TRACKING_TASKS}, got {task!r}.")
    rows = {}
    for name, kwargs in (("always_cap", dict(halting=False)), ("halting", dict(halt_eps=halt_eps))):
        preds, iters, conv, seconds = run_solver(model, test, batch_size, name, max_loops=max_loops, **kwargs)
        cell, exact, _, _ = accuracy(preds, test["labels"])
        rows[name] = {"cell_accuracy": cell, "exact_accuracy": exact, "mean_iterations": float(iters.float().mean()),
                      "seconds": seconds, "converged_fraction": float(conv.float().mean())}
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
    print(f"\nPeak training memory (hidden {args.hidden}, batch {args.batch}, 6x6 grid + 2 prefix tokens, n_backward 4)")
    print(f"{'mode':<10}{'loops':>6}{'segments':>9}{'saved activations':>19}{'peak RSS increase':>19}{'cuda peak':>11}")
    for r in results["memory"]:
        cuda = "-" if r["cuda_peak_bytes"] is None else f"{r['cuda_peak_bytes'] / 2**20:.1f} MiB"
        print(f"{r['mode']:<10}{r['loops']:>6}{r['segments']:>9}{r['saved_activation_bytes'] / 2**20:>15.1f} MiB"
              f"{r['rss_peak_increase_bytes'] / 2**20:>15.1f} MiB{cuda:>11}")
    lo, hi = min(args.loops), max(args.loops)
    ratios = {}
    for mode in ("truncated", "full"):
        by = {r["loops"]: r for r in results["memory"] if r["mode"] == mode}
        ratios[mode] = {
            "saved_activation_ratio": by[hi]["saved_activation_bytes"] / by[lo]["saved_activation_bytes"],
            "rss_increase_ratio": by[hi]["rss_peak_increase_bytes"] / max(by[lo]["rss_peak_increase_bytes"], 1),
        }
        print(f"{mode}: {hi} vs {lo} loops -> saved activations x{ratios[mode]['saved_activation_ratio']:.2f}, "
              f"peak RSS increase x{ratios[mode]['rss_increase_ratio']:.2f}")
    results["ratios"] = ratios
    if args.halting_model:
        rows = halting_vs_cap(args.halting_model, args.task, args.num_test, args.max_loops, args.halt_eps)
        results["halting_vs_cap"] = rows
        print(f"\nHalting (halt_eps={args.halt_eps}) vs always {args.max_loops} loops, {args.task}, {args.num_test} puzzles")
        for name in ("halting", "always_cap"):
            r = rows[name]
            print(f"  {name:<11} mean iterations {r['mean_iterations']:7.1f}  {r['seconds']:6.1f}s  "
                  f"cell acc {r['cell_accuracy']:.4f}  exact acc {r['exact_accuracy']:.4f}")
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
