"""Regenerates the measured FPRM state-tracking evidence of docs/fprm.md in one command (CPU, ~15 min at the
defaults; `--scale` multiplies every time budget):

    python -m benchmarks.fprm_evidence --output_dir outputs/fprm-evidence [--group S3] [--scale 1.0]

1. the authors' state-tracking recipe on the faithful model (`--preset s5-cpu` with `--task <group>`), trained on
   length exactly 32: their metric (accuracy over positions 1..k, sequence accuracy at k) for k = 1..128;
2. conv kernel 4 against kernel 2 under the faithful placement, two seeds each, with benchmarks.s5_recipe_probe
   (fresh sequences, init_std 6, α 0.5/0.5): accuracy at k = 2..128.

3. (`--part sudoku_stability`) the paper's stability claim on trained models: 6x6 Sudoku (`--preset sudoku-cpu`,
   same recipe and time budget) with pre-norm + residual scaling (the faithful default), post-norm (TRM style) and
   pre-norm without scaling; accuracy and fraction converged with halting off at 8..256 iterations, iterations
   against blanks on the puzzles solved (halting on), halting against always running the cap. The three runs go in
   parallel (`--jobs`), one thread each; writes `benchmarks/results/fprm_sudoku_stability.json`.

    python -m benchmarks.fprm_evidence --part sudoku_stability [--sudoku_minutes 6] [--jobs 3]

Writes `evidence.json` and prints the markdown tables that docs/fprm.md quotes.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output_dir", default="outputs/fprm-evidence")
    p.add_argument("--group", default="S3", help="state-tracking group (S3, A4, S4, A5, S5)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every time budget")
    p.add_argument("--preset_minutes", type=float, default=6.0)
    p.add_argument("--probe_minutes", type=float, default=1.5)
    p.add_argument("--part", default="all", choices=["all", "state_tracking", "sudoku_stability"])
    p.add_argument("--sudoku_minutes", type=float, default=6.0, help="training time budget of each Sudoku variant")
    p.add_argument("--sudoku_num_test", type=int, default=100, help="test puzzles per Sudoku variant")
    p.add_argument("--jobs", type=int, default=3, help="Sudoku variants trained at once (one thread each)")
    p.add_argument("--sudoku_json", default=os.path.join(RESULTS_DIR, "fprm_sudoku_stability.json"))
    a = p.parse_args(argv)
    os.makedirs(a.output_dir, exist_ok=True)
    out = {}
    if a.part in ("all", "sudoku_stability"):
        out["sudoku_stability"] = sudoku_stability(a)
    if a.part in ("all", "state_tracking"):
        out["state_tracking"] = state_tracking(a)
    return out


RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# The paper's stability comparison: name -> flags over the sudoku-cpu preset.
SUDOKU_VARIANTS = {
    "pre-norm + scaling (faithful default)": [],
    "post-norm (TRM style)": ["--norm_type", "post"],
    "pre-norm, no scaling": ["--residual_scaling", "none"],
}
CURVE = (8, 16, 32, 64, 128, 256)


def sudoku_stability(a):
    if a.jobs < 1:
        raise ValueError(f"`--jobs` must be a positive int, got {a.jobs}.")
    t0 = time.perf_counter()
    runs, pending = {}, list(SUDOKU_VARIANTS.items())
    running = []
    while pending or running:
        while pending and len(running) < a.jobs:
            name, flags = pending.pop(0)
            out_dir = os.path.join(a.output_dir, "sudoku-" + name.split(" (")[0].replace(" + ", "-").replace(", ", "-")
                                   .replace(" ", "-"))
            cmd = [sys.executable, "-m", "looped_training.fprm.train", "--preset", "sudoku-cpu", "--torch_threads", "1",
                   "--time_budget_minutes", str(a.sudoku_minutes * a.scale), "--num_test", str(a.sudoku_num_test),
                   # the curve's last point is "always run the cap" (256), so no second run of a 200 cap
                   "--compare_cap", "false", "--eval_iterations_curve",
                   ",".join(map(str, CURVE)), "--output_dir", out_dir, *flags]
            os.makedirs(out_dir, exist_ok=True)
            log = open(out_dir + ".log", "w")
            print("running:", " ".join(cmd[1:]))
            running.append((name, flags, out_dir, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(2)
        for item in list(running):
            name, flags, out_dir, proc, log = item
            if proc.poll() is not None:
                running.remove(item)
                log.close()
                if proc.returncode != 0:
                    raise RuntimeError(f"{name}: training exited with {proc.returncode}; see {out_dir}.log")
                with open(os.path.join(out_dir, "results.json")) as f:
                    r = json.load(f)
                r.pop("log_history", None)
                runs[name] = {"flags": flags, **r}
    evidence = {"command": "python -m benchmarks.fprm_evidence --part sudoku_stability "
                           f"--sudoku_minutes {a.sudoku_minutes} --sudoku_num_test {a.sudoku_num_test} --jobs {a.jobs} "
                           f"--scale {a.scale}",
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_seconds": time.perf_counter() - t0,
                "jobs": a.jobs, "torch_threads_per_run": 1,
                "runs": {name: runs[name] for name in SUDOKU_VARIANTS}}
    os.makedirs(os.path.dirname(os.path.abspath(a.sudoku_json)), exist_ok=True)
    with open(a.sudoku_json, "w") as f:
        json.dump(evidence, f, indent=1)
    print_sudoku_tables(evidence)
    print(f"wrote {a.sudoku_json}")
    return evidence


def print_sudoku_tables(evidence):
    runs = evidence["runs"]
    print(f"\nwall-clock {evidence['wall_seconds'] / 60:.1f} min, {evidence['jobs']} runs at once, one thread each")
    print("\n| variant | train min | steps | " + " | ".join(f"{n} it." for n in CURVE) + " |")
    print("|---|---|---|" + "---|" * len(CURVE))
    for name, r in runs.items():
        c = r["accuracy_vs_iterations"]
        cells = [f"{c['exact_accuracy'][j]:.3f} / {c['cell_accuracy'][j]:.3f} / {c['converged_fraction'][j]:.2f}"
                 for j in range(len(CURVE))]
        print(f"| {name} | {r['train_seconds'] / 60:.1f} | {r['train_steps']} | " + " | ".join(cells) + " |")
    print("\n(exact / cell accuracy / fraction converged, halting off; median relative residual:)")
    for name, r in runs.items():
        print(f"| {name} | " + " | ".join(f"{v:.3g}" for v in r["accuracy_vs_iterations"]["median_residual"]) + " |")
    print(f"\n| variant | halting (τ, cap {runs[next(iter(runs))]['solver']['max_loops']}): exact / cell / mean "
          f"iterations / converged | always {CURVE[-1]}: exact / cell | iteration ratio |")
    print("|---|---|---|---|")
    for name, r in runs.items():
        h, c = r["halting"], r["accuracy_vs_iterations"]
        print(f"| {name} | {h['exact_accuracy']:.3f} / {h['cell_accuracy']:.3f} / {h['mean_iterations']:.1f} / "
              f"{h['converged_fraction']:.2f} | {c['exact_accuracy'][-1]:.3f} / {c['cell_accuracy'][-1]:.3f} | "
              f"{h['mean_iterations'] / CURVE[-1]:.3f} |")
    print("\niterations to halt against blanks, puzzles solved (halting on): bin: mean iterations (n)")
    for name, r in runs.items():
        rows = r.get("iterations_vs_num_blanks_solved", [])
        print(f"| {name} | " + " | ".join(f"[{row['low']:g}, {row['high']:g}): {row['mean_iterations']:.1f} "
                                          f"({row['count']})" for row in rows) + " |")


def state_tracking(a):
    evidence = {"group": a.group, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    from looped_training.fprm.train import main as train

    t0 = time.perf_counter()
    results = train(["--preset", "s5-cpu", "--task", a.group.lower(), "--num_test", "300", "--compare_cap", "false",
                     "--time_budget_minutes", str(a.preset_minutes * a.scale),
                     "--output_dir", os.path.join(a.output_dir, "preset")])
    lg = results["length_generalisation"]
    evidence["preset"] = {"train_seconds": results["train_seconds"], "train_steps": results["train_steps"],
                          "wall_seconds": time.perf_counter() - t0, "length_generalisation": lg}

    from benchmarks.s5_recipe_probe import main as probe

    evidence["kernel"] = []
    for kernel in (4, 2):
        for seed in (0, 1):
            r = probe(["--group", a.group, "--kernel", str(kernel), "--seed", str(seed), "--init_std", "6",
                       "--minutes", str(a.probe_minutes * a.scale), "--d", "64", "--ff", "256", "--batch", "128",
                       "--num_test", "200", "--curriculum", "0.9"])
            evidence["kernel"].append({"kernel": kernel, "seed": seed, **r})
    with open(os.path.join(a.output_dir, "evidence.json"), "w") as f:
        json.dump(evidence, f, indent=1)

    T = 32
    print(f"\n| k | accuracy over 1..k | sequence accuracy at k |  ({a.group}, preset s5-cpu recipe, "
          f"{evidence['preset']['train_steps']} steps, {evidence['preset']['train_seconds'] / 60:.1f} min)")
    print("|---|---|---|")
    for k in (2, 8, 16, 32, 64, 96, 128):
        print(f"| {k} | {lg['accuracy'][k - 1]:.3f} | {lg['sequence_accuracy'][k - 1]:.3f} |")
    ratio = lg["accuracy"][4 * T - 1] / max(lg["accuracy"][T - 1], 1e-9)
    print(f"mean accuracy over 1..{4 * T} / over 1..{T}: {ratio:.3f}")
    print("\n| kernel | seed | steps | longest length reached | " + " | ".join(f"k={k}" for k in (2, 4, 8, 16, 32, 64, 128))
          + " |")
    print("|---|---|---|---|" + "---|" * 7)
    for r in evidence["kernel"]:
        acc = r["accuracy_at_k"]
        print(f"| {r['kernel']} | {r['seed']} | {r['steps']} | {r['max_train_length']} | "
              + " | ".join(f"{acc[k]:.2f}" for k in (2, 4, 8, 16, 32, 64, 128)) + " |")
    return evidence


if __name__ == "__main__":
    main()
