"""Benchmarks and probes, run from the repository root as `python -m benchmarks.<name>` (not part of the wheel)."""

import json
import os
import statistics


def write_json(path, obj):
    """Write a benchmark's results to `path` (its folder created), indented."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def row(name, loopformer, baseline, ratios, target=None, met=None):
    """One row of the speed table (`report_table`): medians of the two sides, median and spread (min-max) of the
    per-round ratios."""
    return dict(
        measurement=name,
        loopformer=loopformer,
        baseline=baseline,
        ratio=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        target=target,
        met=met,
    )


def format_markdown(rows):
    """The speed table (`report_table`, `bench_authors`) as Markdown."""
    lines = [
        "| measurement | LoopFormer | baseline | ratio (median) | spread (min-max) | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("slot"):
            text = r["slot"] if isinstance(r["slot"], str) else "not measured by this command yet"
            lines.append(f"| {r['measurement']} | {text} | | | | | |")
            continue
        spread = f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(
            f"| {r['measurement']} | {r['loopformer']:.4g} | {r['baseline']:.4g} | {r['ratio']:.3f} | "
            f"{spread} | {r['target'] or '-'} | {met} |"
        )
    return "\n".join(lines)
