"""Elastic-depth evaluation of one or more checkpoints: quality at every budget M = 1..L and schedule, and
representation metrics per loop step. Writes `elastic_eval.json` (every number) and PNG plots.

    python -m looped_training.loopformer.evaluate runs/loopformer runs/base_loop --output_dir runs/eval

Quality, on the held-out data the checkpoint's `loopformer_training.json` describes:
- synthetic task: exact match of the answer (all answer tokens and the closing newline are the greedy choices,
  i.e. greedy decoding after the marker reproduces the answer exactly), overall and by depth (hops), and the
  perplexity of the answer tokens;
- text: perplexity of the held-out blocks.
Schedules: uniform, coarse_to_fine, fine_to_coarse (models without Δ conditioning run only uniform; the others are
recorded as null). The iso-FLOP Base (num_loops = 1) has a single budget; it is the reference at M = L.
Representations (spec): at the full trajectory (M = L, uniform), per loop step (step 0 = embeddings): linear CKA
between steps, anisotropy, curvature, prompt entropy (normalised). For Base, step i is the output of its i-th
group of k blocks (k = num_blocks of the run), so it lines up with the looped models' steps.
Progress bars over the models and their budgets go to stderr when it is a terminal (`--disable_tqdm true` hides them,
`--disable_tqdm false` shows them anywhere).

This module is the command; what it measures is `looped_training.loopformer.metrics`', and its tables, verdicts and
plots are `looped_training.loopformer.report`'s.
"""

import argparse
import json
import os
import sys

import torch
import transformers
from tqdm.auto import tqdm

import loopformer_hf  # noqa: F401
from looped_training.arguments import check_device, check_output_path
from looped_training.loopformer.metrics import SCHEDULES, check_generate_budgets, evaluate_checkpoint
from looped_training.loopformer.report import EVAL_FILE, plot, summary_text

# the command as users type it (`--help`, one-line errors); argparse would say "evaluate.py"
PROG = "python -m looped_training.loopformer.evaluate"


def _bool(text):
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def progress_bars_disabled(disable_tqdm=None):
    """tqdm's `disable` for `--disable_tqdm`: as given if true or false; by default (None) the bars show on a terminal
    only (tqdm's own check of stderr), and not at all once `transformers.utils.logging.disable_progress_bar()` ran."""
    if disable_tqdm is None and not transformers.utils.logging.is_progress_bar_enabled():
        return True
    return disable_tqdm


def card_results(data, path, checkpoint, record, _):
    """This command's elastic_eval.json as the card's model-index (`looped_training.model_cards`): exact match and
    perplexity per loop budget (uniform schedule) of the model evaluated from `checkpoint`, or of the file's only
    model."""
    from pathlib import Path

    from looped_training.model_cards import describe_dataset, eval_result, is_number

    models = [m for m in data["models"] if isinstance(m, dict)]
    here = Path(checkpoint).resolve() if checkpoint is not None else None
    models = [m for m in models if m.get("path") and Path(m["path"]).resolve() == here] or models
    if len(models) != 1:
        raise ValueError(
            f"{path} evaluates {len(models)} models ({[m.get('name') for m in models]}), none of them "
            f"from {checkpoint}: give the {EVAL_FILE} of this checkpoint's evaluation."
        )
    (model,) = models
    name, kind = describe_dataset("loopformer", record) or (model.get("task", "held-out data"), model.get("task"))
    task = {
        "type": "text-generation",
        "name": "Answer exact match" if model.get("task") == "synthetic" else "Language modeling",
    }
    dataset = {"name": name, "type": kind, "split": "held-out"}
    return [
        eval_result(task, dataset, label, r[key], f"loop_budget={r['budget']}")
        for r in model.get("results") or []
        if r.get("schedule") == "uniform"
        for key, label in (("em", "exact_match"), ("ppl", "perplexity"))
        if is_number(r.get(key))
    ]


