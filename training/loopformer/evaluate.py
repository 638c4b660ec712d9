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
"""

import argparse
import json
import math
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
import transformers
from tqdm.auto import tqdm

import loopformer_hf  # noqa: F401
from loopformer_hf.halting_loopformer import HALTING_RULES, halting_rule
from looped_training.arguments import check_device, check_output_path
from looped_training.checkpoints import check_checkpoint, check_model_type, load_model
from looped_training.loopformer import representations
from looped_training.loopformer.data import (
    TRAINING_META_FILE,
    DataArguments,
    held_out_problems,
    held_out_text,
    synthetic,
)
from looped_training.loopformer.data.sources import held_out_windows
from looped_training.loopformer.data.text import chunk_text

SCHEDULES = ("uniform", "coarse_to_fine", "fine_to_coarse")
EVAL_FILE = "elastic_eval.json"
# the command as users type it (`--help`, one-line errors); argparse would say "train.py"
PROG = "python -m looped_training.loopformer.evaluate"


def load_checkpoint(path):
    """(model, tokenizer, meta) of a training output folder (or a checkpoint-N folder inside one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_checkpoint(path)
    check_model_type(path, "loopformer")
    meta_path = next(
        (
            p
            for p in (
                os.path.join(path, TRAINING_META_FILE),
                os.path.join(os.path.dirname(os.path.abspath(path)), TRAINING_META_FILE),
            )
            if os.path.exists(p)
        ),
        None,
    )
    if meta_path is None:
        raise ValueError(
            f"{path!r} has no {TRAINING_META_FILE} (written by training/loopformer/train.py), so the "
            f"held-out data it was trained for is unknown."
        )
    with open(meta_path) as f:
        meta = json.load(f)
    model = load_model(AutoModelForCausalLM, path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, meta


def build_eval_data(meta, tokenizer, max_rows):
    data_args = DataArguments(**meta["data"])
    block_size = meta["block_size"]
    if data_args.task == "synthetic":
        problems = held_out_problems(data_args)[:max_rows]
        rows = synthetic.tokenize_problems(problems, tokenizer, block_size, answer_only_loss=True)
        rows["prompts"] = [p.prompt for p in problems]
        rows["answers"] = [p.answer for p in problems]
    elif data_args.data_dir is not None or data_args.streaming:
        # the run's own held-out windows: T next-token targets a row, as the authors' estimate_loss scores them
        data = held_out_windows(data_args, tokenizer, block_size, max_rows)
        return data_args.task, data, {"input_ids": data["input_ids"].tolist()}
    else:
        rows = chunk_text(held_out_text(data_args), tokenizer, block_size)
        rows = {k: v[:max_rows] for k, v in rows.items()}
    tensors = {k: torch.tensor(rows[k]) for k in ("input_ids", "attention_mask", "labels")}
    if "depth" in rows:
        tensors["depth"] = torch.tensor(rows["depth"])
    return data_args.task, tensors, rows


@torch.no_grad()
def quality(model, data, trajectory, batch_size=128, halt_eps=None):
    """Perplexity over labelled tokens; exact match per row (all labelled tokens are the argmax); with `halt_eps`,
    also the loop steps spent on each row's scored positions (the positions whose logits are scored)."""
    ce_sum, count, correct, loops = 0.0, 0, [], []
    n = data["input_ids"].shape[0]
    for start in range(0, n, batch_size):
        ids = data["input_ids"][start : start + batch_size].to(model.device)
        mask = data["attention_mask"][start : start + batch_size].to(model.device)
        if "shift_labels" in data:  # windows with their next token: every position is scored
            labels = data["shift_labels"][start : start + batch_size].to(model.device)
        else:
            labels = data["labels"][start : start + batch_size][:, 1:].to(model.device)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            step_schedule=list(trajectory),
            use_cache=False,
            **({} if halt_eps is None else {"halt_eps": halt_eps}),
        )
        logits = out.logits[:, : labels.shape[1]].float()
        valid = labels != -100
        ce_sum += float(F.cross_entropy(logits[valid], labels[valid], reduction="sum"))
        count += int(valid.sum())
        hit = (logits.argmax(-1) == labels) | ~valid
        correct += hit.all(-1).tolist()
        if halt_eps is not None:
            counts = out.loop_counts[:, : labels.shape[1]].float()
            loops += ((counts * valid).sum(-1) / valid.sum(-1).clamp(min=1)).tolist()
    return math.exp(ce_sum / max(count, 1)), correct, loops


def _runs_on(model, criterion):
    """Whether the exit rule `criterion` runs on `model` (its own check, as a forward makes it)."""
    try:
        halting_rule(criterion).check_model(model.config, model.get_output_embeddings(), criterion)
    except ValueError:
        return False
    return True


def evaluate_halting(model, task, data, eps_values, criteria=None):
    """Adaptive depth per token: quality against mean loop steps per scored token, at the full uniform budget, for
    each exit rule of `criteria` (default: the model's `halt_criterion`; a rule only on a model it runs on, e.g. the
    lab's "_shortcut" rules on a model conditioned on Δ)."""
    results = []
    trajectory = model.config.resolve_trajectory(model.config.num_loops, "uniform")
    kept = model.config.halt_criterion
    criteria = [c for c in (criteria or [kept]) if _runs_on(model, c)]
    try:
        for criterion in criteria:
            model.config.halt_criterion = criterion  # `quality` passes halt_eps; the rule comes from the config
            results += [
                dict(criterion=criterion, **r) for r in _halting_sweep(model, task, data, trajectory, eps_values)
            ]
    finally:
        model.config.halt_criterion = kept
    return results


def _halting_sweep(model, task, data, trajectory, eps_values):
    results = []
    for eps in eps_values:
        ppl, correct, loops = quality(model, data, trajectory, halt_eps=eps)
        record = {
            "halt_eps": eps,
            "mean_loops": sum(loops) / len(loops),
            "ppl": ppl,
            "em": None,
            "em_by_depth": None,
            "mean_loops_by_depth": None,
        }
        if task == "synthetic":
            record["em"] = sum(correct) / len(correct)
            per_depth = defaultdict(list)
            for d, c, l in zip(data["depth"].tolist(), correct, loops):
                per_depth[d].append((c, l))
            record["em_by_depth"] = {str(d): sum(c for c, _ in v) / len(v) for d, v in sorted(per_depth.items())}
            record["mean_loops_by_depth"] = {
                str(d): sum(l for _, l in v) / len(v) for d, v in sorted(per_depth.items())
            }
        results.append(record)
    return results


def evaluate_quality(model, task, data, budgets, schedules, disable_tqdm=None):
    config = model.config
    results, by_trajectory = [], {}
    for budget in tqdm(budgets, desc="budgets", unit="budget", leave=False, disable=disable_tqdm):
        for schedule in schedules:
            record = {
                "budget": budget,
                "schedule": schedule,
                "trajectory": None,
                "ppl": None,
                "em": None,
                "em_by_depth": None,
            }
            try:
                trajectory = config.resolve_trajectory(budget, schedule)
            except ValueError:  # this model only knows uniform steps
                results.append(record)
                continue
            if trajectory not in by_trajectory:
                by_trajectory[trajectory] = quality(model, data, trajectory)
            ppl, correct, _ = by_trajectory[trajectory]
            record.update(trajectory=list(trajectory), ppl=ppl)
            if task == "synthetic":
                record["em"] = sum(correct) / len(correct)
                per_depth = defaultdict(list)
                for d, c in zip(data["depth"].tolist(), correct):
                    per_depth[d].append(c)
                record["em_by_depth"] = {str(d): sum(v) / len(v) for d, v in sorted(per_depth.items())}
            results.append(record)
    return results


@torch.no_grad()
def step_states(model, data, meta, max_rows):
    """Hidden states per loop step (embeddings first) at the full trajectory, on `max_rows` held-out rows."""
    ids = data["input_ids"][:max_rows].to(model.device)
    mask = data["attention_mask"][:max_rows].to(model.device)
    config = model.config
    if config.num_loops > 1:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            output_hidden_states=True,
            use_cache=False,
            loop_budget=config.num_loops,
            step_schedule="uniform",
        )
        return list(out.hidden_states), mask
    k = meta["model"]["num_blocks"]
    captured = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o: captured.append(o[0] if isinstance(o, tuple) else o))
        for layer in model.model.layers
    ]
    try:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [out.hidden_states[0]] + [captured[i] for i in range(k - 1, len(captured), k)], mask


