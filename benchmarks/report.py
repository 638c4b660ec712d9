"""Regenerate benchmarks/writeups/loopformer_report.md (and its plots/) from training runs: one command trains what
is missing, evaluates and writes the report. A lab script (not in the wheel): run from the repository root.

    python -m benchmarks.report             # train missing runs under runs/results, evaluate, write
    python -m benchmarks.report --no_train  # only evaluate existing runs and rewrite the report
    python -m benchmarks.report --preset gpu --runs_dir runs/results-gpu   # one accelerator

The study, per task (the embedded synthetic task and, where --shakespeare exists, Shakespeare): the six
variants (LoopFormer, Base-Loop, TMLT, TMLT-EE, Naive-Loop-EE, iso-FLOP Base), a second seed of LoopFormer and of
TMLT-EE, and LoopFormer under the other initialisation (`initializer_scheme="zero_adaln"`): `RUNS`. Sizes: the
preset's config files (benchmarks/configs/report-<task>-<preset>.yaml). `cpu`: the synthetic runs are the
sweep's steps8k-warmup2000 cell (benchmarks/sweep_loopformer.py; one block looped L = 4 times, so M <= L/4 is M = 1),
the Shakespeare runs k = 2 blocks looped L = 8 times (M <= L/4 is M in {1, 2}, and the schedules differ at M = 2..7),
1500 steps; each task's nine runs take 1 h 20 min to 1 h 40 min two at a time on a 2-core machine, evaluation
included (synthetic measured 2026-12-02 and -03, Shakespeare 2026-12-01). `--tasks synthetic` regenerates one task and keeps the other's section of
the report as it is. `gpu` is sized for about ten minutes on one accelerator (the default when CUDA is
available; k = 2, L = 8 for both tasks; halved after a first H200 run at twice its size took about fifteen, and not
run since).

Every number and every verdict in the report is computed here from `elastic_eval.json` and the runs' own files;
nothing is typed in.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


from benchmarks.bench_halt_criteria import halting_sweep_summary
from looped_training.loopformer.data import TRAINING_META_FILE
from looped_training.loopformer.metrics import SCHEDULES
from looped_training.loopformer.report import EVAL_FILE, format_table, halting_table, quality_by_budget
from benchmarks.halting_rules import main as evaluate_with_the_labs_rules

ROOT = Path(__file__).resolve().parent.parent
# the presets: training config files of the report's runs (`python -m looped_training.loopformer.train --config FILE`)
CONFIG_DIR = ROOT / "benchmarks" / "configs"
# the exit-rule sweeps (benchmarks/bench_halt_criteria.py), read into the halting sections when present
HALTING_SWEEPS = Path(__file__).resolve().parent / "results"
OUT_DIR = os.path.join("benchmarks", "writeups")
REPORT_FILE = "loopformer_report.md"
PRESETS = ("cpu", "gpu")
TASKS = ("synthetic", "shakespeare")
# (run folder, variant, display name, comparison group, extra training flags). Seeds of one configuration share a
# group; the verdicts read a group's spread across its seeds.
RUNS = [
    ("loopformer", "loopformer", "LoopFormer", "LoopFormer", []),
    ("loopformer_seed1", "loopformer", "LoopFormer (seed 1)", "LoopFormer", ["--seed", "1", "--shortcut_seed", "1"]),
    (
        "loopformer_zero_adaln",
        "loopformer",
        "LoopFormer (zero adaLN)",
        "LoopFormer (zero adaLN)",
        ["--initializer_scheme", "zero_adaln"],
    ),
    ("base_loop", "base_loop", "Base-Loop", "Base-Loop", []),
    ("tmlt", "tmlt", "TMLT", "TMLT", []),
    ("tmlt_ee", "tmlt_ee", "TMLT-EE", "TMLT-EE", []),
    ("tmlt_ee_seed1", "tmlt_ee", "TMLT-EE (seed 1)", "TMLT-EE", ["--seed", "1", "--shortcut_seed", "1"]),
    ("naive_loop_ee", "naive_loop_ee", "Naive-Loop-EE", "Naive-Loop-EE", []),
    ("base", "base", "Base (iso-FLOP)", "Base (iso-FLOP)", []),
]
GROUP = {name: group for _, _, name, group, _ in RUNS}
EE_GROUPS = ("TMLT-EE", "Naive-Loop-EE")
LOOPED_BASELINES = ("Base-Loop", "TMLT", "TMLT-EE", "Naive-Loop-EE")
REPORT_FLAGS = ["--save_strategy", "no", "--disable_tqdm", "true"]
HALT_EPS = ["0.05", "0.1", "0.2", "0.3", "0.5", "0.8"]  # the adaptive-depth sweep
# its exit rules: both threshold the relative state change; the '_shortcut' one only on models conditioned on Δ
# (every rule at its own thresholds: benchmarks/bench_halt_criteria.py, read in by halting_sweep_lines)
HALT_CRITERIA_SWEPT = ["state_change", "state_change_shortcut"]
# The authors' run (../shared/spec/loopformer.md, "What the authors' training code actually does"), for the scale
# comparison: 50k iterations of ~0.5M tokens.
AUTHORS_TOKENS = 50_000 * 524_288


def config_path(task, preset):
    return CONFIG_DIR / f"report-{task}-{preset}.yaml"


def train_missing(runs_dir, tasks, preset, shakespeare, parallel):
    """Train every (task, run) that has no finished output yet, `parallel` at a time (one thread each on CPU)."""
    jobs = []
    for task in tasks:
        for folder, variant, _, _, extra in RUNS:
            out = os.path.join(runs_dir, task, folder)
            if os.path.exists(os.path.join(out, TRAINING_META_FILE)):
                continue
            os.makedirs(out, exist_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "looped_training.loopformer.train",
                "--config",
                str(config_path(task, preset)),
                "--output_dir",
                out,
                "--variant",
                variant,
                *extra,
                *REPORT_FLAGS,
            ]
            if task == "shakespeare":  # by absolute path, which the evaluation finds again from any folder
                cmd += ["--train_files", os.path.abspath(shakespeare)]
            jobs.append((out, cmd))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if preset == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    running, done, total, start = [], 0, len(jobs), time.time()
    while jobs or running:
        while jobs and len(running) < parallel:
            out, cmd = jobs.pop(0)
            log = open(out + ".log", "w")
            running.append(
                (out, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, time.time())
            )
            print(f"[{done + len(running)}/{total}] training {out} (log: {out}.log)", flush=True)
        time.sleep(2)
        for item in list(running):
            out, proc, log, began = item
            if proc.poll() is None:
                continue
            log.close()
            running.remove(item)
            if proc.returncode != 0:
                raise RuntimeError(f"training {out} failed (exit {proc.returncode}); see {out}.log")
            done += 1
            print(
                f"[{done}/{total} done] {out} in {time.time() - began:.0f} s; {time.time() - start:.0f} s so far",
                flush=True,
            )


def evaluate(runs_dir, task, max_rows):
    runs = [(f, n) for f, _, n, _, _ in RUNS if os.path.exists(os.path.join(runs_dir, task, f, TRAINING_META_FILE))]
    out = os.path.join(runs_dir, task, "eval")
    evaluate_with_the_labs_rules(
        [
            *[os.path.join(runs_dir, task, f) for f, _ in runs],
            "--names",
            *[n for _, n in runs],
            "--output_dir",
            out,
            "--max_rows",
            str(max_rows),
            "--halt_eps",
            *HALT_EPS,
            "--halt_criteria",
            *HALT_CRITERIA_SWEPT,
        ]
    )
    return out


# ---- groups of seeds ---------------------------------------------------------------------------------------------


def _metric(task):
    return ("em", True) if task == "synthetic" else ("ppl", False)  # (metric, higher is better)


def members(records, group):
    return [r for r in records if GROUP.get(r["name"], r["name"]) == group]


def group_curve(records, group, metric, schedule="uniform"):
    """{M: [value of each seed]} of a group."""
    curve = {}
    for rec in members(records, group):
        for m, v in quality_by_budget(rec, schedule, metric).items():
            if v is not None:
                curve.setdefault(m, []).append(v)
    return curve


def mean(xs):
    return sum(xs) / len(xs)


def spread_text(xs, digits=3):
    return f"{mean(xs):.{digits}f}" + (f" ({min(xs):.{digits}f}–{max(xs):.{digits}f})" if len(xs) > 1 else "")


def seeds_table(records, metric, digits):
    """Mean (min–max over seeds) per budget, for every group with more than one seed."""
    groups = [g for g in dict.fromkeys(GROUP.values()) if len(members(records, g)) > 1]
    L = max(r["num_loops"] for r in records)
    lines = ["| group (seeds) | " + " | ".join(f"M={m}" for m in range(1, L + 1)) + " |", "|" + "---|" * (L + 1)]
    for g in groups:
        curve = group_curve(records, g, metric)
        lines.append(
            f"| {g} ({len(members(records, g))}) | "
            + " | ".join(spread_text(curve[m], digits) if m in curve else "–" for m in range(1, L + 1))
            + " |"
        )
    return lines


# ---- verdicts, computed from the numbers -------------------------------------------------------------------------


def better(a, b, higher):
    return a > b if higher else a < b


def monotonic_verdict(records, group, task):
    """Claim 1: quality does not get worse as M grows (the group's mean over seeds, uniform schedule)."""
    metric, higher = _metric(task)
    values = {m: mean(v) for m, v in group_curve(records, group, metric).items()}
    ms = sorted(values)
    steps = [(values[b] - values[a]) if higher else (values[a] - values[b]) for a, b in zip(ms, ms[1:])]
    worst = min([0.0, *steps])
    tol = 0.01 if higher else 0.01 * values[ms[0]]
    curve = ", ".join(f"{values[m]:.3f}" for m in ms)
    if max(values.values()) - min(values.values()) < 1e-9:
        return False, (
            f"{group}: {metric} is the same at every M ({curve.split(',')[0]}): the output does not depend "
            f"on the loop budget, so the claim is vacuous here -> does not hold"
        )
    holds = worst >= -tol
    return holds, (
        f"{group}: {metric} from M=1 to M={ms[-1]}: {curve}; largest step backwards {-worst:.3f} "
        f"(tolerance {tol:.3f}) -> {'holds' if holds else 'does not hold'}"
    )


def small_budget_verdict(records, task):
    """Claim 2: at M <= L/4 LoopFormer is ahead of each early-exit baseline, beyond the seed spread (every seed of
    LoopFormer better than every seed of the baseline)."""
    metric, higher = _metric(task)
    lf = group_curve(records, "LoopFormer", metric)
    if not lf or not any(members(records, g) for g in EE_GROUPS):
        return None, ["(LoopFormer or the early-exit baselines are missing: no comparison.)"]
    L = members(records, "LoopFormer")[0]["num_loops"]
    lines, verdicts = [], []
    small = [m for m in range(1, L + 1) if m <= L / 4]
    if not small:
        return None, [f"(L = {L}: no budget M <= L/4, so the claim is not tested.)"]
    for m in small:
        for group in EE_GROUPS:
            ee = group_curve(records, group, metric).get(m)
            if not ee:
                continue
            worst_lf = min(lf[m]) if higher else max(lf[m])
            best_ee = max(ee) if higher else min(ee)
            if better(worst_lf, best_ee, higher):
                status = "ahead beyond the seed spread"
            elif better(mean(lf[m]), mean(ee), higher):
                status = "ahead on the mean but within the seed spread"
            else:
                status = "not ahead"
            verdicts.append(status == "ahead beyond the seed spread")
            lines.append(
                f"M={m}: LoopFormer {metric} {spread_text(lf[m])} vs {group} {spread_text(ee)} "
                f"({len(lf[m])} and {len(ee)} seeds) -> {status}"
            )
    return all(verdicts), lines


def schedule_verdict(records, task):
    """Claim 3: at a fixed M, coarse-to-fine is the best schedule (LoopFormer, mean over seeds), at every M where the
    schedules are different trajectories."""
    metric, higher = _metric(task)
    curves = {s: group_curve(records, "LoopFormer", metric, s) for s in SCHEDULES}
    lines, wins, compared = [], 0, 0
    for m in sorted(curves["uniform"]):
        values = {s: mean(c[m]) for s, c in curves.items() if c.get(m)}
        if len(values) < 2 or all(abs(v - values["uniform"]) < 1e-12 for v in values.values()):
            continue  # one schedule only, or all the same trajectory (M = 1, M = L)
        best = max(values, key=values.get) if higher else min(values, key=values.get)
        compared += 1
        wins += best == "coarse_to_fine"
        lines.append(f"M={m}: " + ", ".join(f"{s} {v:.3f}" for s, v in values.items()) + f" -> best: {best}")
    if not compared:
        return None, ["(No budget where the schedules differ.)"]
    holds = wins == compared
    lines.append(f"coarse_to_fine is best at {wins} of {compared} budgets -> {'holds' if holds else 'does not hold'}")
    return holds, lines


def representation_measures(rec):
    """Per run, from the full-trajectory step metrics (step 0 = embeddings, steps 1..L): how much the state still
    changes in the second half of the steps (1 - mean CKA(i, i-1)), how prompt entropy moves from step 1 to step L,
    and how much curvature still moves in the second half (mean |curvature(i) - curvature(i-1)|)."""
    r = rec["representations"]
    cka = [x for x in r["cka_to_previous"][1:] if math.isfinite(x)]
    curv = [x for x in r["curvature"][1:] if math.isfinite(x)]
    ent = r["prompt_entropy"]
    if len(cka) < 2 or len(curv) < 2:
        return None
    late_cka, late_curv = cka[len(cka) // 2 :], curv[len(curv) // 2 - 1 :]
    return {
        "cka_change": 1 - mean(late_cka),
        "entropy_change": ent[-1] - ent[1],
        "curvature_motion": mean([abs(b - a) for a, b in zip(late_curv, late_curv[1:])]),
    }


MEASURES = (
    ("cka_change", "late-step change 1 - CKA(i, i-1)"),
    ("entropy_change", "prompt entropy, step L - step 1"),
    ("curvature_motion", "late-step |Δ curvature|"),
)


def representation_verdict(records):
    """Claim 4: LoopFormer's representations keep changing across steps where the looped baselines stagnate: for
    each measure, every LoopFormer seed above every seed of every looped baseline."""
    per_group = {}
    for rec in records:
        measures = representation_measures(rec)
        if measures is not None:
            per_group.setdefault(GROUP.get(rec["name"], rec["name"]), []).append(measures)
    if "LoopFormer" not in per_group:
        return None, ["(No LoopFormer run with more than one step: no comparison.)"]
    lines, verdicts = [], []
    for key, label in MEASURES:
        lf = [m[key] for m in per_group["LoopFormer"]]
        rivals = {g: [m[key] for m in per_group[g]] for g in LOOPED_BASELINES if g in per_group}
        holds = all(min(lf) > max(v) for v in rivals.values())
        verdicts.append(holds)
        lines.append(
            f"{label}: LoopFormer {spread_text(lf)}; "
            + "; ".join(f"{g} {spread_text(v)}" for g, v in rivals.items())
            + f" -> {'holds' if holds else 'does not hold'}"
        )
    return all(verdicts), lines


def init_ablation_lines(records, task):
    """LoopFormer under the authors' initialisation (mean over seeds) against the zero-initialised adaLN."""
    metric, higher = _metric(task)
    ref, zero = group_curve(records, "LoopFormer", metric), group_curve(records, "LoopFormer (zero adaLN)", metric)
    if not ref or not zero:
        return ["(Either initialisation is missing.)"]
    ms = sorted(set(ref) & set(zero))
    wins = sum(better(mean(ref[m]), mean(zero[m]), higher) for m in ms)
    beyond = sum(better(min(ref[m]) if higher else max(ref[m]), zero[m][0], higher) for m in ms)
    return [
        "| init | " + " | ".join(f"M={m}" for m in ms) + " |",
        "|" + "---|" * (len(ms) + 1),
        "| reference (seeds) | " + " | ".join(spread_text(ref[m]) for m in ms) + " |",
        "| zero_adaln | " + " | ".join(f"{zero[m][0]:.3f}" for m in ms) + " |",
        "",
        f"The reference initialisation is better on the mean at {wins} of {len(ms)} budgets, with every seed "
        f"better at {beyond} of {len(ms)} ({metric}, {'higher' if higher else 'lower'} is better).",
    ]


def verdict_word(holds):
    return {True: "**holds**", False: "**does not hold**", None: "**not measured**"}[holds]


# ---- what was checked against the authors' code ------------------------------------------------------------------

EQUIVALENCE_TESTS = (
    "tests/loopformer/test_convert_authors.py::test_each_reference_model_type_converts_and_matches",
    "tests/loopformer/test_convert_authors.py::test_convert_wrapped_compiled_pt_matches_reference",
)


def equivalence_line(skip):
    """Runs the converter's oracle tests (their checkpoint layout with random weights, an independent forward in the
    test) when the checkout's tests/ is here."""
    tests = Path.cwd() / "tests" / "test_convert_authors.py"
    if skip or not tests.exists():
        return (
            f"Forward equivalence: not run by this command ({'--skip_checks' if skip else 'no ' + str(tests)}); "
            f"`pytest {' '.join(EQUIVALENCE_TESTS)}` checks it."
        )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *EQUIVALENCE_TESTS],
        capture_output=True,
        text=True,
    )
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return (
        f"Forward equivalence (`pytest {' '.join(EQUIVALENCE_TESTS)}`, their layouts for LoopFormer, TMLT, "
        f"Base-Loop and Base with random weights through the converter, logits against a forward written in the "
        f"test, atol 1e-4, budgets L, 2 and 1 and shortcut trajectories): {summary} (exit {proc.returncode})."
    )