def main(argv=None, halting=None):
    """The command; `halting(model, task, data, halt_eps)` runs each model's --halt_eps sweep (default: the
    state-change rule's, `metrics.evaluate_halting`; the lab's rules: `python -m benchmarks.halting_rules`)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="Training output folders (or checkpoint-N folders).")
    parser.add_argument("--output_dir", required=True, help="Where elastic_eval.json and the plots go.")
    parser.add_argument("--names", nargs="*", help="Display names, one per checkpoint (default: folder names).")
    parser.add_argument("--max_rows", type=int, default=400, help="Held-out problems / text blocks to score.")
    parser.add_argument("--repr_rows", type=int, default=32, help="Held-out rows for the representation metrics.")
    parser.add_argument(
        "--schedules",
        nargs="*",
        default=list(SCHEDULES),
        help=f"Subset of {SCHEDULES}; uniform is always added (the tables are read against it).",
    )
    parser.add_argument(
        "--generate_budgets",
        nargs="*",
        type=int,
        default=[],
        help="Show generate(loop_budget=M) text for these M, each in 1..L of every looped checkpoint "
        "(Base, not looped, generates once).",
    )
    parser.add_argument(
        "--halt_eps",
        nargs="*",
        type=float,
        default=[],
        help="Also evaluate per-token adaptive depth at these halt_eps (quality vs mean loops).",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="Where the models run, e.g. cpu, cuda, cuda:1 (default: cuda when available, else cpu).",
    )
    parser.add_argument(
        "--disable_tqdm",
        type=_bool,
        default=None,
        help="true: no progress bars; false: always show them (on stderr); default: only on a terminal.",
    )
    args = parser.parse_args(argv)
    for eps in args.halt_eps:
        loopformer_hf.LoopFormerConfig.check_halt_eps(eps)
    if args.names and len(args.names) != len(args.checkpoints):
        raise ValueError(f"--names gives {len(args.names)} names for {len(args.checkpoints)} checkpoints.")
    bad = [s for s in args.schedules if s not in SCHEDULES]
    if bad:
        raise ValueError(f"--schedules {bad} unknown; allowed: {SCHEDULES}.")
    if "uniform" not in args.schedules:
        # the tables, the plots' Base point and the models without Δ conditioning all read the uniform schedule
        print(
            f"--schedules {args.schedules}: adding 'uniform', the reference every table and plot is read against.",
            file=sys.stderr,
        )
        args.schedules = ["uniform", *args.schedules]
    low = [b for b in args.generate_budgets if b < 1]
    if low:  # checked here, not after the whole evaluation when generate would refuse it
        raise ValueError(f"--generate_budgets {low}: each loop budget must be an integer >= 1.")
    if args.generate_budgets:
        check_generate_budgets(args.checkpoints, args.generate_budgets)
    for name in ("max_rows", "repr_rows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}.")
    check_output_path("--output_dir", args.output_dir, folder=True)  # written after every model is evaluated
    device = check_device("--device", args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    records = []
    disable = progress_bars_disabled(args.disable_tqdm)
    # transformers' "Loading weights" bars follow the same rule (they show in a log file whatever tqdm decides)
    hf_bars = transformers.utils.logging.is_progress_bar_enabled()
    if disable or (disable is None and not sys.stderr.isatty()):
        transformers.utils.logging.disable_progress_bar()
    try:
        for i, path in enumerate(tqdm(args.checkpoints, desc="models", unit="model", disable=disable)):
            name = args.names[i] if args.names else None
            tqdm.write(f"evaluating {path} ...", file=sys.stderr)
            records.append(
                evaluate_checkpoint(
                    path,
                    name,
                    args.max_rows,
                    args.repr_rows,
                    args.schedules,
                    args.generate_budgets,
                    args.halt_eps,
                    disable,
                    device,
                    halting,
                )
            )
    finally:
        if hf_bars:
            transformers.utils.logging.enable_progress_bar()
    tasks = {r["task"] for r in records}
    if len(tasks) > 1:
        raise ValueError(f"The checkpoints were trained on different tasks {sorted(tasks)}; evaluate them apart.")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, EVAL_FILE), "w") as f:
        json.dump({"models": records}, f, indent=1)
    plots = plot(records, args.output_dir)
    print(summary_text(records))
    for rec in records:
        for g in rec.get("generations", []):
            verdict = (
                ""
                if g["answer"] is None
                else ("   right" if g["generated"].strip() == g["answer"] else f"   wrong (answer {g['answer']})")
            )
            print(
                f"[{rec['name']}] generate(loop_budget={g['budget']}): {g['prompt']!r} -> {g['generated']!r}{verdict}"
            )
    print("wrote", os.path.join(args.output_dir, EVAL_FILE), *plots)
    return records


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, PROG)
