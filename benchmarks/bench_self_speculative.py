"""Depth that pays, measured side by side in one run (CPU time of this process, interleaved rounds as in
bench_loopformer):

1. Self-speculative decoding, `generate(..., assistant_loop_budget=d)`: tokens/s against plain greedy decoding at
   the full budget M=L, and the acceptance rate (accepted / drafted tokens), for d = 1..L-1 and a few
   `num_assistant_tokens`; the greedy tokens of both sides are checked identical.
2. Mixed budgets, batched `generate` with rows interleaved [1, L, 1, L, ...]: tokens/s against all rows at M=L, with
   the ideal ratio from the measured cost of a decode step over B/2 rows against B rows.

    .venv/bin/python -m benchmarks.bench_self_speculative --model runs/main/loopformer --prompts chains
    .venv/bin/python -m benchmarks.bench_self_speculative --model agreeing --loops 8      # the mechanism's ceiling
    .venv/bin/python -m benchmarks.bench_self_speculative --model authors_shape --new_tokens 16   # cost only
    .venv/bin/python -m benchmarks.bench_self_speculative --quick --output /tmp/spec_quick.json      # smoke run

`--model`: a saved LoopFormer folder (e.g. what scripts/main.sh trains), or `agreeing` (random weights with adaLN's
residual gates at zero: every budget computes the same function, so every draft is accepted; each loop step still
runs its full compute: the ceiling of the mechanism), or `authors_shape` (the authors' 0.28B shape, random weights:
acceptance means nothing there, only the cost of drafting and verifying), or `random` (bench_loopformer's model).
"""

import os
import sys
import time

import torch

from benchmarks.bench_loopformer import interleaved, med, paired_ratio, timing_arguments, write_report
import loopformer_hf

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO_ROOT, "benchmarks", "results", "self_speculative.json")

SHAPES = {  # hidden, heads, intermediate, vocab, k
    "random": (256, 4, 1024, 512, 2),
    "agreeing": (256, 4, 1024, 512, 2),
    "authors_shape": (1024, 16, 4096, 50304, 2),  # ~0.28B with the embeddings (the authors' LoopFormer shape)
    "quick": (64, 4, 128, 97, 2),
}


def build(name, loops, seed=0, hidden_size=None):
    """(model, tokenizer or None) of `--model` (`hidden_size`: another width for a built one, 4x its MLP)."""
    if os.path.isdir(name):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = (
            AutoTokenizer.from_pretrained(name) if os.path.exists(os.path.join(name, "tokenizer.json")) else None
        )
        return AutoModelForCausalLM.from_pretrained(name).eval(), tokenizer
    hidden, heads, intermediate, vocab, k = SHAPES[name]
    if hidden_size is not None:
        hidden, intermediate = hidden_size, 4 * hidden_size
    config = loopformer_hf.LoopFormerConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        num_hidden_layers=k,
        num_loops=loops,
        position_embedding_type="rope",
        hidden_act="swiglu",
        max_position_embeddings=1024,
        initializer_scheme="zero_adaln" if name == "agreeing" else "reference",
    )
    torch.manual_seed(seed)
    model = loopformer_hf.LoopFormerForCausalLM(config).eval()
    if name != "agreeing":  # adaLN as a trained model has it: every loop step changes the state
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "adaLN_modulation" in pname:
                    p.normal_(0.0, 0.02).add_(0.1 if pname.endswith("bias") else 0.0)
    return model, None