@torch.no_grad()
def generations(model, tokenizer, task, rows, budgets, num_prompts=3):
    """Greedy `generate(loop_budget=M)` continuations of a few held-out prompts for each budget M."""
    samples = []
    if task == "synthetic":
        prompts = rows["prompts"][:num_prompts]
        answers = rows["answers"][:num_prompts]
        max_new = 3
    else:
        prompts = [tokenizer.decode(r[:24]) for r in rows["input_ids"][:num_prompts]]
        answers = [None] * len(prompts)
        max_new = 32
    for budget in budgets:
        for prompt, answer in zip(prompts, answers):
            enc = tokenizer(prompt, return_tensors="pt").to(model.device)
            kwargs = {"loop_budget": budget} if model.config.num_loops > 1 else {}
            out = model.generate(
                **enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tokenizer.pad_token_id, **kwargs
            )
            text = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            if task == "synthetic":
                text = text.split(synthetic.END_OF_ANSWER)[0]
            samples.append({"budget": budget, "prompt": prompt, "generated": text, "answer": answer})
    return samples


def check_generate_budgets(paths, budgets):
    """Refuse, before any evaluation, a `--generate_budgets` value outside 1..L of a looped checkpoint (it was
    silently dropped). Base (num_loops = 1, not looped) has one depth and generates once whatever is asked."""
    from transformers import AutoConfig

    for path in paths:
        check_checkpoint(path)
        num_loops = AutoConfig.from_pretrained(path).num_loops
        high = sorted({b for b in budgets if b > num_loops})
        if num_loops > 1 and high:
            raise ValueError(
                f"--generate_budgets {high}: {path!r} has num_loops L={num_loops}, so the allowed budgets are "
                f"1..{num_loops}."
            )