def init_lines(run_dir):
    """Statistics of freshly initialised models of the run's configuration under both schemes, against the rule."""
    import torch

    from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM

    config = LoopFormerConfig.from_pretrained(run_dir)
    k = config.num_hidden_layers
    lines = [
        f"| scheme | adaLN weight std | residual projections std (rule 0.02/sqrt(2k) = {0.02 / math.sqrt(2 * k):.4f}) "
        "| other Linear std (rule 0.02) |",
        "|---|---|---|---|",
    ]
    for scheme in ("reference", "zero_adaln"):
        torch.manual_seed(0)
        model = LoopFormerForCausalLM(LoopFormerConfig.from_dict({**config.to_dict(), "initializer_scheme": scheme}))
        groups = {"adaln": [], "residual": [], "other": []}
        for name, p in model.named_parameters():
            if p.dim() != 2 or "embed" in name:
                continue
            key = (
                "adaln"
                if "adaLN" in name
                else "residual"
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else "other"
            )
            groups[key].append(p.detach().flatten())
        std = {key: float(torch.cat(v).std()) if v else float("nan") for key, v in groups.items()}
        lines.append(f"| {scheme} | {std['adaln']:.4f} | {std['residual']:.4f} | {std['other']:.4f} |")
    return lines


def optimiser_lines(run_dir):
    """The run's optimiser and data against the authors' settings, and the weight-decay split: the Trainer's
    (no decay on biases and norms) against theirs (decay exactly the parameters with >= 2 dimensions)."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from looped_training.checkpoints import load_model

    model = load_model(AutoModelForCausalLM, run_dir)
    names = set(
        Trainer(
            model=model,
            args=TrainingArguments(output_dir=os.path.join(run_dir, "_decay_check"), report_to="none", use_cpu=True),
        ).get_decay_parameter_names(model)
    )
    # by tensor, not by name: the tied lm_head is the embedding under a second name
    ours = {
        n
        for n, p in model.named_parameters()
        if n in names or any(q is p for m, q in model.named_parameters(remove_duplicate=False) if m in names)
    }
    theirs = {n for n, p in model.named_parameters() if p.dim() >= 2}
    with open(os.path.join(run_dir, TRAINING_META_FILE)) as f:
        meta = json.load(f)
    c = meta["optimizer"]
    batch = c["per_device_train_batch_size"] * c["gradient_accumulation_steps"]
    tokens = c["max_steps"] * batch * meta["block_size"]
    min_lr = (c.get("lr_scheduler_kwargs") or {}).get("min_lr_rate")
    return [
        "| setting | this run | the authors |",
        "|---|---|---|",
        f"| optimiser | AdamW ({c['adam_beta1']}, {c['adam_beta2']}) | AdamW (0.9, 0.95) |",
        f"| peak lr, schedule | {c['learning_rate']:g}, {c['lr_scheduler_type']}"
        + (f" to {min_lr:g}×peak" if min_lr else "")
        + f", {c['warmup_steps']:g} warm-up steps of {c['max_steps']} "
        "| 6e-4, cosine to 0.1×peak, 2000 warm-up steps of 50000 |",
        f"| weight decay | {c['weight_decay']:g}, on {len(ours)} tensors | 0.2, on {len(theirs)} tensors (>= 2-D) |",
        f"| decay split | {'the same tensors' if ours == theirs else 'differs: ' + ', '.join(sorted(ours ^ theirs))} | |",
        f"| gradient clipping | {c['max_grad_norm']:g} | 1.0 |",
        f"| tokens seen | {tokens:,} ({c['max_steps']} steps × {batch} × "
        f"{meta['block_size']}) | {AUTHORS_TOKENS:,} (50k × ~0.5M) |",
        f"| model | {model.num_parameters():,} parameters, d={model.config.hidden_size}, "
        f"{model.config.num_hidden_layers} blocks × {model.config.num_loops} loops | 3 blocks × 8 loops, GPT-2 size "
        "width, GPT-2 BPE, context 1024 |",
    ]


def objective_lines(runs_dir, task):
    lines = []
    for folder, _, name, _, _ in RUNS:
        path = os.path.join(runs_dir, task, folder, TRAINING_META_FILE)
        if not os.path.exists(path) or folder.endswith(("seed1", "zero_adaln")):
            continue
        with open(path) as f:
            meta = json.load(f)
        s = meta.get("shortcut")
        lines.append(
            f"| {name} | "
            + (
                "CE_full only"
                if s is None
                else f"CE_full + {s['lambda_short']:g}·CE_short + "
                f"{0.1 if s['lambda_consistency'] is None else s['lambda_consistency']:g}·"
                f"{s['consistency'].upper()}"
            )
            + " |"
        )
    return ["| variant | training loss |", "|---|---|", *lines]


def sampler_lines(num_loops, draws=20000):
    """Empirical distribution of the shortcut sampler's trajectory length S at this L (their rule: S ~ U{1..L-1})."""
    import random

    from looped_training.loopformer.objective import sample_shortcut_trajectory

    rng = random.Random(0)
    lengths = [len(sample_shortcut_trajectory(rng, num_loops)) for _ in range(draws)]
    freq = {s: lengths.count(s) / draws for s in range(1, num_loops)}
    return (
        f"Shortcut sampler at L={num_loops}, {draws} draws: P(S=s) for s=1..{num_loops - 1}: "
        + ", ".join(f"{v:.3f}" for v in freq.values())
        + f" (uniform: {1 / (num_loops - 1):.3f}); every step a "
        f"multiple of 1/{num_loops} summing to 1 (tests/training/loopformer/test_callbacks.py::test_shortcut_sampler_follows_the_spec)."
    )


