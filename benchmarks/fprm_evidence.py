"""Regenerates the measured FPRM state-tracking evidence of docs/fprm.md in one command (CPU, ~15 min at the
defaults; `--scale` multiplies every time budget):

    python -m benchmarks.fprm_evidence --output_dir outputs/fprm-evidence [--group S3] [--scale 1.0]

1. the authors' state-tracking recipe on the faithful model (`--preset s5-cpu` with `--task <group>`), trained on
   length exactly 32: their metric (accuracy over positions 1..k, sequence accuracy at k) for k = 1..128;
2. conv kernel 4 against kernel 2 under the faithful placement, two seeds each, with benchmarks.s5_recipe_probe
   (fresh sequences, init_std 6, α 0.5/0.5): accuracy at k = 2..128.

Writes `evidence.json` and prints the markdown tables that docs/fprm.md quotes.
"""

import argparse
import json
import os
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
    a = p.parse_args(argv)
    os.makedirs(a.output_dir, exist_ok=True)
    evidence = {"group": a.group, "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    from training.fprm.train import main as train

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