def evaluate_checkpoint(
    path,
    name=None,
    max_rows=400,
    repr_rows=32,
    schedules=SCHEDULES,
    generate_budgets=(),
    halt_eps=(),
    disable_tqdm=None,
    device="cpu",
    halt_criteria=None,
):
    model, tokenizer, meta = load_checkpoint(path)
    model.to(device)
    task, data, rows = build_eval_data(meta, tokenizer, max_rows)
    L = meta["model"]["num_loops"]
    budgets = list(range(1, model.config.num_loops + 1))
    record = {
        "name": name or os.path.basename(os.path.normpath(path)),
        "path": path,
        "variant": meta["variant"],
        "task": task,
        "num_loops": L,
        "num_blocks": meta["model"]["num_blocks"],
        "parameters": model.num_parameters(),
        "train_runtime_s": meta.get("train_runtime_s"),
        "results": evaluate_quality(model, task, data, budgets, schedules, disable_tqdm),
    }
    if task == "synthetic":
        # guessing among the answers the held-out problems have (a digit mod 10 for the arithmetic chains)
        record["chance"] = {"em": 1 / len(set(rows["answers"])), "ppl": float(len(set(rows["answers"])))}
    if halt_eps and model.config.num_loops > 1:
        record["halting"] = evaluate_halting(model, task, data, halt_eps, halt_criteria)
    states, mask = step_states(model, data, meta, repr_rows)
    record["representations"] = representations.per_step_metrics(states, mask)
    if generate_budgets:  # checked against num_loops in `check_generate_budgets`; Base has a single depth
        gen_budgets = sorted(set(generate_budgets)) if model.config.num_loops > 1 else [1]
        record["generations"] = generations(model, tokenizer, task, rows, gen_budgets)
    return record


# ---- tables and plots -------------------------------------------------------------------------------------------


def _value(record, budget, schedule, metric):
    for r in record["results"]:
        if r["budget"] == budget and r["schedule"] == schedule:
            return r[metric]
    return None