# ---- the document ------------------------------------------------------------------------------------------------


def representation_lines(records):
    lines = [
        "| model | CKA(step i, i-1) for i=1..L | prompt entropy, steps 0..L | curvature, steps 0..L |",
        "|---|---|---|---|",
    ]
    for rec in records:
        r = rec["representations"]
        fmt = lambda xs: " ".join("–" if not math.isfinite(x) else f"{x:.2f}" for x in xs)  # noqa: E731
        lines.append(
            f"| {rec['name']} | {fmt(r['cka_to_previous'][1:])} | {fmt(r['prompt_entropy'])} | {fmt(r['curvature'])} |"
        )
    return lines


def halting_lines(records, task):
    """Adaptive depth per token (halt_eps) against fixed budgets at equal mean loops per token, for
    the first seed of each configuration: evaluate's `halting_table` (each rule's rows, the fixed budgets at equal
    compute and the rule's verdict)."""
    lines = [
        "### Adaptive depth per token (`halt_eps`) against fixed budgets",
        "",
        "Full budget M = L, uniform schedule; a token stops looping once its exit rule's score (`halt_criterion`, "
        "the rule column) falls below halt_eps. 'fixed budget at equal compute' interpolates the fixed-budget "
        "curve linearly at the same mean loops per token. The sweep of every rule on these runs and the "
        "Quickstart's: benchmarks/writeups/halting.md (`python -m benchmarks.bench_halt_criteria`).",
        "",
    ]
    for rec in records:
        if not rec.get("halting") or "seed" in rec["name"]:
            continue
        lines += [f"{rec['name']}:", "", *halting_table(rec), ""]
    return lines + [f"![adaptive depth](plots/{task}_quality_vs_compute.png)", "", *halting_sweep_lines(task)]


