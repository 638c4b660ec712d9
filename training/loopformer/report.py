"""The elastic evaluation's records (`looped_training.loopformer.metrics.evaluate_checkpoint`) read for people:
quality by budget as markdown tables, the halting sweep's verdicts, the Quickstart's three claims, the summary the
command prints, and the PNG plots."""

import os
import sys

EVAL_FILE = (
    "elastic_eval.json"  # every number of an evaluation, as `python -m looped_training.loopformer.evaluate` writes it
)


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