def quality_by_budget(record, schedule="uniform", metric="em"):
    """{budget M: value} on the model's own budgets; the iso-FLOP Base (one step) is placed at M = L."""
    if record["variant"] == "base":
        return {record["num_loops"]: _value(record, 1, "uniform", metric)}
    return {r["budget"]: r[metric] for r in record["results"] if r["schedule"] == schedule}


def fixed_at_equal_compute(record, loops, metric):
    """The fixed budgets' `metric` (uniform schedule, M = 1..L) interpolated linearly at `loops` mean loop steps per
    token (clamped to the ends)."""
    fixed = quality_by_budget(record, "uniform", metric)
    ms = sorted(fixed)
    lo = max([m for m in ms if m <= loops], default=ms[0])
    hi = min([m for m in ms if m >= loops], default=ms[-1])
    return fixed[lo] if hi == lo else fixed[lo] + (loops - lo) / (hi - lo) * (fixed[hi] - fixed[lo])


def halting_metric(task):
    """(metric, higher is better) the halting verdicts read: exact match on the synthetic task, perplexity on text."""
    return ("em", True) if task == "synthetic" else ("ppl", False)


def halting_rows(record):
    """Per halt_eps row of `record["halting"]`: (row, fixed budget at equal compute, 'yes' / 'no' / 'equal': the
    adaptive quality beats it)."""
    metric, higher = halting_metric(record["task"])
    out = []
    for h in record["halting"]:
        ref = fixed_at_equal_compute(record, h["mean_loops"], metric)
        same = abs(h[metric] - ref) <= 1e-6 * abs(ref)  # float noise is a tie
        out.append((h, ref, "equal" if same else "yes" if (h[metric] > ref) == higher else "no"))
    return out


def halting_verdict(record):
    """The targets for one model's halting sweep, per exit rule: {rule: (met, halt_eps values where it holds)}.
    Exact match: some halt_eps at ≤ L − 0.5 mean loops per token, within 0.01 of M = L and not below the fixed budgets
    at equal compute. Perplexity: below the fixed budgets at equal compute at ≥ 2 halt_eps."""
    metric, _ = halting_metric(record["task"])
    L = record["num_loops"]
    full = quality_by_budget(record, "uniform", metric)[L]
    verdicts = {}
    for h, ref, better in halting_rows(record):
        holds = (
            (better == "yes" and h["mean_loops"] <= L)
            if metric == "ppl"
            else (h["mean_loops"] <= L - 0.5 and h["em"] >= full - 0.01 and better != "no")
        )
        settings = verdicts.setdefault(h.get("criterion", "state_change"), [])
        if holds:
            settings.append(h["halt_eps"])
    return {rule: (len(eps) >= (2 if metric == "ppl" else 1), eps) for rule, eps in verdicts.items()}


def halting_table(record):
    """The halting sweep of one model as markdown lines, per exit rule: each halt_eps with the fixed budgets at equal
    compute and whether the adaptive depth beats them, then the rule's verdict (halting_verdict's targets)."""
    metric, _ = halting_metric(record["task"])
    L = record["num_loops"]
    target = (
        f"≤ {L - 0.5:g} mean loops, exact match within 0.01 of M={L} and not below the fixed budgets at equal "
        f"compute, at some halt_eps"
        if metric == "em"
        else "perplexity below the fixed budgets at equal compute at ≥ 2 halt_eps"
    )
    rows, lines = halting_rows(record), []
    for rule, (met, eps) in halting_verdict(record).items():
        lines += [
            f"halt_criterion={rule!r}:",
            "",
            "| halt_eps | mean loops/token | perplexity | exact match | fixed budget at equal compute "
            f"({'exact match' if metric == 'em' else 'perplexity'}) | adaptive better? |",
            "|---|---|---|---|---|---|",
        ]
        for h, ref, better in rows:
            if h.get("criterion", "state_change") == rule:
                em = "–" if h["em"] is None else f"{h['em']:.3f}"
                lines.append(
                    f"| {h['halt_eps']:g} | {h['mean_loops']:.2f} | {h['ppl']:.2f} | {em} | {ref:.3f} | {better} |"
                )
        lines += [
            "",
            f"Verdict: {'pays' if met else 'does not pay'} ({target}: "
            f"{'holds at halt_eps ' + ', '.join(f'{e:g}' for e in eps) if eps else 'holds nowhere'})"
            + ("." if met else "; at this compute a fixed loop_budget is the better knob."),
            "",
        ]
    return lines[:-1]


