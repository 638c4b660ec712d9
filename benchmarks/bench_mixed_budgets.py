"""Batched `generate` with per-row loop budgets: what a mixed batch (half the prompts at M=1, half at M=L) costs
against the same batch all at M=L (and all at M=1), tokens/s measured side by side in one run.

    .venv/bin/python -m benchmarks.bench_mixed_budgets                   # 64 prompts x 64 new tokens (~2 min, 1 thread)
    .venv/bin/python -m benchmarks.bench_mixed_budgets --quick --output /tmp/mixed_quick.json   # smoke run
    .venv/bin/python -m benchmarks.bench_mixed_budgets --hidden_size 1024 --repeats 3   # where compute is the cost

The model is bench_loopformer's (k⊗L = 2⊗4, hidden 256, SwiGLU, RoPE, fp32, sdpa). Sides, interleaved as in
bench_loopformer (one warm-up each, then rounds in alternating order, ratios the median of per-round ratios), each
timed in this process's CPU time (one thread: the compute's own, where wall time on a shared machine is not):

- `all_L`: `loop_budget=L` for every row, today's single-budget call;
- `mixed`: `loop_budget=torch.tensor([1]*n/2 + [L]*n/2)`: the loop runs L steps, the M=1 rows freeze after step 1
  and leave the later steps' computation when the halting gather finds it worth it (`GATHER_ACTIVE_FRACTION`,
  `GATHER_MIN_GRID` in halting_loopformer.py);
- `mixed_dense`: the same with that gather off (every row computed at every step, the frozen ones restored), what
  masked compute costs;
- `all_1`: `loop_budget=1` for every row, the floor.

Every mixed row's tokens are compared with the same row of `all_1` or `all_L` (greedy, the same batch).
"""

import os
import sys
import time

import torch

from benchmarks.bench_loopformer import (
    FULL,
    QUICK,
    build_models,
    interleaved,
    med,
    paired_ratio,
    timing_arguments,
    write_report,
)
from loopformer_hf import halting_loopformer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO_ROOT, "benchmarks", "results", "mixed_budgets.json")


def generate_fn(model, prompts, new_tokens, loop_budget, gather=True):
    result = {}

    def run():
        grid = halting_loopformer.GATHER_MIN_GRID
        if not gather:
            halting_loopformer.GATHER_MIN_GRID = float("inf")
        try:
            with torch.inference_mode():
                result["tokens"] = model.generate(
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                    loop_budget=loop_budget,
                )
        finally:
            halting_loopformer.GATHER_MIN_GRID = grid

    run.result = result
    return run


def run_benchmark(cfg, threads, prompts_n, new_tokens, repeats, log=print):
    torch.set_num_threads(threads)
    model, _ = build_models(cfg, "rope")
    model.eval()
    L, half = cfg["loops"], prompts_n // 2
    prompts = torch.randint(3, cfg["vocab"], (prompts_n, cfg["prompt"]), generator=torch.Generator().manual_seed(1))
    mixed = torch.tensor([1] * half + [L] * (prompts_n - half))
    sides = {
        "all_L": generate_fn(model, prompts, new_tokens, L),
        "mixed": generate_fn(model, prompts, new_tokens, mixed),
        "mixed_dense": generate_fn(model, prompts, new_tokens, mixed, gather=False),
        "all_1": generate_fn(model, prompts, new_tokens, 1),
    }
    log(f"{prompts_n} prompts x {new_tokens} new tokens, half at M=1 and half at M={L}; {repeats} rounds")
    # CPU time of this process: on a machine that others load, wall time varies 2x between rounds; with one thread
    # the CPU time is the compute's own
    t = interleaved(sides, repeats, clock=time.process_time)
    tokens = prompts_n * new_tokens
    out = {
        name: {"tokens_per_cpu_s": tokens / med(t[name]), "cpu_s": med(t[name]), "times": t[name]} for name in sides
    }
    for name in ("mixed", "mixed_dense", "all_1"):
        out[name]["tokens_per_s_over_all_L"] = paired_ratio(t, "all_L", name)  # tokens/s ratio = inverse time ratio
    got = {name: fn.result["tokens"] for name, fn in sides.items()}
    same = {
        name: int(
            (got[name][:half] == got["all_1"][:half]).all(-1).sum()
            + (got[name][half:] == got["all_L"][half:]).all(-1).sum()
        )
        for name in ("mixed", "mixed_dense")
    }
    return dict(results=out, rows_equal_to_their_budget=same, rows=prompts_n)


def format_table(report):
    lines = ["| side | tokens per CPU second | over all at M=L |", "|---|---|---|"]
    for name, r in report["results"].items():
        ratio = r.get("tokens_per_s_over_all_L", 1.0)
        lines.append(f"| {name} | {r['tokens_per_cpu_s']:.0f} | {ratio:.3f} |")
    lines.append("")
    lines.append(
        "rows whose tokens equal their budget's batch: "
        + ", ".join(f"{name} {n}/{report['rows']}" for name, n in report["rows_equal_to_their_budget"].items())
    )
    return "\n".join(lines)


def main(argv=None):
    p = timing_arguments(__doc__, DEFAULT_OUTPUT, "rounds (default: 5; 1 with --quick)")
    p.add_argument(
        "--hidden_size",
        type=int,
        default=None,
        help="a wider model (head_dim 64, FFN 4x): at 256 the batch of 64 is bound by per-step overheads, "
        "wider makes the loop steps' compute the cost a budget saves",
    )
    args = p.parse_args(argv)
    if args.threads < 1 or (args.repeats is not None and args.repeats < 1):
        p.error("--threads and --repeats must be >= 1")
    cfg = dict(QUICK if args.quick else FULL, prompt=16)
    if args.hidden_size:
        cfg.update(hidden=args.hidden_size, heads=args.hidden_size // 64, intermediate=4 * args.hidden_size)
    prompts_n, new_tokens = (8, 8) if args.quick else (64, 64)
    repeats = args.repeats or (1 if args.quick else 5)
    start = time.time()
    report = run_benchmark(cfg, args.threads, prompts_n, new_tokens, repeats, log=lambda s: print(s, flush=True))
    report = dict(
        config=dict(
            cfg,
            threads=args.threads,
            quick=args.quick,
            prompts=prompts_n,
            new_tokens=new_tokens,
            repeats=repeats,
            torch=torch.__version__,
        ),
        wall_s=time.time() - start,
        **report,
    )
    write_report(report, args.output, format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
