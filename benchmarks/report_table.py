"""The README's benchmark table in one command: runs the benchmarks' functions side by side (interleaved repeats in
alternating order) and prints a markdown table of medians, per-round ratio medians and their spread.

    python -m benchmarks.report_table [--repeats 5] [--threads 1] [--output benchmarks/results/report_table.json]
    python -m benchmarks.report_table --quick      # smoke run: tiny sizes, timings meaningless

Rows: training step and cached generate tokens/s of LoopFormer 2⊗4 against the iso-FLOP Llama (8 layers; the models
of benchmarks/bench_loopformer.py), generate time at each budget M against M = L, and cached generation with
per-token halting at several ε (benchmarks/bench_halting.py). Further rows (compiled vs eager, static vs dynamic
cache, shared vs full cache memory) come from the functions listed in `EXTRA_ROWS`.
"""

import argparse
import math
import statistics
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import (
    bench_authors,
    bench_cache_sharing,
    bench_compile,
    bench_halting,
    format_markdown,
    row,
    write_json,
)
from benchmarks.bench_loopformer import FULL, QUICK, build_models, generate_fn, interleaved, train_step_fn
from tests.support.instruments import CountOps


def cache_rows(cfg, threads, repeats, log=print):
    """Cached generate of the same LoopFormer (budgets L and 1): static cache against the dynamic one, and compiled
    (`torch.compile(forward, fullgraph=True)`, static cache) against eager with the dynamic cache; tokens/s ratios.
    The compiled side compiles in the warm-up round (one graph for the prefill, one for decode steps, per budget)."""
    loopformer, _ = build_models(cfg, "rope")
    loopformer.eval()
    compiled = bench_compile.compiled_copy(loopformer)
    prompt = torch.randint(3, cfg["vocab"], (1, cfg["prompt"]), generator=torch.Generator().manual_seed(2))
    n, rows = cfg["gen_vs_llama"], []
    for M in (cfg["loops"], 1):
        log(f"static / compiled cached generate at M={M}: {n} new tokens, {repeats} rounds")
        sides = {
            "dynamic": generate_fn(loopformer, prompt, n, loop_budget=M, disable_compile=True),
            "static": generate_fn(
                loopformer, prompt, n, loop_budget=M, cache_implementation="static", disable_compile=True
            ),
            "compiled": generate_fn(
                compiled, prompt, n, loop_budget=M, cache_implementation="static", disable_compile=True
            ),
        }
        t = interleaved(sides, repeats)
        tokens = [fn.result["tokens"] for fn in sides.values()]
        same = all(torch.equal(tokens[0], x) for x in tokens[1:])
        for name, label in (("static", "static / dynamic cache"), ("compiled", "compiled static / eager dynamic")):
            ratios = [b / a for a, b in zip(t[name], t["dynamic"])]
            rows.append(
                row(
                    f"cached generate {n} tok at M={M}, tokens/s: {label}" + ("" if same else " (TOKENS DIFFER)"),
                    n / statistics.median(t[name]),
                    n / statistics.median(t["dynamic"]),
                    ratios,
                    ">= 1.0",
                    statistics.median(ratios) >= 1.0 and same,
                )
            )
    return rows


def shared_cache_rows(cfg, threads, repeats, log=print):
    """Keys/values held after cached generation at budgets L, 2L, 3L: the lab's shared cache (benchmarks/cache_sharing.py,
    n = 1, 2) over the exact one (one slot per loop step and block). Bytes, so no spread; an approximation beyond
    one call (docs/compile.md)."""
    loopformer, _ = build_models(cfg, "rope")
    loopformer.eval()
    prompt = torch.randint(3, cfg["vocab"], (1, cfg["prompt"]), generator=torch.Generator().manual_seed(3))
    n, L, rows = cfg["gen_vs_llama"], cfg["loops"], []
    log(f"shared cache memory at M = {L}, {2 * L}, {3 * L}: {n} new tokens")

    def held(M, share_n=None):
        cache = bench_cache_sharing.new_cache(loopformer.config, share_n)
        fn = generate_fn(loopformer, prompt, n, loop_budget=M, cache=cache, return_dict_in_generate=True)
        fn()
        out = fn.result["tokens"]
        return bench_cache_sharing.kv_bytes(out.cache if hasattr(out, "cache") else out.past_key_values)

    for M in (L, 2 * L, 3 * L):
        full = held(M)
        for share_n in (1, 2):
            shared = held(M, share_n)
            rows.append(
                row(
                    f"KV bytes after {cfg['prompt']}+{n} tokens at M={M}: shared n={share_n} / exact",
                    shared,
                    full,
                    [shared / full],
                    f"= {share_n}/{M}",
                    math.isclose(shared / full, share_n / M),
                )
            )
    return rows