def halting_sweep_lines(task, results_dir=HALTING_SWEEPS):
    """The exit-rule sweeps on `task` (`benchmarks/results/halting_rules_*.json`, written by
    `python -m benchmarks.bench_halt_criteria --checkpoints ...`), one summary table per checkpoint: [] without them."""
    lines = []
    for path in sorted(Path(results_dir).glob("halting_rules_*.json")):
        for result in json.loads(path.read_text())["checkpoints"].values():
            if result["task"] != ("synthetic" if task == "synthetic" else "text"):
                continue
            if not lines:
                lines = [
                    "#### Every exit rule against the fixed budgets at equal compute",
                    "",
                    "From `python -m benchmarks.bench_halt_criteria --checkpoints ...` (the rows of every "
                    "threshold: benchmarks/writeups/halting.md); 'best fixed trajectory' also counts the shortcut "
                    "trajectories [1/L]·i + [1 − i/L] the '_shortcut' rules end on. Which knob to use for which "
                    "model, read from these sweeps: docs/loopformer.md ('Which knob to use').",
                    "",
                ]
            lines += [
                f"{result['name']} (L = {result['num_loops']}, {result['rows']} held-out rows; "
                f"{path.relative_to(Path(results_dir).parent.parent)}):",
                "",
                *halting_sweep_summary(result),
                "",
            ]
    return lines


