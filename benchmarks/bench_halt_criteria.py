"""Exit rules for adaptive depth (`halt_criterion`) against fixed budgets at equal mean loops, on trained
checkpoints or on a tiny LoopFormer trained here on the synthetic arithmetic task (a few hundred steps,
shortcut-consistency objective).

    python -m benchmarks.bench_halt_criteria [--steps 300] [--output benchmarks/results/halt_criteria.json]
    python -m benchmarks.bench_halt_criteria --checkpoints runs/main/loopformer runs/results/shakespeare/loopformer \
        runs/results/shakespeare/tmlt_ee --output benchmarks/results/halting_rules.json

For each rule and several thresholds `halt_eps`, a teacher-forced forward over held-out rows gives the mean loop
steps per scored token, the exact match of the answers (synthetic) and the perplexity of the scored tokens; next to
them, the same qualities of the fixed budgets M = 1..L (uniform schedule, `loop_budget=M`) interpolated linearly at
that mean. The rules:

- "state_change", "kl", "entropy": a token freezes where its score falls below halt_eps (today's criteria);
- "state_change_shortcut", "kl_shortcut", "entropy_shortcut" (LoopFormer, conditioned on Δ): the same scores, but a
  token whose score falls after step i takes one step Δ = 1 − t_i to t = 1 before it freezes (a shortcut trajectory
  of i + 1 steps the objective trains);
- "probe_entropy" (LoopFormer): every token first runs the one-step trajectory; where its next-token entropy there
  is at least halt_eps it runs the full budget from the embeddings (1 + L steps), else it keeps the one-step output
  (and its keys/values stand in for the budget's in the cache, as for any halted token);
- "probe_entropy_context" (LoopFormer; an emulation, not a model option): the same choice per token, but every token
  runs both trajectories, so the unsure ones attend to every token's full-trajectory keys/values. Counted at the
  probe's cost (1 or 1 + L per scored token), it is what the probe would give if the sure tokens' context were free;
  the gap to "probe_entropy" is what reusing the probe's keys/values costs.

Beside the fixed budgets, LoopFormer rows are also read against the best fixed trajectory at the same cost: the upper
envelope of the uniform budgets and of the shortcut trajectories [1/L]·i + [1 − i/L] (i + 1 steps), the paths the
"_shortcut" rules take. A rule pays where its quality beats the fixed budgets' at the same mean loops. The planned
targets (`targets`): on exact-match tasks, some halt_eps at ≤ L − 0.5 mean loops with exact match within 0.01 of M = L
and not below the fixed-budget curve; on text, perplexity below the fixed-budget curve at ≥ 2 settings.
"""

import argparse
import math
import random
import time

import torch

import loopformer_hf
from benchmarks.halting_rules import LabLoopFormerForCausalLM
from loopformer_hf import ShortcutConsistency
from benchmarks import write_json
from looped_training.loopformer.data.synthetic import END_OF_ANSWER, make_problems, tokenize_problems
from looped_training.loopformer.metrics import build_eval_data, load_checkpoint, quality
from looped_training.loopformer.report import halting_metric
from looped_training.loopformer.objective import sample_shortcut_trajectory

THRESHOLDS = {
    "state_change": [0.02, 0.05, 0.1, 0.2, 0.4, 0.8],
    "kl": [0.001, 0.01, 0.05, 0.2, 1.0, 3.0],
    "entropy": [0.05, 0.2, 0.5, 1.0, 2.0, 4.0],
}
SHORTCUT_RULES = {f"{name}_shortcut": values for name, values in THRESHOLDS.items()}
PROBE_THRESHOLDS = [0.01, 0.05, 0.2, 0.5, 1.0, 2.0]  # "probe_entropy": entropy (nats) of the one-step prediction


def halting_sweep_summary(result):
    """One checkpoint of this script's `--checkpoints` results (its JSON entry) as markdown
    lines: per exit rule, whether halting_verdict's target holds and where, and its row of best margin over the fixed
    budgets at equal compute (with the best fixed trajectory's quality there: uniform budgets or a shortcut exit)."""
    metric, higher = halting_metric(result["task"])
    sign = 1 if higher else -1
    lines = [
        f"| rule | target met (halt_eps) | best row: halt_eps | mean loops | {metric} | fixed budgets at equal "
        "compute | best fixed trajectory |",
        "|---|---|---|---|---|---|---|",
    ]
    for rule, verdict in result["targets"].items():
        rows = [r for r in result["criteria"] if r["criterion"] == rule]
        best = max(rows, key=lambda r: (sign * (r[metric] - r[f"fixed_{metric}"]), -r["mean_loops"]))
        held = ", ".join(f"{e:g}" for e in verdict["settings"]) or "-"
        lines.append(
            f"| {rule} | {'yes' if verdict['met'] else 'no'} ({held}) | {best['halt_eps']:g} | "
            f"{best['mean_loops']:.2f} | {best[metric]:.3f} | {best[f'fixed_{metric}']:.3f} | "
            f"{best.get(f'best_fixed_{metric}', best[f'fixed_{metric}']):.3f} |"
        )
    return lines


