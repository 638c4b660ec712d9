"""Wall-clock of cached generation with per-token halting (`halt_eps`) against mean loops per token.

    python -m benchmarks.bench_halting [--checkpoint runs/main/loopformer] [--output benchmarks/results/halting.json]

For fixed budgets M = 1..L and a sweep of halt_eps (both KV fill strategies), it runs greedy cached generation
side by side (interleaved repeats in alternating order, medians) and prints the time per generated token relative to
the full budget L (median of per-round ratios), next to the mean loop steps per generated token relative to L and the
target bound m/L + 0.15 at mean m loops, and the tensor operations (ATen calls) per generated token, prompt
included, counted once per run: exact where times on a shared CPU swing by tens of percent. Without a checkpoint a
tiny random model is used (its halting pattern is arbitrary; use a trained checkpoint for meaningful halting).
"""

import argparse
import statistics
import time

import torch

import loopformer_hf
from benchmarks.halting_rules import LabLoopFormerForCausalLM
from benchmarks import write_json
from tests.support.instruments import CountOps
from loopformer_hf.halting_loopformer import state_change_score
from transformers import AutoModelForCausalLM


def tiny_random_model(hidden_size=256):
    torch.manual_seed(0)
    cfg = loopformer_hf.LoopFormerConfig(
        vocab_size=512,
        hidden_size=hidden_size,
        num_attention_heads=4,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=2,
        num_loops=4,
        max_position_embeddings=1024,
    )
    model = loopformer_hf.LoopFormerForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name:
                p.normal_(0, 0.05)
    return model.eval()


def halting_rows(
    model, eps_values, fills=("recompute", "reuse"), prompt_len=32, new_tokens=128, repeats=5, criterion=None
):
    """Fixed budgets M = 1..L and halting at each eps (and fill), timed side by side: one row per run with the mean
    loops per generated token, the median ms per token, its ratio to M = L (median over interleaved rounds) and the
    target bound m/L + 0.15 of that ratio at mean m loops. `criterion`: the exit rule (default: the library's,
    "state_change"; another runs on `LabLoopFormerForCausalLM.of(model)`)."""
    L = model.config.num_loops
    prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    runs = {f"M={m}": dict(loop_budget=m) for m in range(1, L + 1)}
    rule = {} if criterion is None else {"halt_criterion": criterion}
    if criterion is not None:
        model = LabLoopFormerForCausalLM.of(model)
    for fill in fills:
        for eps in eps_values:
            runs[f"eps={eps} ({fill})"] = dict(halt_eps=eps, fill=fill, **rule)

    def run(kw):
        kw = dict(kw)
        model.config.halt_kv_fill = kw.pop("fill", "recompute")
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                prompt,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
                **kw,
            )
        seconds = time.perf_counter() - start
        counts = out.get("loop_counts")
        # positions prompt-1 .. end-1 produced the generated tokens
        loops = counts[0, prompt_len - 1 :].float().mean().item() if counts is not None else kw["loop_budget"]
        return seconds / new_tokens, loops

    times = {name: [] for name in runs}
    loops = {}
    run(runs[f"M={L}"])  # warm-up
    ops = {}
    for name in runs:  # counted once, outside the timed rounds (counting slows every op)
        with CountOps() as counter:
            run(runs[name])
        ops[name] = counter.count / new_tokens
    names = list(runs)
    for r in range(repeats):  # interleaved, alternating order, so that machine noise hits every configuration alike
        for name in names if r % 2 == 0 else names[::-1]:
            t, l = run(runs[name])
            times[name].append(t)
            loops[name] = l
    table = []
    for name in runs:
        ratios = [t / full for t, full in zip(times[name], times[f"M={L}"])]
        table.append(
            dict(
                run=name,
                mean_loops=loops[name],
                loops_over_L=loops[name] / L,
                ms_per_token=1e3 * statistics.median(times[name]),
                ms_spread=1e3 * (max(times[name]) - min(times[name])),
                time_ratio=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
                bound=loops[name] / L + 0.15,
                ops_per_token=ops[name],
                ops_ratio=ops[name] / ops[f"M={L}"],
            )
        )
    return table


def format_halting(table):
    lines = [
        f"{'run':<24} {'mean loops/token':>17} {'loops/L':>8} {'time/token ms':>14} {'time ratio vs M=L':>18} "
        f"{'bound m/L+0.15':>15} {'met':>4} {'ATen calls/token':>17} {'calls vs M=L':>13}"
    ]
    for row in table:
        lines.append(
            f"{row['run']:<24} {row['mean_loops']:>17.2f} {row['loops_over_L']:>8.2f} "
            f"{row['ms_per_token']:>14.2f} {row['time_ratio']:>18.2f} {row['bound']:>15.2f} "
            f"{'yes' if row['time_ratio'] <= row['bound'] else 'NO':>4} {row['ops_per_token']:>17.1f} "
            f"{row['ops_ratio']:>13.2f}"
        )
    return "\n".join(lines)