def base_loop_verdict(records, task, at_full_budget):
    """Claims 5 and 6, the Quickstart's (b) and (c) without their exact-match margins: LoopFormer (mean over seeds)
    is better than Base-Loop at M = 1 (no collapse at a small budget), and at least as good at M = L (elastic for
    free)."""
    metric, higher = _metric(task)
    lf, bl = group_curve(records, "LoopFormer", metric), group_curve(records, "Base-Loop", metric)
    if not lf or not bl:
        return None, ["(LoopFormer or Base-Loop is missing: no comparison.)"]
    m = max(lf) if at_full_budget else min(lf)
    a, b = mean(lf[m]), mean(bl[m])
    holds = (not better(b, a, higher)) if at_full_budget else better(a, b, higher)
    return holds, [
        f"M={m}: LoopFormer {metric} {spread_text(lf[m])} ({len(lf[m])} seeds) vs Base-Loop "
        f"{spread_text(bl[m])} ({len(bl[m])}) -> {'holds' if holds else 'does not hold'}"
    ]


def claims_lines(records, task):
    verdicts = {}
    md = ["### The paper's claims at this scale", ""]
    mono = {
        g: monotonic_verdict(records, g, task)
        for g in dict.fromkeys(GROUP.values())
        if g != "Base (iso-FLOP)" and members(records, g)
    }
    verdicts["monotone in M (LoopFormer)"] = mono["LoopFormer"][0] if "LoopFormer" in mono else None
    md += [
        f"1. Quality does not get worse as M grows (uniform schedule, mean over seeds): "
        f"{verdict_word(verdicts['monotone in M (LoopFormer)'])} for LoopFormer",
        "",
    ]
    md += [f"   - {line}" for _, line in mono.values()]
    for key, title, (holds, lines) in (
        (
            "ahead of the early-exit baselines at M <= L/4",
            "2. At M <= L/4, LoopFormer is ahead of the early-exit baselines beyond the seed spread",
            small_budget_verdict(records, task),
        ),
        (
            "coarse-to-fine best at fixed M",
            "3. At a fixed M, coarse-to-fine is the best schedule (LoopFormer)",
            schedule_verdict(records, task),
        ),
        (
            "representations keep changing",
            "4. LoopFormer's representations keep changing across steps (full "
            "trajectory) where the looped baselines stagnate: every LoopFormer seed above every baseline run",
            representation_verdict(records),
        ),
        (
            "ahead of Base-Loop at M=1",
            "5. At M = 1, LoopFormer is better than Base-Loop (no collapse at a small budget; mean over seeds)",
            base_loop_verdict(records, task, at_full_budget=False),
        ),
        (
            "level with Base-Loop at M=L",
            "6. At M = L, LoopFormer is at least as good as Base-Loop (elastic for free; mean over seeds)",
            base_loop_verdict(records, task, at_full_budget=True),
        ),
    ):
        verdicts[key] = holds
        md += ["", f"{title}: {verdict_word(holds)}", ""] + [f"   - {line}" for line in lines]
    return md + [""], verdicts