def format_table(records, metric, schedule="uniform", digits=3):
    """A markdown table: one row per model, one column per budget M = 1..L."""
    L = max(r["num_loops"] for r in records)
    header = "| model | " + " | ".join(f"M={m}" for m in range(1, L + 1)) + " |"
    lines = [header, "|" + "---|" * (L + 1)]
    for rec in records:
        values = quality_by_budget(rec, schedule, metric)
        cells = []
        for m in range(1, L + 1):
            v = values.get(m)
            cells.append("–" if v is None else f"{v:.{digits}f}")
        lines.append(f"| {rec['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _finish(fig, ax_rows, title, path, caption=None):
    """The first axes' legend beside the last axes (the report's nine models and their schedules give ~25 entries,
    which covered the curves inside the axes), title, a one-line caption under the plots, save, close."""
    handles, labels = ax_rows[0].get_legend_handles_labels()
    ax_rows[-1].legend(
        handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), ncol=1 + len(labels) // 16
    )
    fig.suptitle(title)
    fig.tight_layout()
    if caption:
        fig.subplots_adjust(bottom=0.2)
        fig.text(0.5, 0.02, caption, ha="center", fontsize=8, wrap=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight" widens the canvas to hold the legend
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _style_axes(ax, xlabel, ylabel, metric):
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # budgets and loop steps are integers
    if metric == "ppl":
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def _plot_quality(records, metrics, task, path):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4), squeeze=False)
    styles = {"uniform": "-", "coarse_to_fine": "--", "fine_to_coarse": ":"}
    for ax, (metric, label) in zip(axes[0], metrics):
        for i, rec in enumerate(records):
            color = f"C{i}"
            if rec["variant"] == "base":
                v = quality_by_budget(rec, metric=metric)[rec["num_loops"]]
                ax.axhline(v, color=color, linestyle="-.", label=f"{rec['name']} (iso-FLOP, M=L)")
                continue
            for schedule, style in styles.items():
                values = {m: v for m, v in quality_by_budget(rec, schedule, metric).items() if v is not None}
                if not values or (
                    schedule != "uniform"
                    and rec["variant"] != "loopformer"
                    and not rec["results"][0].get("trajectory")
                ):
                    continue
                label_s = rec["name"] if schedule == "uniform" else f"{rec['name']} {schedule}"
                ax.plot(
                    list(values),
                    list(values.values()),
                    style,
                    marker="o",
                    color=color,
                    label=label_s,
                    alpha=1.0 if schedule == "uniform" else 0.6,
                )
        chance = records[0].get("chance", {}).get(metric)
        if chance is not None:
            ax.axhline(chance, color="grey", linestyle=":", label="chance (guessing an answer)")
        _style_axes(ax, "loop budget M", label, metric)
    caption = (
        "Each point: the model run with M loop steps (uniform Δ = 1/M) on held-out problems; a model that "
        "uses its depth rises with M, one trained only at M = L falls off below it."
    )
    return _finish(fig, axes[0], f"Quality against loop budget ({task})", path, caption)


