"""Where does LoopFormer's depth pay? A sweep of recipe knobs on the Quickstart's synthetic task.

    python -m benchmarks.sweep_loopformer                       # every cell, 2 seeds, 2 runs at a time
    python -m benchmarks.sweep_loopformer --cells base steps4k  # some cells
    python -m benchmarks.sweep_loopformer --cells steps4k --seeds 2 3  # more seeds for a cell
    python -m benchmarks.sweep_loopformer --table_only          # rewrite the table from the runs on disk

The model and the objective stay the authors' (tests/training/loopformer/test_loopformer_training_oracle.py keeps them so): each cell
only moves recipe knobs of training/configs/loopformer/synthetic-tiny.yaml (training steps, learning rate,
warm-up and weight decay, width, loops, batch, the task's depth range). Every cell trains LoopFormer, Base-Loop and
TMLT-EE with seeds 0 and 1, or those `--seeds` names (`--seed` and `--shortcut_seed`; the corpus and the held-out
problems are the same for all); the table of a cell averages every seed for which all three models are trained:
the runs on disk and the seeds benchmarks/results/sweep_loopformer.json already holds for the cell's flags. It
evaluates exact match on the held-out problems at every budget M = 1..L (uniform steps), overall and by depth.

It writes benchmarks/results/sweep_loopformer.json (every number) and benchmarks/results/sweep_loopformer.md
(an overview row per cell, then the curves over M, seed means with their spread, and the Quickstart's three verdicts
per cell, of the means and of each seed alone: (a) LoopFormer em(M=L) - em(M=1) >= 0.10 with no step back larger
than 0.02; (b) LoopFormer at M=1 >= Base-Loop at M=1 + 0.10; (c) LoopFormer at M=L within 0.05 of Base-Loop at
M=L). Runs already on disk are not trained again.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from looped_training.loopformer.report import budget_claims

BASE_CONFIG = "training/configs/loopformer/synthetic-tiny.yaml"
VARIANTS = {"loopformer": "LoopFormer", "base_loop": "Base-Loop", "tmlt_ee": "TMLT-EE"}
SEEDS = (0, 1)  # the default; a cell's table uses every seed trained for all three models
# cell -> flags over BASE_CONFIG (recipe knobs only)
CELLS = {
    "base": [],
    "steps4k": ["--max_steps", "4000"],
    "lr2e-3": ["--learning_rate", "0.002"],
    "steps4k-lr2e-3": ["--max_steps", "4000", "--learning_rate", "0.002"],
    "depth1-3": ["--max_depth", "3"],
    "lr5e-4": ["--learning_rate", "0.0005"],
    "warmup500": ["--warmup_steps", "500"],
    "warmup1000": ["--warmup_steps", "1000"],
    "steps3k-warmup750": ["--max_steps", "3000", "--warmup_steps", "750"],
    "steps4k-warmup1000": ["--max_steps", "4000", "--warmup_steps", "1000"],
    "steps8k-warmup2000": ["--max_steps", "8000", "--warmup_steps", "2000"],
    # a higher peak learning rate once a quarter of the run has warmed it up
    "steps3k-warmup750-lr2e-3": ["--max_steps", "3000", "--warmup_steps", "750", "--learning_rate", "0.002"],
    # the 3000-step recipe on the easier chains of depth 1..3, still looped L=4 times
    "steps3k-warmup750-depth1-3": ["--max_steps", "3000", "--warmup_steps", "750", "--max_depth", "3"],
    # depth 1..3 looped L=3 times: a quarter fewer block applications per step buys 4000 steps in the same time
    "steps4k-warmup1000-depth1-3-loops3": [
        "--max_steps",
        "4000",
        "--warmup_steps",
        "1000",
        "--max_depth",
        "3",
        "--num_loops",
        "3",
    ],
    # twice the steps of steps3k-warmup750 on the same samples (and about the same time)
    "steps6k-warmup1500-batch32": [
        "--max_steps",
        "6000",
        "--warmup_steps",
        "1500",
        "--per_device_train_batch_size",
        "32",
    ],
    "wd0.2": ["--weight_decay", "0.2"],  # the weight decay of the authors' config/train_*_3blk.py
    "width64": ["--hidden_size", "64"],
    "width256": ["--hidden_size", "256"],
    "loops8": ["--num_loops", "8"],
}
RESULTS = os.path.join("benchmarks", "results")
EVAL_FILE = "sweep_eval.json"


def run_dir(runs_dir, cell, variant, seed):
    return os.path.join(runs_dir, cell, f"{variant}-s{seed}")


def train(runs_dir, cell, variant, seed):
    out = run_dir(runs_dir, cell, variant, seed)
    if os.path.exists(os.path.join(out, "loopformer_training.json")):
        return out, 0.0
    os.makedirs(out, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "looped_training.loopformer.train",
        "--config",
        BASE_CONFIG,
        *CELLS[cell],
        "--variant",
        variant,
        "--seed",
        str(seed),
        "--shortcut_seed",
        str(seed),
        "--output_dir",
        out,
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
        "--logging_steps",
        "500",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    with open(os.path.join(out, "train.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        raise RuntimeError(f"training {out} failed (exit {proc.returncode}); see {out}/train.log")
    seconds = time.perf_counter() - start
    print(f"trained {out} in {seconds:.0f} s", flush=True)
    return out, seconds


def seeds_on_disk(runs_dir, cell):
    """The seeds of `cell` whose runs have finished for every variant, in order."""
    folder = os.path.join(runs_dir, cell)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    found = [
        {
            int(m.group(1))
            for n in names
            if (m := re.fullmatch(rf"{v}-s(\d+)", n))
            and os.path.exists(os.path.join(folder, n, "loopformer_training.json"))
        }
        for v in VARIANTS
    ]
    return sorted(set.intersection(*found))


def evaluate(path, max_rows):
    """Exact match at every uniform budget M = 1..L, overall and by depth (cached in the run's folder)."""
    cached = os.path.join(path, EVAL_FILE)
    if os.path.exists(cached):
        with open(cached) as f:
            return json.load(f)
    import torch

    from looped_training.loopformer.metrics import build_eval_data, evaluate_quality, load_checkpoint

    torch.set_num_threads(1)
    model, tokenizer, meta = load_checkpoint(path)
    task, data, _ = build_eval_data(meta, tokenizer, max_rows)
    budgets = list(range(1, model.config.num_loops + 1))
    records = evaluate_quality(model, task, data, budgets, ("uniform",), disable_tqdm=True)
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    result = {
        "em": [r["em"] for r in records],
        "em_by_depth": [r["em_by_depth"] for r in records],
        "train_runtime_s": meta.get("train_runtime_s"),
        "train_loss": state["log_history"][-1].get("train_loss"),
        "max_steps": meta["optimizer"]["max_steps"],
    }
    with open(cached, "w") as f:
        json.dump(result, f, indent=2)
    return result


def mean(xs):
    return sum(xs) / len(xs)


def seed_results(runs_dir, cell, max_rows, previous=None):
    """{seed: {variant: evaluation}}: the seeds finished on disk, and the seeds the committed table holds for the
    cell's flags that are not on disk (runs/ is not committed: a fresh checkout adds seeds to a cell, not replaces
    them)."""
    results = {}
    if previous and previous["flags"] == CELLS[cell]:
        results = {s: {v: previous["runs"][v][i] for v in VARIANTS} for i, s in enumerate(previous["seeds"])}
    for s in seeds_on_disk(runs_dir, cell):
        results[s] = {v: evaluate(run_dir(runs_dir, cell, v, s), max_rows) for v in VARIANTS}
    return dict(sorted(results.items()))


def summarise(runs_dir, cells, max_rows, previous=None):
    summary = {}
    for cell in cells:
        results = seed_results(runs_dir, cell, max_rows, (previous or {}).get(cell))
        seeds = list(results)
        if len(seeds) < 2:  # a mean needs two seeds
            continue
        runs = {v: [results[s][v] for s in seeds] for v in VARIANTS}
        curves = {v: [mean(col) for col in zip(*(r["em"] for r in rs))] for v, rs in runs.items()}
        spread = {v: [max(col) - min(col) for col in zip(*(r["em"] for r in rs))] for v, rs in runs.items()}
        depths = {
            v: {
                d: [mean([r["em_by_depth"][m][d] for r in rs]) for m in range(len(rs[0]["em"]))]
                for d in rs[0]["em_by_depth"][0]
            }
            for v, rs in runs.items()
        }
        summary[cell] = {
            "flags": CELLS[cell],
            "seeds": seeds,
            "curves": curves,
            "spread": spread,
            "by_depth": depths,
            "train_runtime_s": {v: mean([r["train_runtime_s"] for r in rs]) for v, rs in runs.items()},
            "runs": runs,
            "verdicts": budget_claims(curves["loopformer"], curves["base_loop"]),
            "per_seed_verdicts": per_seed_verdicts(runs),
        }
    return summary


def per_seed_verdicts(runs):
    """The three verdicts of each seed alone: LoopFormer seed s against Base-Loop seed s."""
    return [budget_claims(lf["em"], bl["em"]) for lf, bl in zip(runs["loopformer"], runs["base_loop"])]


def verdict_word(claim):
    # (c) is two-sided: a LoopFormer more than 0.05 *ahead* of Base-Loop fails it too
    if claim.get("ahead"):
        return f"no (ahead by {claim['gap']:.3f})"
    return "holds" if claim["holds"] else "no"


def yes(holds):
    return "**holds**" if holds else "does not hold"


def seeds_meeting_all_three(per_seed):
    """(seeds meeting (a), (b) and (c); the same with (c) read one-sided: LoopFormer no more than 0.05 behind)."""
    strict = sum(all(c["holds"] for c in claims.values()) for claims in per_seed)
    not_behind = sum(
        c["a_improves_with_budget"]["holds"]
        and c["b_no_collapse_at_M1"]["holds"]
        and c["c_elastic_for_free"]["not_behind"]
        for c in per_seed
    )
    return strict, not_behind


def overview(summary):
    """One row per cell: the three margins of the seed means and how many seeds meet all three alone."""
    lines = [
        "## Overview",
        "",
        "The three margins of each cell's seed means ((a) gain over M, (b) LoopFormer − Base-Loop at M=1, (c) "
        "LoopFormer − Base-Loop at M=L; thresholds ≥ 0.10, ≥ 0.10, within ±0.05), and the seeds that meet "
        "all three alone (and with (c) one-sided: no more than 0.05 behind).",
        "",
        "| cell | seeds | LoopFormer M=1 → M=L | Base-Loop M=1 → M=L | (a) gain | (b) margin | (c) gap | "
        "all three (one-sided c) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell, s in summary.items():
        v, lf, bl = s["verdicts"], s["curves"]["loopformer"], s["curves"]["base_loop"]
        strict, not_behind = seeds_meeting_all_three(s["per_seed_verdicts"])
        lines.append(
            f"| {cell} | {len(s['seeds'])} | {lf[0]:.3f} → {lf[-1]:.3f} | {bl[0]:.3f} → {bl[-1]:.3f} | "
            f"{v['a_improves_with_budget']['gain']:+.3f} | {v['b_no_collapse_at_M1']['margin']:+.3f} | "
            f"{v['c_elastic_for_free']['gap']:+.3f} | {strict} ({not_behind}) of {len(s['seeds'])} |"
        )
    return lines + [""]


def markdown(summary, command):
    lines = [
        "# LoopFormer sweep: where depth pays (synthetic arithmetic chains)",
        "",
        f"Written by `{command}`; every number below is in benchmarks/results/sweep_loopformer.json.",
        f"Base recipe: `{BASE_CONFIG}` (d=128, one block looped L=4 times, batch 64, lr 1e-3, warm-up 100, "
        "2000 steps, depths 1..4, 100k training problems); each cell changes only the flags named. "
        "Exact match on 500 held-out problems, mean of the seeds each cell names (± half the spread between "
        "the best and the worst seed). Chance is 0.1 (one answer digit mod 10).",
        "",
    ]
    lines += overview(summary)
    for cell, s in summary.items():
        L = len(s["curves"]["loopformer"])
        seeds = s["seeds"]
        lines += [
            f"## {cell}: `{' '.join(s['flags']) or '(the base recipe)'}`",
            "",
            f"Seeds {', '.join(map(str, seeds))}.",
            "",
            "| model | " + " | ".join(f"M={m}" for m in range(1, L + 1)) + " | train s |",
            "|---|" + "---|" * (L + 1),
        ]
        for v, name in VARIANTS.items():
            cells = [f"{c:.3f} ± {d / 2:.3f}" for c, d in zip(s["curves"][v], s["spread"][v])]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {s['train_runtime_s'][v]:.0f} |")
        depth_lf = s["by_depth"]["loopformer"]
        depth_bl = s["by_depth"]["base_loop"]
        lines += [
            "",
            "By depth at M=1 → M=L: LoopFormer "
            + ", ".join(f"d{d} {c[0]:.2f}→{c[-1]:.2f}" for d, c in depth_lf.items())
            + "; Base-Loop "
            + ", ".join(f"d{d} {c[0]:.2f}→{c[-1]:.2f}" for d, c in depth_bl.items())
            + ".",
            "",
        ]
        v = s["verdicts"]
        lines += [
            f"- (a) LoopFormer improves with budget: gain {v['a_improves_with_budget']['gain']:+.3f}, worst "
            f"step back {v['a_improves_with_budget']['worst_step_back']:.3f}: "
            f"{yes(v['a_improves_with_budget']['holds'])}",
            f"- (b) no collapse at M=1: LoopFormer − Base-Loop {v['b_no_collapse_at_M1']['margin']:+.3f}: "
            f"{yes(v['b_no_collapse_at_M1']['holds'])}",
            f"- (c) elastic for free: LoopFormer − Base-Loop at M=L {v['c_elastic_for_free']['gap']:+.3f}: "
            f"{yes(v['c_elastic_for_free']['holds'])}",
        ]
        per_seed = [
            f"seed {seed}: " + " / ".join(verdict_word(c) for c in claims.values())
            for seed, claims in zip(seeds, s["per_seed_verdicts"])
        ]
        all_three, not_behind = seeds_meeting_all_three(s["per_seed_verdicts"])
        lines += [
            "- each seed alone (LoopFormer seed s against Base-Loop seed s), (a) / (b) / (c): "
            + "; ".join(per_seed)
            + f"; all three hold for {all_three} of {len(seeds)} seeds, and for "
            f"{not_behind} if (c) only asks LoopFormer to end no more than 0.05 behind",
            "",
        ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs_dir", default="runs/sweep_loopformer")
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=list(SEEDS),
        help="Seeds to train in each cell (runs on disk are not trained again).",
    )
    parser.add_argument("--jobs", type=int, default=2, help="Runs trained at once (one thread each).")
    parser.add_argument("--max_rows", type=int, default=500, help="Held-out problems evaluated.")
    parser.add_argument("--table_only", action="store_true", help="Only rewrite the table from runs on disk.")
    parser.add_argument("--output_dir", default=RESULTS)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise SystemExit(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    if not args.table_only:
        todo = [(c, v, s) for c in args.cells for s in args.seeds for v in VARIANTS]
        with ThreadPoolExecutor(args.jobs) as pool:
            for future in [pool.submit(train, args.runs_dir, *job) for job in todo]:
                future.result()
    previous = {}
    path = os.path.join(args.output_dir, "sweep_loopformer.json")
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
    summary = summarise(args.runs_dir, args.cells, args.max_rows, previous)
    os.makedirs(args.output_dir, exist_ok=True)
    previous.update(summary)  # cells not run this time keep their numbers
    order = list(CELLS)  # the table in the order of CELLS, whatever order the cells were run in
    previous = dict(sorted(previous.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    with open(path, "w") as f:
        json.dump(previous, f, indent=2)
    with open(os.path.join(args.output_dir, "sweep_loopformer.md"), "w") as f:
        f.write(markdown(previous, "python -m benchmarks.sweep_loopformer") + "\n")
    for cell, s in summary.items():
        print(
            cell,
            {k: v["holds"] for k, v in s["verdicts"].items()},
            {v: [round(x, 3) for x in c] for v, c in s["curves"].items()},
        )


if __name__ == "__main__":
    main()