def task_section(runs_dir, task, preset, out_dir, records):
    metric, _ = _metric(task)
    digits = 3 if metric == "em" else 2
    eval_dir = os.path.join(runs_dir, task, "eval")
    for name in ("quality_vs_budget.png", "representations.png", "quality_vs_compute.png"):
        if os.path.exists(os.path.join(eval_dir, name)):
            shutil.copy(os.path.join(eval_dir, name), os.path.join(out_dir, "plots", f"{task}_{name}"))
    md = [
        f"## {task}",
        "",
        f"Settings: `{config_path(task, preset).relative_to(ROOT)}` "
        f"(preset `{preset}`), with {' '.join(REPORT_FLAGS)}; runs: {', '.join(r['name'] for r in records)}.",
        "",
        "| run | parameters | train time (s) |",
        "|---|---|---|",
    ]
    md += [f"| {r['name']} | {r['parameters']:,} | {r['train_runtime_s'] or float('nan'):.0f} |" for r in records]
    title = "Exact match on held-out problems" if task == "synthetic" else "Held-out perplexity"
    md += [
        "",
        f"### {title} by loop budget M (uniform schedule; Base is its single full-depth pass, at M = L)",
        "",
        format_table(records, metric, digits=digits),
        "",
        "Mean (min–max) over seeds:",
        "",
        *seeds_table(records, metric, digits),
        "",
    ]
    if task == "synthetic":
        md += ["Answer perplexity:", "", format_table(records, "ppl", digits=2), ""]
    curves = {s: group_curve(records, "LoopFormer", metric, s) for s in SCHEDULES}
    L = max(r["num_loops"] for r in records)
    md += [
        "### LoopFormer by schedule (mean over seeds)",
        "",
        "| schedule | " + " | ".join(f"M={m}" for m in range(1, L + 1)) + " |",
        "|" + "---|" * (L + 1),
    ]
    md += [
        f"| {s} | " + " | ".join(f"{mean(c[m]):.3f}" if c.get(m) else "–" for m in range(1, L + 1)) + " |"
        for s, c in curves.items()
    ]
    md += ["", "### Initialisation ablation (LoopFormer)", "", *init_ablation_lines(records, task), ""]
    claims, verdicts = claims_lines(records, task)
    md += (
        claims
        + representation_lines(records)
        + [
            "",
            f"![quality](plots/{task}_quality_vs_budget.png)",
            f"![representations](plots/{task}_representations.png)",
            "",
        ]
    )
    return md + halting_lines(records, task), verdicts