def rules_for(model):
    """{rule: thresholds} that apply to `model`: the "_shortcut" rules and the probe only to a model conditioned on Δ."""
    if model.config.loop_conditioning == "shortcut":
        return {**THRESHOLDS, **SHORTCUT_RULES, "probe_entropy": PROBE_THRESHOLDS}
    return dict(THRESHOLDS)


class CharTokenizer:
    """Every character of the arithmetic problems is one token (what the byte-level BPE gives them too)."""

    def __init__(self, alphabet="0123456789+*=" + END_OF_ANSWER):
        self.pad_token_id = 0
        self.ids = {c: i + 1 for i, c in enumerate(alphabet)}

    def __len__(self):
        return len(self.ids) + 1

    def __call__(self, text, add_special_tokens=False):
        """One text, or a list of texts (as `tokenize_problems` passes them)."""
        if isinstance(text, str):
            return {"input_ids": [self.ids[c] for c in text]}
        return {"input_ids": [[self.ids[c] for c in t] for t in text]}


def problem_tensors(problems, tokenizer, block_size):
    rows = tokenize_problems(problems, tokenizer, block_size)
    return {k: torch.tensor(rows[k]) for k in ("input_ids", "attention_mask", "labels")}


def train_tiny(steps, batch_size=64, eval_problems=512, max_depth=2, seed=0, log=print):
    """A LoopFormer 2⊗4 (hidden 64) trained for `steps` AdamW steps with shortcut consistency; (model, eval data).
    Depth 1..2 as the report's CPU preset. Measured 2026-11-30: 300 steps leave this model at chance, the same answer
    at every budget (EM 0.115, answer ppl 3.164 at M = 1..4; 0.129 / 3.181 at depth 1..6), so its rows only show the
    mechanics; `--checkpoints` on the report's trained runs gives the comparison that means something."""
    torch.manual_seed(seed)
    tokenizer = CharTokenizer()
    block_size = 2 * max_depth + 4
    config = loopformer_hf.LoopFormerConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=256,
        num_hidden_layers=2,
        num_loops=4,
        max_position_embeddings=block_size,
        pad_token_id=0,
    )
    model = loopformer_hf.LoopFormerForCausalLM(config)
    train = problem_tensors(make_problems(steps * batch_size, 1, max_depth, seed=seed), tokenizer, block_size)
    held_out = problem_tensors(make_problems(eval_problems, 1, max_depth, seed=seed + 1), tokenizer, block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    start = time.time()
    for step in range(steps):
        batch = {k: v[step * batch_size : (step + 1) * batch_size] for k, v in train.items()}
        objective = ShortcutConsistency(sample_shortcut_trajectory(rng, config.num_loops), 0.5, 0.1)
        out = model(**batch, shortcut_consistency=objective, use_cache=False)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 25 == 0 or step + 1 == steps:
            log(
                f"  step {step + 1}/{steps}: loss {out.loss.item():.3f} (CE full {out.ce_full.item():.3f}, "
                f"short {out.ce_short.item():.3f}), {time.time() - start:.0f} s"
            )
    return model.eval(), held_out


def interpolate(points, x):
    """Linear interpolation of sorted (x, y) points at x."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1] if x < points[0][0] else points[-1][1]


def shortcut_exit_trajectory(num_loops, i):
    """[1/L]·i + [1 − i/L]: the path of a token that exits after uniform step i (i + 1 steps; i = 0: one step)."""
    return [1.0 / num_loops] * i + [1.0 - i / num_loops]


def envelope(points):
    """The upper envelope (best quality at each cost, `better` already folded in: higher y is better) of (x, y)
    points, as sorted (x, y) with non-decreasing y."""
    best = []
    for x, y in sorted(points):
        if best and x == best[-1][0]:
            best[-1] = (x, max(best[-1][1], y))
        elif not best or y > best[-1][1]:
            best.append((x, y))
    return best


@torch.no_grad()
def probe_context_rows(model, data, thresholds=PROBE_THRESHOLDS, batch_size=128):
    """ "probe_entropy_context" (see the module's docstring), teacher-forced: per threshold (mean loops, EM, ppl)."""
    L = model.config.num_loops
    stats = {eps: dict(ce=0.0, count=0, correct=[], loops=[]) for eps in thresholds}
    for start in range(0, data["input_ids"].shape[0], batch_size):
        ids = data["input_ids"][start : start + batch_size]
        mask = data["attention_mask"][start : start + batch_size]
        labels = data["labels"][start : start + batch_size][:, 1:]
        valid = labels != -100
        one, full = (
            model(input_ids=ids, attention_mask=mask, step_schedule=schedule, use_cache=False)
            .logits[:, :-1]
            .float()
            .log_softmax(-1)
            for schedule in ([1.0], [1.0 / L] * L)
        )
        entropy = -(one.exp() * one).sum(-1)
        for eps, st in stats.items():
            sure = entropy < eps
            mixed = torch.where(sure[..., None], one, full)
            st["ce"] += float(-mixed.gather(-1, labels.clamp(min=0)[..., None])[..., 0][valid].sum())
            st["count"] += int(valid.sum())
            st["correct"] += ((mixed.argmax(-1) == labels) | ~valid).all(-1).tolist()
            loops = torch.where(sure, 1.0, 1.0 + L)
            st["loops"] += ((loops * valid).sum(-1) / valid.sum(-1).clamp(min=1)).tolist()
    return [
        dict(
            halt_eps=eps,
            mean_loops=sum(st["loops"]) / len(st["loops"]),
            em=sum(st["correct"]) / len(st["correct"]),
            ppl=math.exp(st["ce"] / max(st["count"], 1)),
        )
        for eps, st in stats.items()
    ]


def evaluate_criteria(model, data, thresholds=None):
    """Fixed budgets (and, for LoopFormer, the shortcut-exit trajectories), then each rule at each threshold: mean
    loops, EM and perplexity, with the fixed budgets' and the best fixed trajectory's at the same mean loops.
    `thresholds` defaults to `rules_for(model)`."""
    L = model.config.num_loops
    shortcut = model.config.loop_conditioning == "shortcut"
    thresholds = rules_for(model) if thresholds is None else thresholds
    fixed = []
    for M in range(1, L + 1):
        ppl, correct, _ = quality(model, data, model.config.resolve_trajectory(M, "uniform"), batch_size=512)
        fixed.append(dict(loop_budget=M, em=sum(correct) / len(correct), ppl=ppl))
    exits = []
    if shortcut:
        for i in range(1, L - 1):  # i = 0 is M = 1 and i = L − 1 is M = L, both above
            ppl, correct, _ = quality(model, data, shortcut_exit_trajectory(L, i), batch_size=512)
            exits.append(dict(exit_after=i, loops=i + 1, em=sum(correct) / len(correct), ppl=ppl))
    curves = {
        metric: [(f["loop_budget"], sign * f[metric]) for f in fixed] for metric, sign in (("em", 1), ("ppl", -1))
    }
    best = {
        metric: envelope(curve + [(e["loops"], sign * e[metric]) for e in exits])
        for (metric, curve), sign in zip(curves.items(), (1, -1))
    }

    def row(rule, eps, mean, em, ppl):
        return dict(
            criterion=rule,
            halt_eps=eps,
            mean_loops=mean,
            em=em,
            ppl=ppl,
            fixed_em=interpolate(curves["em"], mean),
            fixed_ppl=-interpolate(curves["ppl"], mean),
            best_fixed_em=interpolate(best["em"], mean),
            best_fixed_ppl=-interpolate(best["ppl"], mean),
        )

    rows = []
    lab = LabLoopFormerForCausalLM.of(model)  # the model that runs the lab's rules
    for criterion, values in thresholds.items():
        for eps in values:
            trajectory = model.config.resolve_trajectory(L, "uniform")
            ppl, correct, loops = quality(
                lab, data, trajectory, batch_size=512, halt_eps=eps, halt_criterion=criterion
            )
            rows.append(row(criterion, eps, sum(loops) / len(loops), sum(correct) / len(correct), ppl))
    if "probe_entropy" in thresholds:
        rows += [
            row("probe_entropy_context", p["halt_eps"], p["mean_loops"], p["em"], p["ppl"])
            for p in probe_context_rows(model, data, thresholds["probe_entropy"])
        ]
    return fixed, exits, rows


def targets(task, fixed, rows):
    """The planned targets, per rule: {rule: dict(met, settings)}: on exact match, the halt_eps values at ≤ L − 0.5
    mean loops with EM within 0.01 of M = L and not below the fixed-budget curve; on text, those whose perplexity is
    below the fixed-budget curve (met with ≥ 2)."""
    L = len(fixed)
    verdicts = {}
    for r in rows:
        if task == "synthetic":
            ok = r["mean_loops"] <= L - 0.5 and r["em"] >= fixed[-1]["em"] - 0.01 and r["em"] >= r["fixed_em"] - 1e-9
        else:  # below by more than float noise, at a compute the fixed budgets span (a probe may spend 1 + L)
            ok = r["mean_loops"] <= L and r["ppl"] < r["fixed_ppl"] * (1 - 1e-6)
        v = verdicts.setdefault(r["criterion"], dict(settings=[], met=False))
        if ok:
            v["settings"].append(r["halt_eps"])
        v["met"] = len(v["settings"]) >= (1 if task == "synthetic" else 2)
    return verdicts


def format_rows(fixed, rows, exits=(), verdicts=None):
    best = any("best_fixed_em" in r for r in rows) and bool(exits)
    lines = [
        "| rule | halt_eps | mean loops | EM | ppl | fixed budgets at the same mean loops: EM | ppl |"
        + (" best fixed trajectory: EM | ppl |" if best else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if best else ""),
    ]
    pad = " - | - |" if best else ""
    for f in fixed:
        lines.append(
            f"| fixed M={f['loop_budget']} | - | {f['loop_budget']} | {f['em']:.3f} | {f['ppl']:.3f} | - | - |" + pad
        )
    for e in exits:
        lines.append(
            f"| fixed shortcut exit after step {e['exit_after']} | - | {e['loops']} | {e['em']:.3f} | "
            f"{e['ppl']:.3f} | - | - |" + pad
        )
    for r in rows:
        lines.append(
            f"| {r['criterion']} | {r['halt_eps']:g} | {r['mean_loops']:.2f} | {r['em']:.3f} | "
            f"{r['ppl']:.3f} | {r['fixed_em']:.3f} | {r['fixed_ppl']:.3f} |"
            + (f" {r['best_fixed_em']:.3f} | {r['best_fixed_ppl']:.3f} |" if best else "")
        )
    if verdicts:
        lines += ["", "| rule | target met | halt_eps where it holds |", "|---|---|---|"]
        lines += [
            f"| {rule} | {'yes' if v['met'] else 'no'} | {', '.join(f'{e:g}' for e in v['settings']) or '-'} |"
            for rule, v in verdicts.items()
        ]
    return "\n".join(lines)


def evaluate_checkpoints(paths, max_rows, output, names=None):
    """The same comparison on trained checkpoints, each on the held-out rows it was trained for (exact match is the
    synthetic task's metric; perplexity, of all scored tokens, the text task's)."""
    results = {}
    for k, path in enumerate(paths):
        model, tokenizer, meta = load_checkpoint(path)
        task, data, _ = build_eval_data(meta, tokenizer, max_rows)
        start = time.time()
        with torch.no_grad():
            fixed, exits, rows = evaluate_criteria(model, data)
        verdicts = targets(task, fixed, rows)
        name = names[k] if names else path
        print(
            f"{name}: {path} ({task}, {model.config.loop_conditioning} conditioning, L = {model.config.num_loops}, "
            f"{len(data['input_ids'])} held-out rows, {time.time() - start:.0f} s):"
        )
        print(format_rows(fixed, rows, exits, verdicts), flush=True)
        results[path] = dict(
            name=name,
            task=task,
            rows=len(data["input_ids"]),
            num_loops=model.config.num_loops,
            loop_conditioning=model.config.loop_conditioning,
            fixed=fixed,
            shortcut_exits=exits,
            criteria=rows,
            targets=verdicts,
        )
        print("", *halting_sweep_summary(results[path]), sep="\n", flush=True)
    write_json(output, dict(checkpoints=results))
    print(f"wrote {output}")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoints",
        nargs="*",
        default=[],
        help="trained LoopFormer training-output folders, e.g. the report's "
        "runs/results/<task>/loopformer (their own held-out data); default: train a tiny model",
    )
    parser.add_argument("--names", nargs="*", default=None, help="display names, one per checkpoint")
    parser.add_argument("--steps", type=int, default=300, help="training steps of the tiny model (default 300)")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--eval_problems", type=int, default=512, help="held-out problems (default 512)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="benchmarks/results/halt_criteria.json")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "eval_problems"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    if args.checkpoints:
        if args.names and len(args.names) != len(args.checkpoints):
            parser.error(f"--names gives {len(args.names)} names for {len(args.checkpoints)} checkpoints")
        return evaluate_checkpoints(args.checkpoints, args.eval_problems, args.output, args.names)
    print(f"training a tiny LoopFormer on synthetic arithmetic for {args.steps} steps", flush=True)
    model, data = train_tiny(args.steps, args.batch_size, args.eval_problems, log=lambda s: print(s, flush=True))
    with torch.no_grad():
        fixed, exits, rows = evaluate_criteria(model, data)
    verdicts = targets("synthetic", fixed, rows)
    print(format_rows(fixed, rows, exits, verdicts))
    write_json(
        args.output,
        dict(
            steps=args.steps,
            batch_size=args.batch_size,
            eval_problems=args.eval_problems,
            fixed=fixed,
            shortcut_exits=exits,
            criteria=rows,
            targets=verdicts,
        ),
    )
    print(f"wrote {args.output}")
    return fixed, rows


if __name__ == "__main__":
    main()