# Functions (cfg, threads, repeats) -> list of row dicts (keys as `row` returns) for measurements that live in other
# benchmarks: compiled vs eager decode, static vs dynamic cache, shared vs full cache memory.
EXTRA_ROWS = [cache_rows, shared_cache_rows]
EXTRA_SLOT = "compiled vs eager / static vs dynamic cache / shared vs full cache memory"
AUTHORS_SLOT = "vs the authors' code (pass --authors_repo, a clone of github.com/armenjeddi/loopformer)"


def speed_rows(cfg, repeats, log=print):
    """LoopFormer vs the iso-FLOP Llama (train step, cached generate), and generate time at M over M = L."""
    warnings.filterwarnings("ignore", message="LoopFormer trajectory")
    loopformer, llama = build_models(cfg, "rope")
    g = torch.Generator().manual_seed(1)
    rows = []
    log(f"train step: batch {cfg['batch']} x seq {cfg['seq']}, {repeats} rounds")
    loopformer.train()
    llama.train()
    batch = torch.randint(3, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    t = interleaved({"lf": train_step_fn(loopformer, batch), "llama": train_step_fn(llama, batch)}, repeats)
    ratios = [a / b for a, b in zip(t["lf"], t["llama"])]
    r = statistics.median(ratios)
    rows.append(
        row(
            f"train step (b{cfg['batch']}x{cfg['seq']}), s: LoopFormer / Llama",
            statistics.median(t["lf"]),
            statistics.median(t["llama"]),
            ratios,
            "<= 1.0",
            r <= 1.0,
        )
    )
    loopformer.eval()
    llama.eval()
    prompt = torch.randint(3, cfg["vocab"], (1, cfg["prompt"]), generator=g)
    n = cfg["gen_vs_llama"]
    log(f"cached generate: {n} new tokens, {repeats} rounds")
    t = interleaved({"lf": generate_fn(loopformer, prompt, n), "llama": generate_fn(llama, prompt, n)}, repeats)
    ratios = [b / a for a, b in zip(t["lf"], t["llama"])]  # tokens/s ratio = inverse time ratio
    r = statistics.median(ratios)
    rows.append(
        row(
            f"cached generate {n} tok, tokens/s: LoopFormer / Llama",
            n / statistics.median(t["lf"]),
            n / statistics.median(t["llama"]),
            ratios,
            ">= 1.0",
            r >= 1.0,
        )
    )
    # the same calls' tensor operations per token: the looped model runs fewer than Llama, so where its tokens/s is
    # not ahead the difference is in the matmuls (reading the weights), not in per-op overhead
    ops = {}
    for name, model in (("lf", loopformer), ("llama", llama)):
        with CountOps() as counter:
            generate_fn(model, prompt, n)()
        ops[name] = counter.count / n
    rows.append(
        row(
            f"cached generate {n} tok, ATen calls/token: LoopFormer / Llama",
            ops["lf"],
            ops["llama"],
            [ops["lf"] / ops["llama"]],
        )
    )
    L, k = cfg["loops"], cfg["k"]
    log(f"cached generate at budget M = 1..{L}: {n} new tokens, {repeats} rounds")
    # The same depth ratio for an unlooped model: Llama with k layers against Llama with k·L layers, in the same rounds.
    torch.manual_seed(0)
    shallow = LlamaForCausalLM(LlamaConfig(**dict(llama.config.to_dict(), num_hidden_layers=k))).eval()
    sides = {M: generate_fn(loopformer, prompt, n, loop_budget=M) for M in range(1, L + 1)}
    t = interleaved(dict(sides, shallow=generate_fn(shallow, prompt, n), llama=generate_fn(llama, prompt, n)), repeats)
    for M in range(1, L):
        ratios = [a / b for a, b in zip(t[M], t[L])]
        bound = 0.30 if M == 1 else None
        r = statistics.median(ratios)
        rows.append(
            row(
                f"generate time, s: M={M} / M={L}",
                statistics.median(t[M]),
                statistics.median(t[L]),
                ratios,
                None if bound is None else f"<= {bound:.2f}",
                None if bound is None else r <= bound,
            )
        )
    rows.append(
        row(
            f"(reference) generate time, s: Llama {k} layers / Llama {k * L} layers",
            statistics.median(t["shallow"]),
            statistics.median(t["llama"]),
            [a / b for a, b in zip(t["shallow"], t["llama"])],
        )
    )
    return rows


def halting_table_rows(eps_values, prompt_len, new_tokens, repeats, log=print):
    """Cached generation with halting at each ε (fill "reuse", the default) against fixed budgets."""
    log(f"halting: eps {eps_values}, {new_tokens} new tokens, {repeats} rounds")
    model = bench_halting.tiny_random_model()
    table = bench_halting.halting_rows(model, eps_values, ("reuse",), prompt_len, new_tokens, repeats)
    L = model.config.num_loops
    full = next(r for r in table if r["run"] == f"M={L}")
    rows = []
    for r in table:
        if r["run"] == f"M={L}":
            continue
        halting = r["run"].startswith("eps")
        rows.append(
            dict(
                measurement=f"generate ms/token, {r['run']}, mean loops {r['mean_loops']:.2f}: / M={L}",
                loopformer=r["ms_per_token"],
                baseline=full["ms_per_token"],
                ratio=r["time_ratio"],
                ratio_min=r["ratio_min"],
                ratio_max=r["ratio_max"],
                target=f"<= {r['bound']:.2f}" if halting else None,
                met=r["time_ratio"] <= r["bound"] if halting else None,
            )
        )
    for r in table:  # the same runs' tensor operations per token: exact, where the times above are noisy
        if r["run"] != f"M={L}":
            rows.append(
                row(
                    f"ATen calls/token, {r['run']}, mean loops {r['mean_loops']:.2f}: / M={L}",
                    r["ops_per_token"],
                    full["ops_per_token"],
                    [r["ops_ratio"]],
                )
            )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds: a smoke run (timings meaningless)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per measurement (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument(
        "--new_tokens",
        type=int,
        default=None,
        help="tokens per generate call (default: 256 vs Llama and by budget, 128 with halting; 16 with --quick)",
    )
    p.add_argument("--eps", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4])
    p.add_argument(
        "--authors_repo",
        default=None,
        help="a clone of github.com/armenjeddi/loopformer: adds the rows against the authors' code "
        "(benchmarks/bench_authors.py)",
    )
    p.add_argument("--output", default="benchmarks/results/report_table.json")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    for name in ("repeats", "new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    cfg = dict(QUICK if args.quick else FULL)
    if args.new_tokens is not None:
        cfg["gen_vs_llama"] = args.new_tokens
    repeats = args.repeats or cfg["repeats"]
    torch.set_num_threads(args.threads)
    start = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    rows = speed_rows(cfg, repeats, log)
    halting_tokens = args.new_tokens or (16 if args.quick else 128)
    rows += halting_table_rows(args.eps, cfg["prompt"], halting_tokens, repeats, log)
    extra = [r for fn in EXTRA_ROWS for r in fn(cfg, args.threads, repeats)]
    rows += extra or [dict(measurement=EXTRA_SLOT, slot=True)]
    if args.authors_repo is not None:
        rows += bench_authors.authors_rows(cfg, repeats, args.authors_repo, log)
    else:
        rows.append(dict(measurement=AUTHORS_SLOT, slot="not run: their code is not fetched at run time"))
    print()
    print(format_markdown(rows))
    write_json(
        args.output,
        dict(
            config=dict(
                cfg, threads=args.threads, repeats=repeats, quick=args.quick, halting_new_tokens=halting_tokens
            ),
            authors_commit=args.authors_repo and bench_authors.authors_commit(args.authors_repo),
            torch=torch.__version__,
            wall_s=time.time() - start,
            rows=rows,
        ),
    )
    print(f"\nwrote {args.output} ({time.time() - start:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