def why_section(runs_dir, tasks, skip_checks):
    task = tasks[0]
    run = os.path.join(runs_dir, task, "loopformer")
    if not os.path.exists(os.path.join(run, TRAINING_META_FILE)):
        return []
    from loopformer_hf import LoopFormerConfig

    L = LoopFormerConfig.from_pretrained(run).num_loops
    return [
        "## Why it does or does not reproduce",
        "",
        "What was checked against the authors' code (armenjeddi/loopformer: models/, train.py, config/), each by "
        "this command:",
        "",
        f"- {equivalence_line(skip_checks)}",
        f"- {sampler_lines(L)}",
        f"- Initialisation: fresh models of the {task} LoopFormer run's configuration (seed 0):",
        "",
        *init_lines(run),
        "",
        "- Loss, per variant, as each run recorded it (`loopformer_training.json`):",
        "",
        *objective_lines(runs_dir, task),
        "",
        f"- Optimiser and scale ({task} run):",
        "",
        *optimiser_lines(run),
        "",
        "What remains different is scale and data: the runs above see the number of tokens in the last table on "
        "a toy task or a few MB of Shakespeare, not the Pile, and the models are four orders of magnitude "
        "smaller; the paper's effects (e.g. LoopFormer ahead at small M) are measured at 50k steps on "
        "~26B tokens. A verdict that does not hold here is a statement about this scale.",
        "",
    ]


def report_title(preset):
    return f"# LoopFormer and its baselines at small scale ({preset.upper()} preset)"


def kept_sections(results_md, tasks, preset):
    """{task: (verdict line, section lines)} of the report at `results_md` (when it is of the same preset) for each
    task this run does not regenerate (`--tasks` left it out, or its data is missing), so that regenerating one task
    keeps the others' computed sections."""
    if not os.path.exists(results_md):
        return {}
    with open(results_md) as f:
        lines = f.read().splitlines()
    if not lines or lines[0] != report_title(preset):
        return {}
    kept = {}
    for task in TASKS:
        if task in tasks or f"## {task}" not in lines:
            continue
        start = lines.index(f"## {task}")
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        verdict = next((line for line in lines[:start] if line.startswith(f"- {task}: ")), None)
        kept[task] = (verdict, lines[start:end])
    return kept