def median_score(model, ids):
    """The median state-change score over every token and loop step: a halt_eps at which tokens halt at mixed
    steps."""
    with torch.no_grad():
        states = model(ids, output_hidden_states=True, use_cache=False).hidden_states  # embeddings, then each step
    scores = [state_change_score(prev, h) for prev, h in zip(states[:-1], states[1:])]
    return torch.cat(scores).flatten().median().item()


def gather_rows(widths, token_counts, repeats=20):
    """Prefill with halting at each width and prompt length, the active tokens gathered (`GATHER_MIN_GRID` = 0)
    against every token computed and the halted ones discarded, timed side by side: what `GATHER_MIN_GRID` is set
    from. Random models (tiny_random_model at each width), halt_eps at the median score so that tokens halt at mixed
    steps; one row per (width, tokens) with the median of per-round time ratios gathered / dense."""
    from loopformer_hf import halting_loopformer

    saved = halting_loopformer.GATHER_ACTIVE_FRACTION, halting_loopformer.GATHER_MIN_GRID
    rows = []
    try:
        for width in widths:
            model = tiny_random_model(width)
            for tokens in token_counts:
                ids = torch.randint(3, 512, (1, tokens), generator=torch.Generator().manual_seed(0))
                eps = median_score(model, ids)

                def run(gather):
                    halting_loopformer.GATHER_ACTIVE_FRACTION = 0.75 if gather else -1.0
                    halting_loopformer.GATHER_MIN_GRID = 0
                    start = time.perf_counter()
                    with torch.no_grad():
                        counts = model(ids, halt_eps=eps, use_cache=True).loop_counts
                    return time.perf_counter() - start, counts

                run(True), run(False)  # warm-up
                times = {True: [], False: []}
                for r in range(repeats):
                    for gather in (True, False) if r % 2 == 0 else (False, True):
                        times[gather].append(run(gather)[0])
                ratios = [a / b for a, b in zip(times[True], times[False])]
                rows.append(
                    dict(
                        hidden_size=width,
                        tokens=tokens,
                        grid=width * tokens,
                        halt_eps=eps,
                        mean_loops=run(True)[1].float().mean().item(),
                        dense_ms=1e3 * statistics.median(times[False]),
                        gather_over_dense=statistics.median(ratios),
                        ratio_min=min(ratios),
                        ratio_max=max(ratios),
                    )
                )
    finally:
        halting_loopformer.GATHER_ACTIVE_FRACTION, halting_loopformer.GATHER_MIN_GRID = saved
    return rows


def format_gather(rows):
    lines = [
        f"{'hidden':>6} {'tokens':>6} {'tokens x hidden':>15} {'mean loops':>10} {'dense ms':>9} "
        f"{'gathered / dense':>17} {'spread':>11}"
    ]
    for r in rows:
        lines.append(
            f"{r['hidden_size']:>6} {r['tokens']:>6} {r['grid']:>15} {r['mean_loops']:>10.2f} "
            f"{r['dense_ms']:>9.2f} {r['gather_over_dense']:>17.3f} {r['ratio_min']:>5.2f}-{r['ratio_max']:.2f}"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="a LoopFormer folder; default: a tiny random model")
    parser.add_argument("--eps", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2, 0.4])
    parser.add_argument("--fill", nargs="+", default=["recompute", "reuse"], choices=["recompute", "reuse"])
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--criterion",
        default=None,
        help="the exit rule (halt_criterion) the halt_eps runs use; default: the library's, state_change",
    )
    parser.add_argument(
        "--output", default=None, help="default benchmarks/results/halting.json (halting_gather.json with --gather)"
    )
    parser.add_argument(
        "--gather",
        action="store_true",
        help="instead: prefill time with the active tokens gathered vs every token computed, per width "
        "and prompt length (what GATHER_MIN_GRID is set from)",
    )
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gather:
        rows = gather_rows(args.widths, args.tokens, args.repeats)
        print(format_gather(rows))
        output = args.output or "benchmarks/results/halting_gather.json"
        write_json(output, dict(threads=args.threads, repeats=args.repeats, rows=rows))
        print(f"wrote {output}")
        return rows

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval() if args.checkpoint else tiny_random_model()
    table = halting_rows(model, args.eps, args.fill, args.prompt_len, args.new_tokens, args.repeats, args.criterion)
    print(format_halting(table))
    output = args.output or "benchmarks/results/halting.json"
    write_json(
        output,
        dict(
            checkpoint=args.checkpoint,
            num_loops=model.config.num_loops,
            new_tokens=args.new_tokens,
            criterion=args.criterion or "state_change",
            rows=table,
        ),
    )
    print(f"wrote {output}")
    return table


if __name__ == "__main__":
    main()
