"""Regenerate docs/results.md (and docs/plots/) from training runs: one command trains what is missing, evaluates
and writes the report.

    python -m looped_training.loopformer.report             # train missing runs under runs/results, evaluate, write the docs
    python -m looped_training.loopformer.report --no_train  # only evaluate existing runs and rewrite the docs

Runs: the six variants (LoopFormer, Base-Loop, TMLT, TMLT-EE, Naive-Loop-EE, iso-FLOP Base) on the embedded
synthetic task and, where ../shared/data/shakespeare exists, on Shakespeare, at the tiny CPU sizes of `CONFIGS`
(looped_training/configs/loopformer/).
Every number and every verdict in the report is computed here from `elastic_eval.json`; nothing is typed in.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

from looped_training.loopformer.data import TRAINING_META_FILE
from looped_training.loopformer.evaluate import EVAL_FILE, SCHEDULES, format_table, quality_by_budget
from looped_training.loopformer.evaluate import main as evaluate_checkpoints

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAKESPEARE = os.path.join(REPO, "..", "shared", "data", "shakespeare")
VARIANTS = [("loopformer", "LoopFormer"), ("base_loop", "Base-Loop"), ("tmlt", "TMLT"), ("tmlt_ee", "TMLT-EE"),
            ("naive_loop_ee", "Naive-Loop-EE"), ("base", "Base (iso-FLOP)")]
EE_VARIANTS = ("tmlt_ee", "naive_loop_ee")
# Each task's sizes (looped_training/configs/loopformer/: d=128, one shared block, L=4, as scripts/main.sh), and what the report
# changes: no checkpoints, no progress bars in the logs.
CONFIGS = {"synthetic": "looped_training/configs/loopformer/synthetic-tiny.yaml",
           "shakespeare": "looped_training/configs/loopformer/shakespeare-tiny.yaml"}
REPORT_FLAGS = ["--save_strategy", "no", "--disable_tqdm", "true"]
HALT_EPS = ["0.05", "0.1", "0.2", "0.3", "0.5", "0.8"]  # the adaptive-depth sweep (issue 6)


def train_missing(runs_dir, tasks, parallel=2):
    """Train every (task, variant) run that has no finished output yet, `parallel` at a time, one thread each."""
    jobs = []
    for task in tasks:
        for variant, _ in VARIANTS:
            out = os.path.join(runs_dir, task, variant)
            if os.path.exists(os.path.join(out, TRAINING_META_FILE)):
                continue
            os.makedirs(out, exist_ok=True)
            cmd = [sys.executable, "-m", "looped_training.loopformer.train", "--config", CONFIGS[task], "--output_dir", out,
                   "--variant", variant, *REPORT_FLAGS]
            if task == "shakespeare":  # the same files by absolute path, which the evaluation finds from any folder
                cmd += ["--train_files", SHAKESPEARE]
            jobs.append((out, cmd))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    running = []
    while jobs or running:
        while jobs and len(running) < parallel:
            out, cmd = jobs.pop(0)
            print("training", out, flush=True)
            log = open(out + ".log", "w")
            running.append((out, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(2)
        for item in list(running):
            out, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                if proc.returncode != 0:
                    raise RuntimeError(f"training {out} failed (exit {proc.returncode}); see {out}.log")


def evaluate(runs_dir, task):
    names = [(v, n) for v, n in VARIANTS if os.path.exists(os.path.join(runs_dir, task, v, TRAINING_META_FILE))]
    out = os.path.join(runs_dir, task, "eval")
    evaluate_checkpoints([*[os.path.join(runs_dir, task, v) for v, _ in names], "--names", *[n for _, n in names],
                          "--output_dir", out, "--max_rows", "500", "--halt_eps", *HALT_EPS])
    return out


# ---- verdicts, computed from the numbers -------------------------------------------------------------------------

def _metric(task):
    return ("em", True) if task == "synthetic" else ("ppl", False)  # (metric, higher is better)


def monotonic_verdict(rec, task):
    metric, higher = _metric(task)
    values = quality_by_budget(rec, "uniform", metric)
    ms = sorted(values)
    worst = 0.0
    for a, b in zip(ms, ms[1:]):
        change = (values[b] - values[a]) if higher else (values[a] - values[b])
        worst = min(worst, change)
    tol = 0.01 if higher else 0.01 * values[ms[0]]
    holds = worst >= -tol
    if max(values.values()) - min(values.values()) < 1e-9:
        return False, (f"{rec['name']}: {metric} is the same at every M ({values[ms[0]]:.3f}): the output does not "
                       f"depend on the loop budget (the loop learned nothing usable), so the claim is vacuous here")
    return holds, (f"{rec['name']}: {metric} from M=1 to M={ms[-1]}: "
                   + ", ".join(f"{values[m]:.3f}" for m in ms)
                   + f"; largest step backwards {-worst:.3f} -> {'holds' if holds else 'does not hold'}"
                   + f" (tolerance {tol:.3f})")


def small_budget_verdict(records, task):
    metric, higher = _metric(task)
    lf = next((r for r in records if r["variant"] == "loopformer"), None)
    ees = [r for r in records if r["variant"] in EE_VARIANTS]
    if lf is None or not ees:
        return ["(LoopFormer or the early-exit baselines are missing: no comparison.)"]
    L = lf["num_loops"]
    budgets = [m for m in range(1, L + 1) if m <= L / 4] or [1]
    lines = []
    for m in budgets:
        ours = quality_by_budget(lf, "uniform", metric)[m]
        for ee in ees:
            theirs = quality_by_budget(ee, "uniform", metric)[m]
            better = ours > theirs if higher else ours < theirs
            lines.append(f"M={m} (<= L/4 = {L / 4:g}): LoopFormer {metric} {ours:.3f} vs {ee['name']} {theirs:.3f} "
                         f"-> LoopFormer {'better' if better else 'not better'}")
    return lines


def representation_lines(records):
    lines = ["| model | CKA(step i, i-1) for i=1..L | prompt entropy, steps 0..L | anisotropy, steps 0..L |",
             "|---|---|---|---|"]
    for rec in records:
        r = rec["representations"]
        fmt = lambda xs: " ".join("–" if not math.isfinite(x) else f"{x:.2f}" for x in xs)  # noqa: E731
        lines.append(f"| {rec['name']} | {fmt(r['cka_to_previous'][1:])} | {fmt(r['prompt_entropy'])} | "
                     f"{fmt(r['anisotropy'])} |")
    return lines


def evolution_verdict(records):
    """Does LoopFormer keep changing in late steps (lower CKA to the previous step) while the baselines settle?"""
    out = []
    for rec in records:
        cka = [x for x in rec["representations"]["cka_to_previous"][1:] if math.isfinite(x)]
        ent = rec["representations"]["prompt_entropy"]
        if len(cka) < 2:
            continue
        late = cka[len(cka) // 2:]
        out.append((rec["name"], 1 - sum(late) / len(late), ent[-1] - ent[1]))
    out.sort(key=lambda x: -x[1])
    return [f"{name}: late-step change 1 - mean CKA(i, i-1) over the second half of the steps = {change:.3f}; "
            f"prompt entropy step L minus step 1 = {dent:+.3f}" for name, change, dent in out]


def halting_lines(records, task):
    """Adaptive depth per token (halt_eps) against fixed budgets at equal mean loops per token (issue 6)."""
    metric, higher = _metric(task)
    lines = ["### Adaptive depth per token (`halt_eps`) against fixed budgets", "",
             "Full budget M = L, uniform schedule; a token stops looping once its relative state change falls below "
             "halt_eps. 'fixed M at equal compute' interpolates the fixed-budget curve linearly at the same mean "
             "loops per token.", ""]
    for rec in records:
        if not rec.get("halting"):
            continue
        fixed = quality_by_budget(rec, "uniform", metric)
        ms = sorted(fixed)

        def at(loops):  # fixed-budget quality interpolated at `loops` mean steps per token
            lo = max([m for m in ms if m <= loops], default=ms[0])
            hi = min([m for m in ms if m >= loops], default=ms[-1])
            if hi == lo:
                return fixed[lo]
            w = (loops - lo) / (hi - lo)
            return (1 - w) * fixed[lo] + w * fixed[hi]

        lines += [f"{rec['name']}:", "", f"| halt_eps | mean loops/token | {metric} | fixed M at equal compute | "
                  "adaptive better? |", "|---|---|---|---|---|"]
        for h in rec["halting"]:
            ref = at(h["mean_loops"])
            better = h[metric] > ref if higher else h[metric] < ref
            same = abs(h[metric] - ref) < 1e-9
            lines.append(f"| {h['halt_eps']:g} | {h['mean_loops']:.2f} | {h[metric]:.3f} | {ref:.3f} | "
                         f"{'equal' if same else 'yes' if better else 'no'} |")
        lines.append("")
    if any(rec.get("halting") for rec in records):
        lines += [f"![adaptive depth]({'plots/' + task + '_quality_vs_compute.png'})", ""]
    return lines


def write_report(runs_dir, tasks, docs_dir):
    plots_dir = os.path.join(docs_dir, "plots")
    os.makedirs(plots_dir, exist_ok=True)
    md = ["# Results at tiny scale (CPU)", "",
          "Generated by `python -m looped_training.loopformer.report` from the runs under "
          f"`{os.path.relpath(runs_dir, REPO)}`; every number and verdict below is computed from "
          "`elastic_eval.json` by that command. Settings: each task's config file below, with " + " ".join(REPORT_FLAGS),
          ""]
    for task in tasks:
        path = os.path.join(runs_dir, task, "eval", EVAL_FILE)
        if not os.path.exists(path):
            md += [f"## {task}", "", f"No evaluation at `{os.path.relpath(path, REPO)}`: not run.", ""]
            continue
        with open(path) as f:
            records = json.load(f)["models"]
        for name in ("quality_vs_budget.png", "representations.png", "quality_vs_compute.png"):
            if os.path.exists(os.path.join(os.path.dirname(path), name)):
                shutil.copy(os.path.join(os.path.dirname(path), name), os.path.join(plots_dir, f"{task}_{name}"))
        metric, _ = _metric(task)
        md += [f"## {task}", "", f"Task settings: `{CONFIGS[task]}`", "",
               "| model | parameters | train time (s) |", "|---|---|---|"]
        md += [f"| {r['name']} | {r['parameters']} | {r['train_runtime_s'] or float('nan'):.0f} |" for r in records]
        title = "Exact match on held-out problems" if task == "synthetic" else "Held-out perplexity"
        md += ["", f"### {title} by loop budget M (uniform schedule; Base is its single full-depth pass, at M = L)",
               "", format_table(records, metric, digits=3 if metric == "em" else 2), ""]
        if task == "synthetic":
            md += ["Answer perplexity:", "", format_table(records, "ppl", digits=2), ""]
            full = []
            for rec in records:
                res = [r for r in rec["results"] if r["schedule"] == "uniform" and r["em_by_depth"]]
                best = res[-1]
                full.append(f"| {rec['name']} | " + " | ".join(f"{v:.2f}" for v in best["em_by_depth"].values())
                            + " |")
            depths = list(res[-1]["em_by_depth"])
            md += ["Exact match by depth at the full budget:", "",
                   "| model | " + " | ".join(f"depth {d}" for d in depths) + " |", "|" + "---|" * (len(depths) + 1),
                   *full, ""]
        lf = [r for r in records if r["variant"] == "loopformer"]
        if lf:
            md += ["### LoopFormer by schedule", "", "| schedule | " + " | ".join(
                f"M={m}" for m in range(1, lf[0]["num_loops"] + 1)) + " |", "|" + "---|" * (lf[0]["num_loops"] + 1)]
            for s in SCHEDULES:
                vals = quality_by_budget(lf[0], s, metric)
                md.append(f"| {s} | " + " | ".join("–" if vals.get(m) is None else f"{vals[m]:.3f}"
                                                    for m in range(1, lf[0]["num_loops"] + 1)) + " |")
            md.append("")
        md += ["### The paper's claims at this scale", "",
               "1. Quality does not get worse as M grows (uniform schedule):", ""]
        md += [f"   - {monotonic_verdict(r, task)[1]}" for r in records if r["variant"] != "base"]
        md += ["", "2. At M <= L/4, LoopFormer is better than the early-exit baselines:", ""]
        md += [f"   - {line}" for line in small_budget_verdict(records, task)]
        md += ["", "3. Representations keep evolving across loop steps (full trajectory, M = L):", ""]
        md += [f"   - {line}" for line in evolution_verdict(records)]
        md += ["", *representation_lines(records), "",
               f"![quality]({'plots/' + task + '_quality_vs_budget.png'})",
               f"![representations]({'plots/' + task + '_representations.png'})", ""]
        md += halting_lines(records, task)
    md += ["## Caveats", "",
           "Tiny models trained for a few minutes on a shared 2-core CPU, one seed each (chance exact match on the "
           "synthetic task is 0.1: ten possible answers): "
           "differences of a few points are within run-to-run noise. The claims are checked as stated, and the "
           "verdicts above say which held in these runs, nothing more."]
    with open(os.path.join(docs_dir, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return os.path.join(docs_dir, "results.md")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Regenerate docs/results.md from runs (training what is missing).")
    parser.add_argument("--runs_dir", default=os.path.join(REPO, "runs", "results"))
    parser.add_argument("--docs_dir", default=os.path.join(REPO, "docs"))
    parser.add_argument("--tasks", nargs="*", default=["synthetic", "shakespeare"])
    parser.add_argument("--no_train", dest="train", action="store_false", help="Only evaluate existing runs.")
    parser.add_argument("--parallel", type=int, default=2, help="Training runs at once (one thread each).")
    args = parser.parse_args(argv)
    bad = [t for t in args.tasks if t not in CONFIGS]
    if bad:
        raise ValueError(f"--tasks {bad} unknown; allowed: {tuple(CONFIGS)}.")
    tasks = [t for t in args.tasks if t != "shakespeare" or os.path.isdir(SHAKESPEARE)]
    if len(tasks) < len(args.tasks):
        print(f"skipping shakespeare: {os.path.normpath(SHAKESPEARE)} does not exist", flush=True)
    if not args.train:  # refuse before anything is written: a report of stubs would replace the real one
        empty = {t: [os.path.join(args.runs_dir, t, v) for v, _ in VARIANTS] for t in tasks
                 if not any(os.path.exists(os.path.join(args.runs_dir, t, v, TRAINING_META_FILE)) for v, _ in VARIANTS)}
        if empty:
            raise ValueError(f"--no_train: no finished run for {sorted(empty)}; expected one of "
                             + "; ".join(f"{t}: {', '.join(dirs)}" for t, dirs in empty.items())
                             + f". Train them (drop --no_train) or pass the right --runs_dir; "
                             f"{os.path.join(args.docs_dir, 'results.md')} was left as it was.")
    if args.train:
        train_missing(args.runs_dir, tasks, args.parallel)
    for task in tasks:
        if os.path.isdir(os.path.join(args.runs_dir, task)):
            evaluate(args.runs_dir, task)
    print("wrote", write_report(args.runs_dir, args.tasks, args.docs_dir))


if __name__ == "__main__":
    main()