def _plot_representations(records, task, path):
    import matplotlib.pyplot as plt

    names = [
        ("cka_to_previous", "CKA(step i, step i-1)"),
        ("anisotropy", "anisotropy"),
        ("curvature", "curvature (rad)"),
        ("prompt_entropy", "prompt entropy (normalised)"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for ax, (key, label) in zip(axes, names):
        for i, rec in enumerate(records):
            values = rec["representations"][key]
            ax.plot(range(len(values)), values, marker="o", color=f"C{i}", label=rec["name"])
        _style_axes(ax, "loop step (0 = embeddings)", None, None)
        ax.set_title(label)
    caption = (
        "Hidden states after each loop step of the full trajectory: CKA near 1 means a step changed little; "
        "curvature is the turn between successive steps' updates."
    )
    return _finish(fig, axes, f"Representations per loop step at M = L ({task})", path, caption)


def _plot_halting(records, metrics, task, path):
    """Adaptive depth (halt_eps) against fixed budgets, at equal mean loops per token."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4), squeeze=False)
    for ax, (metric, label) in zip(axes[0], metrics):
        for i, rec in enumerate(records):
            if not rec.get("halting"):
                continue
            fixed = quality_by_budget(rec, "uniform", metric)
            ax.plot(list(fixed), list(fixed.values()), "-", marker="o", color=f"C{i}", label=f"{rec['name']} fixed M")
            rules = list(dict.fromkeys(h.get("criterion", "state_change") for h in rec["halting"]))
            for rule, marker in zip(rules, "x+^vsd"):
                pts = sorted(
                    (h["mean_loops"], h[metric]) for h in rec["halting"] if h.get("criterion", "state_change") == rule
                )
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    "--",
                    marker=marker,
                    color=f"C{i}",
                    label=f"{rec['name']} halt_eps ({rule})",
                )
        _style_axes(ax, "mean loop steps per token", label, metric)
    caption = (
        "Crosses: each token stops once its exit rule's score falls below halt_eps, plotted at the mean loop "
        "steps spent; dots: every token runs M steps. Crosses above the dots: halting spends compute better."
    )
    return _finish(fig, axes[0], f"Adaptive depth (halt_eps) against fixed budgets ({task})", path, caption)


def plot(records, output_dir):
    """quality_vs_budget.png (one line per model and schedule), representations.png (each metric per step) and,
    with a halt_eps sweep, quality_vs_compute.png. Without matplotlib (not a dependency of the package: the `train`
    extra) there are no plots, and a note says so."""
    try:
        import matplotlib
    except ImportError:
        print(
            f"matplotlib is not installed: no plots (pip install matplotlib, or the package's `train` extra); "
            f"{EVAL_FILE} holds every number.",
            file=sys.stderr,
        )
        return []

    matplotlib.use("Agg")
    os.makedirs(output_dir, exist_ok=True)
    task = records[0]["task"]
    metrics = [("em", "exact match"), ("ppl", "answer perplexity")] if task == "synthetic" else [("ppl", "perplexity")]
    paths = [
        _plot_quality(records, metrics, task, os.path.join(output_dir, "quality_vs_budget.png")),
        _plot_representations(records, task, os.path.join(output_dir, "representations.png")),
    ]
    if any(rec.get("halting") for rec in records):
        paths.append(_plot_halting(records, metrics, task, os.path.join(output_dir, "quality_vs_compute.png")))
    return paths


def budget_claims(loopformer, base_loop):
    """The three claims the Quickstart checks, on exact-match curves over M = 1..L (lists) of LoopFormer and of
    Base-Loop: (a) LoopFormer improves with budget (em(M=L) - em(M=1) >= 0.10, no step back larger than 0.02);
    (b) no collapse at small budget (LoopFormer at M=1 >= Base-Loop at M=1 + 0.10); (c) elastic for free
    (LoopFormer at M=L within 0.05 of Base-Loop at M=L). (c) also records which side a miss is on: `ahead`
    (LoopFormer more than 0.05 better, which fails the claim as stated) and `not_behind` (the one-sided reading:
    LoopFormer no more than 0.05 worse)."""
    lf, bl = list(loopformer), list(base_loop)
    step_back = max([lf[i] - lf[i + 1] for i in range(len(lf) - 1)] + [0.0])
    gain, margin, gap = lf[-1] - lf[0], lf[0] - bl[0], lf[-1] - bl[-1]
    tol = 1e-9  # exact-match rates are k/n: 391/500 - 341/500 is 0.0999... in floats, and 0.10 must meet ">= 0.10"
    return {
        "a_improves_with_budget": {
            "gain": gain,
            "worst_step_back": step_back,
            "holds": gain >= 0.10 - tol and step_back <= 0.02 + tol,
        },
        "b_no_collapse_at_M1": {"margin": margin, "holds": margin >= 0.10 - tol},
        "c_elastic_for_free": {
            "gap": gap,
            "holds": abs(gap) <= 0.05 + tol,
            "ahead": gap > 0.05 + tol,
            "not_behind": gap >= -0.05 - tol,
        },
    }


def claims_text(claims):
    word = {True: "HOLDS", False: "does not hold"}
    a, b, c = claims["a_improves_with_budget"], claims["b_no_collapse_at_M1"], claims["c_elastic_for_free"]
    return [
        f"(a) LoopFormer improves with budget: em(M=L) - em(M=1) = {a['gain']:+.3f} (>= 0.10), worst step back "
        f"{a['worst_step_back']:.3f} (<= 0.02): {word[a['holds']]}",
        f"(b) no collapse at M=1: LoopFormer - Base-Loop = {b['margin']:+.3f} (>= 0.10): {word[b['holds']]}",
        f"(c) elastic for free: LoopFormer - Base-Loop at M=L = {c['gap']:+.3f} (within 0.05): "
        f"{word[c['holds']]}" + (" (LoopFormer is ahead of Base-Loop, not behind)" if c["ahead"] else ""),
        # the claim is two-sided as stated; a LoopFormer far ahead fails it, which a reader should not take
        # for a LoopFormer behind
    ]


def records_claims(records):
    """`budget_claims` of the first LoopFormer and Base-Loop among `records` (synthetic task), or None."""
    by_variant = {}
    for rec in records:
        by_variant.setdefault(rec["variant"], rec)
    if records[0]["task"] != "synthetic" or not {"loopformer", "base_loop"} <= set(by_variant):
        return None
    curves = [list(quality_by_budget(by_variant[v], "uniform", "em").values()) for v in ("loopformer", "base_loop")]
    return budget_claims(*curves)


def summary_text(records):
    task = records[0]["task"]
    out = []
    if task == "synthetic":
        out += ["Exact match (held-out problems, uniform schedule):", format_table(records, "em"), ""]
        depths = sorted(
            {d for rec in records for r in rec["results"] if r["em_by_depth"] for d in r["em_by_depth"]}, key=int
        )
        for rec in records:
            full = [
                r
                for r in rec["results"]
                if r["schedule"] == "uniform" and r["budget"] == max(x["budget"] for x in rec["results"])
            ][0]
            out.append(
                f"  {rec['name']} at full budget, EM by depth: "
                + ", ".join(f"d{d}={full['em_by_depth'].get(d, float('nan')):.2f}" for d in depths)
            )
        out.append("")
        out += ["Answer perplexity (uniform schedule):", format_table(records, "ppl", digits=2)]
        claims = records_claims(records)
        if claims is not None:
            out += ["", "Claims (exact match, uniform schedule):", *claims_text(claims)]
    else:
        out += ["Held-out perplexity (uniform schedule):", format_table(records, "ppl", digits=2)]
    for rec in records:
        if rec.get("halting"):
            out += [
                "",
                f"Adaptive depth, {rec['name']} (full budget M={rec['num_loops']}, uniform; the fixed budgets "
                "M = 1..L above, interpolated at the same mean loops per token):",
                *halting_table(rec),
            ]
    return "\n".join(out)


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


def main(argv=None):
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
        "--halt_criteria",
        nargs="*",
        default=None,
        help="Exit rules (halt_criterion values) the --halt_eps sweep runs (default: each model's own; "
        "a rule only on the models it runs on). With the lab's rules: python -m "
        "benchmarks.halting_rules ARGS.",
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
    bad = [c for c in args.halt_criteria or [] if c not in HALTING_RULES]
    if bad:
        raise ValueError(
            f"--halt_criteria {bad} unknown; allowed: {tuple(HALTING_RULES)} (with the lab's rules: "
            f"python -m benchmarks.halting_rules ARGS)."
        )
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
                    args.halt_criteria,
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