def prompts_of(kind, tokenizer, vocab, batch, length, seed=0):
    """(batch, length) prompt ids: arithmetic chains or text through the model's tokenizer, else random ids."""
    g = torch.Generator().manual_seed(seed)
    if kind == "chains" and tokenizer is not None:
        texts = [f"{int(a)}*{int(b)}+{int(c)}=" for a, b, c in torch.randint(1, 10, (batch, 3), generator=g)]
        return tokenizer(texts, return_tensors="pt", padding=True).input_ids
    if kind == "shakespeare" and tokenizer is not None:
        path = os.path.join(REPO_ROOT, "..", "shared", "data", "shakespeare")
        text = " ".join(
            open(os.path.join(path, f), encoding="utf-8").read()[:2000] for f in sorted(os.listdir(path))[:8]
        )
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        starts = torch.randint(0, len(ids) - length, (batch,), generator=g)
        return torch.stack([ids[s : s + length] for s in starts])
    return torch.randint(3, vocab, (batch, length), generator=g)


def speculative(model, prompts, new_tokens, budget, drafts, assistant_tokens, thresholds, schedules, repeats, log):
    """Rows of (d, num_assistant_tokens, its schedule, confidence threshold, speed-up, acceptance) against plain
    greedy at `budget`, each side decoding every prompt (a batch-1 call each) in turn."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, loop_budget=budget)
    kw["pad_token_id"] = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with torch.no_grad():
        plain_tokens = [model.generate(p[None], **kw) for p in prompts]
    tokens = len(prompts) * new_tokens

    def run(**knobs):
        def go():
            with torch.no_grad():
                for p in prompts:
                    model.generate(p[None], **kw, **knobs)

        return go

    rows = []
    for d in drafts:
        for n in assistant_tokens:
            for schedule, threshold in ((s, t) for s in schedules for t in thresholds):
                draft = dict(assistant_loop_budget=d, num_assistant_tokens=n, num_assistant_tokens_schedule=schedule)
                draft["assistant_confidence_threshold"] = threshold
                drafted = accepted = 0
                identical = True
                with torch.no_grad():
                    for p, plain in zip(prompts, plain_tokens):
                        out = model.generate(p[None], return_dict_in_generate=True, **kw, **draft)
                        identical &= bool(torch.equal(out.sequences, plain))
                        drafted, accepted = drafted + out.drafted_tokens, accepted + out.accepted_tokens
                times = interleaved({"plain": run(), "drafted": run(**draft)}, repeats, clock=time.process_time)
                row = dict(
                    d=d,
                    num_assistant_tokens=n,
                    num_assistant_tokens_schedule=schedule,
                    assistant_confidence_threshold=threshold,
                    speedup=paired_ratio(times, "plain", "drafted"),
                    plain_tokens_per_s=tokens / med(times["plain"]),
                    drafted_tokens_per_s=tokens / med(times["drafted"]),
                    acceptance=accepted / max(drafted, 1),
                    drafted=drafted,
                    accepted=accepted,
                    identical_greedy_tokens=identical,
                )
                log(
                    f"  d={d} n={n} ({schedule}) threshold {threshold}: {row['speedup']:.2f}x "
                    f"({row['plain_tokens_per_s']:.1f} "
                    f"-> {row['drafted_tokens_per_s']:.1f} tokens/s), acceptance {row['acceptance']:.2f}, "
                    f"identical {identical}"
                )
                rows.append(row)
    return rows


def cached_forward(model, ids, loop_budget, tokens=1):
    """A callable running one forward of the last `tokens` of `ids` (batch, seq) at `loop_budget` on a cache filled
    with the rest, then cropping the cache back: every call computes the same step."""
    with torch.no_grad():
        out = model(ids, loop_budget=loop_budget, use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values

    def go():
        with torch.no_grad():
            model(ids[:, -tokens:], cache=cache, loop_budget=loop_budget)
        cache.crop(-tokens)

    return go


def products_ratio(model, rows, base_rows, repeats, calls=30):
    """CPU time of one block's matrix products (its Linear modules as a decode step runs them, one token a row; not
    adaLN's, computed once per trajectory) over `rows` rows against `base_rows` rows: the least a step over `rows`
    rows can cost, as a share of one over `base_rows`, where the products dominate. A kernel property of this
    machine, measured with the model's own weights."""
    block = model.model.layers[0]
    linears = [m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear) and "adaLN" not in n]

    def products(n):
        inputs = [torch.randn(n, 1, m.in_features, dtype=m.weight.dtype) for m in linears]

        def go():
            with torch.no_grad():
                for _ in range(calls):
                    for m, x in zip(linears, inputs):
                        m(x)

        return go

    times = interleaved({"rows": products(rows), "base": products(base_rows)}, repeats, clock=time.process_time)
    return paired_ratio(times, "rows", "base")