def write_report(runs_dir, tasks, out_dir, preset, skip_checks=False):
    os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
    kept = kept_sections(os.path.join(out_dir, REPORT_FILE), tasks, preset)
    md = [
        report_title(preset),
        "",
        "Generated by `python -m benchmarks.report"
        + ("" if preset == "cpu" else f" --preset {preset}")
        + "` from the runs under "
        f"`{os.path.relpath(runs_dir)}`; every number and verdict below is computed from `elastic_eval.json` and "
        "the runs' files by that command."
        + (
            f" The last run regenerated {', '.join(tasks)} (`--tasks`); the section on {', '.join(kept)} is kept as "
            "an earlier run of the command wrote it."
            if kept
            else ""
        ),
        "",
        "## Verdicts",
        "",
    ]
    summary, body = [], []
    for task in [t for t in TASKS if t in tasks or t in kept]:
        if task in kept:
            verdict, section = kept[task]
            summary += [verdict] if verdict else []
            body += section
            continue
        path = os.path.join(runs_dir, task, "eval", EVAL_FILE)
        if not os.path.exists(path):
            body += [f"## {task}", "", f"No evaluation at `{os.path.relpath(path)}`: not run.", ""]
            continue
        with open(path) as f:
            records = json.load(f)["models"]
        section, verdicts = task_section(runs_dir, task, preset, out_dir, records)
        body += section
        summary += [f"- {task}: " + "; ".join(f"{claim}: {verdict_word(v)}" for claim, v in verdicts.items())]
    md += (
        summary
        + [""]
        + body
        + why_section(
            runs_dir,
            [t for t in tasks if os.path.exists(os.path.join(runs_dir, t, "eval", EVAL_FILE))] or tasks,
            skip_checks,
        )
    )
    md += [
        "## Caveats",
        "",
        "Small models trained for minutes; two seeds for LoopFormer and TMLT-EE, one for the rest (chance exact "
        "match on the synthetic task is 0.1: ten possible answers). The claims are checked as stated, and the "
        "verdicts say which held in these runs, nothing more.",
    ]
    with open(os.path.join(out_dir, REPORT_FILE), "w") as f:
        f.write("\n".join(md) + "\n")
    return os.path.join(out_dir, REPORT_FILE)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=f"Regenerate {OUT_DIR}/{REPORT_FILE} from runs (training what is missing)."
    )
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="Run sizes: 'cpu' (about 1 h 40 min per task on 2 cores) or 'gpu' (about ten minutes on "
        "one accelerator); default gpu when CUDA is available, else cpu.",
    )
    parser.add_argument("--runs_dir", default=os.path.join("runs", "results"))
    parser.add_argument("--out_dir", default=OUT_DIR, help="Where the report and its plots/ are written.")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument(
        "--shakespeare",
        default=os.path.join("..", "shared", "data", "shakespeare"),
        help="Folder of the Shakespeare plays; the task is skipped when it does not exist.",
    )
    parser.add_argument("--no_train", dest="train", action="store_false", help="Only evaluate existing runs.")
    parser.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="Training runs at once (default 2 on cpu, 6 sharing the accelerator on gpu).",
    )
    parser.add_argument("--max_rows", type=int, default=500, help="Held-out rows scored per model.")
    parser.add_argument("--skip_checks", action="store_true", help="Do not run the forward-equivalence tests.")
    args = parser.parse_args(argv)
    if args.preset is None:
        import torch

        args.preset = "gpu" if torch.cuda.is_available() else "cpu"
    bad = [t for t in args.tasks if t not in TASKS]
    if bad:
        raise ValueError(f"--tasks {bad} unknown; allowed: {TASKS}.")
    if args.parallel is not None and args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {args.parallel}.")
    tasks = [t for t in args.tasks if t != "shakespeare" or os.path.isdir(args.shakespeare)]
    if len(tasks) < len(args.tasks):
        print(f"skipping shakespeare: {os.path.abspath(args.shakespeare)} does not exist", flush=True)
    if not args.train:  # refuse before anything is written: a report of stubs would replace the real one
        empty = {
            t: [os.path.join(args.runs_dir, t, r[0]) for r in RUNS]
            for t in tasks
            if not any(os.path.exists(os.path.join(args.runs_dir, t, r[0], TRAINING_META_FILE)) for r in RUNS)
        }
        if empty:
            raise ValueError(
                f"--no_train: no finished run for {sorted(empty)}; expected one of "
                + "; ".join(f"{t}: {', '.join(dirs)}" for t, dirs in empty.items())
                + f". Train them (drop --no_train) or pass the right --runs_dir; "
                f"{os.path.join(args.out_dir, REPORT_FILE)} was left as it was."
            )
    if args.train:
        train_missing(
            args.runs_dir, tasks, args.preset, args.shakespeare, args.parallel or (2 if args.preset == "cpu" else 6)
        )
    for task in tasks:
        if os.path.isdir(os.path.join(args.runs_dir, task)):
            evaluate(args.runs_dir, task, args.max_rows)
    print("wrote", write_report(args.runs_dir, tasks, args.out_dir, args.preset, args.skip_checks))


if __name__ == "__main__":
    main()