def step_costs(model, prompt, budget, drafts, assistant_tokens, repeats, calls=30):
    """Milliseconds (CPU time) of one forward on a filled cache: a token at each draft budget d and at `budget`, and
    the n + 1 tokens a verification at `budget` reads for each draft length n: where the speed-up's cost goes."""

    def forward_ms(loop_budget, tokens):
        go, runs = cached_forward(model, prompt[None], loop_budget, tokens), []
        for _ in range(repeats):
            start = time.process_time()
            for _ in range(calls):
                go()
            runs.append((time.process_time() - start) / calls * 1e3)
        return med(runs)

    costs = {f"forward_M{m}_1_token_ms": forward_ms(m, 1) for m in sorted({*drafts, budget})}
    costs.update({f"verify_M{budget}_{n + 1}_tokens_ms": forward_ms(budget, n + 1) for n in assistant_tokens})
    # a verification's rows are its n + 1 tokens: what its products cost against one token's
    costs.update({f"products_{n + 1}_rows_over_1": products_ratio(model, n + 1, 1, repeats) for n in assistant_tokens})
    return costs


def mixed(model, batch, new_tokens, budget, repeats, log, prefill_tokens=128):
    """Rows [1, L, 1, L, ...] against all rows at L, and the ideal from the measured cost of a decode step over B/2
    rows against B rows (a mixed step computes B rows at step 1 and B/2 at the others). The same for one forward over
    a `prefill_tokens` prompt, where a step's cost follows its rows (a decode step reads every weight once, whatever
    its rows)."""
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (batch, 8), generator=torch.Generator().manual_seed(1))
    budgets = torch.tensor([1 if b % 2 == 0 else budget for b in range(batch)])
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        mixed_out = model.generate(prompt, loop_budget=budgets, **kw)
        all_out = model.generate(prompt, loop_budget=budget, **kw)
        one_out = model.generate(prompt, loop_budget=1, **kw)
    exact = all(torch.equal(mixed_out[b], (one_out if budgets[b] == 1 else all_out)[b]) for b in range(batch))

    def run(**knobs):
        def go():
            with torch.no_grad():
                model.generate(prompt, **kw, **knobs)

        return go

    long_prompt = torch.randint(3, vocab, (batch, prefill_tokens), generator=torch.Generator().manual_seed(2))

    by_budget = budgets.sort(descending=True, stable=True).values  # sorted, as generate sorts a call's rows

    def prefill(rows, loop_budget):
        def go():
            with torch.no_grad():
                model(long_prompt[:rows], loop_budget=loop_budget, use_cache=False)

        return go

    times = interleaved(
        {
            "all_L": run(loop_budget=budget),
            "mixed": run(loop_budget=budgets),
            "step_B": cached_forward(model, prompt, budget),
            "step_half": cached_forward(model, prompt[: batch // 2], budget),
            "prefill_all_L": prefill(batch, budget),
            "prefill_mixed": prefill(batch, by_budget),
            "prefill_half": prefill(batch // 2, budget),
        },
        repeats,
        clock=time.process_time,
    )
    half_over_full = paired_ratio(times, "step_half", "step_B")
    ideal = budget / (1 + (budget - 1) * half_over_full)
    products_half = products_ratio(model, batch // 2, batch, repeats)
    products_ideal = budget / (1 + (budget - 1) * products_half)  # the cap if a step were its products alone
    ratio = paired_ratio(times, "all_L", "mixed")
    prefill_half = paired_ratio(times, "prefill_half", "prefill_all_L")
    prefill_ideal = budget / (1 + (budget - 1) * prefill_half)
    prefill_ratio = paired_ratio(times, "prefill_all_L", "prefill_mixed")
    row = dict(
        batch=batch,
        budget=budget,
        mixed_over_all_L_throughput=ratio,
        ideal=ideal,
        share_of_ideal=ratio / ideal,
        step_half_over_full=half_over_full,
        products_half_over_full=products_half,
        products_ideal=products_ideal,
        all_L_tokens_per_s=batch * new_tokens / med(times["all_L"]),
        mixed_tokens_per_s=batch * new_tokens / med(times["mixed"]),
        each_row_equals_its_budget=exact,
        prefill_tokens=prefill_tokens,
        prefill_mixed_over_all_L=prefill_ratio,
        prefill_ideal=prefill_ideal,
        prefill_half_over_full=prefill_half,
    )
    log(
        f"  batch {batch}: mixed/all-L throughput {ratio:.2f}x (ideal {ideal:.2f}x from a step over B/2 rows costing "
        f"{half_over_full:.2f} of B rows: {ratio / ideal:.0%} of it; a block's matrix products over B/2 rows cost "
        f"{products_half:.2f} of B rows, a cap of {products_ideal:.2f}x), rows exact {exact}; prefill of "
        f"{prefill_tokens} tokens {prefill_ratio:.2f}x (ideal {prefill_ideal:.2f}x, B/2 rows costing "
        f"{prefill_half:.2f} of B)"
    )
    return row


def format_table(report):
    lines = [
        f"model {report['model']} (hidden {report['hidden_size']}), L={report['loops']}, {report['new_tokens']} new "
        f"tokens, {report['machine']}"
    ]
    if report["speculative"]:
        lines += [
            "",
            "| d | num_assistant_tokens | schedule | confidence threshold | speed-up | tokens/s plain -> drafted "
            "| acceptance | identical |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in report["speculative"]:
            lines.append(
                f"| {r['d']} | {r['num_assistant_tokens']} | {r.get('num_assistant_tokens_schedule', 'constant')} | "
                f"{r['assistant_confidence_threshold']} | "
                f"{r['speedup']:.2f}x | {r['plain_tokens_per_s']:.1f} -> "
                f"{r['drafted_tokens_per_s']:.1f} | {r['acceptance']:.2f} | {r['identical_greedy_tokens']} |"
            )
    if report.get("step_costs"):
        lines += [
            "",
            "one forward on a filled cache (ms), and a block's matrix products over n + 1 rows against one (share): "
            + ", ".join(f"{k} {v:.2f}" for k, v in report["step_costs"].items()),
        ]
    if report["mixed"]:
        lines += [
            "",
            "| batch | decode: mixed / all-L throughput | ideal | share of ideal | cap of the products alone | rows "
            "exact | prefill: mixed / all-L | ideal |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in report["mixed"]:
            lines.append(
                f"| {r['batch']} | {r['mixed_over_all_L_throughput']:.2f}x | {r['ideal']:.2f}x | "
                f"{r['share_of_ideal']:.0%} | {r['products_ideal']:.2f}x | {r['each_row_equals_its_budget']} | "
                f"{r['prefill_mixed_over_all_L']:.2f}x | {r['prefill_ideal']:.2f}x |"
            )
    return "\n".join(lines)


def main(argv=None):
    p = timing_arguments(__doc__, DEFAULT_OUTPUT, "timing rounds per side (default 5; --quick 2)")
    p.add_argument("--model", default="random", help="a saved folder, or: " + ", ".join(SHAPES))
    p.add_argument("--loops", type=int, default=4, help="L of a built model (default 4)")
    p.add_argument("--hidden_size", type=int, default=None, help="width of a built model (default: its shape's)")
    p.add_argument("--prompts", default="random", choices=["random", "chains", "shakespeare"])
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--drafts", type=int, nargs="*", default=None, help="draft budgets d (default 1..L-1)")
    p.add_argument("--num_assistant_tokens", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument(
        "--confidence",
        type=float,
        nargs="*",
        default=[0.0],
        help="assistant_confidence_threshold values: a draft ends after a token its own probability puts below it",
    )
    p.add_argument(
        "--schedules",
        nargs="*",
        default=["constant"],
        choices=["constant", "heuristic"],
        help="num_assistant_tokens_schedule values (heuristic: +2 after a fully accepted draft, -1 otherwise)",
    )
    p.add_argument("--num_prompts", type=int, default=1, help="prompts decoded one after another per side")
    p.add_argument("--mixed_batches", type=int, nargs="*", default=[8, 32])
    p.add_argument("--prefill_tokens", type=int, default=128, help="prompt of the mixed prefill (default 128)")
    p.add_argument("--skip", choices=["speculative", "mixed"], default=None)
    args = p.parse_args(argv)
    for name, value in (
        ("--new_tokens", args.new_tokens),
        ("--loops", args.loops),
        ("--num_prompts", args.num_prompts),
        ("--prefill_tokens", args.prefill_tokens),
    ):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    if any(b < 2 or b % 2 for b in args.mixed_batches):
        p.error(f"--mixed_batches are even batch sizes >= 2 (half the rows at M=1), got {args.mixed_batches}")
    if any(not 0 <= c <= 1 for c in args.confidence):
        p.error(f"--confidence values are probabilities in [0, 1], got {args.confidence}")
    if not os.path.isdir(args.model) and args.model not in SHAPES:
        p.error(f"--model must be a saved LoopFormer folder or one of {sorted(SHAPES)}, got {args.model!r}")
    torch.set_num_threads(args.threads)
    name = "quick" if args.quick else args.model
    model, tokenizer = build(name, args.loops, hidden_size=args.hidden_size)
    budget = model.config.num_loops
    drafts = args.drafts or list(range(1, budget))
    bad = [d for d in drafts if not 1 <= d < budget]
    if bad:
        p.error(f"--drafts must lie in 1..{budget - 1} (below L={budget}), got {bad}")
    repeats = args.repeats or (2 if args.quick else 5)
    new_tokens = 8 if args.quick else args.new_tokens
    log = lambda line: print(line, flush=True)  # noqa: E731
    start = time.time()
    report = dict(
        model=args.model,
        hidden_size=model.config.hidden_size,
        loops=budget,
        new_tokens=new_tokens,
        threads=args.threads,
        repeats=repeats,
        machine=f"{os.cpu_count()}-core CPU, {args.threads} thread(s), CPU time",
        command="python -m benchmarks.bench_self_speculative " + " ".join(argv if argv is not None else sys.argv[1:]),
        speculative=[],
        mixed=[],
    )
    if args.skip != "speculative":
        prompts = prompts_of(args.prompts, tokenizer, model.config.vocab_size, args.num_prompts, 16)
        log(f"self-speculative decoding, {args.model}, L={budget}:")
        report["speculative"] = speculative(
            model,
            prompts,
            new_tokens,
            budget,
            drafts,
            args.num_assistant_tokens,
            args.confidence,
            args.schedules,
            repeats,
            log,
        )
        report["step_costs"] = step_costs(model, prompts[0], budget, drafts, args.num_assistant_tokens, repeats)
        log("  one forward on a filled cache: " + ", ".join(f"{k} {v:.2f}" for k, v in report["step_costs"].items()))
    if args.skip != "mixed":
        log(f"mixed budgets [1, {budget}, 1, {budget}, ...] against all rows at {budget}:")
        report["mixed"] = [
            mixed(model, b, new_tokens, budget, repeats, log, 16 if args.quick else args.prefill_tokens)
            for b in args.mixed_batches
        ]
    report["wall_s"] = time.time() - start
    write_report(report, args.output, format_table(report))
    return report


if __name__ == "__main__":
    main()
