"""Throughput of LoopFormer served by vLLM against batched `generate`, side by side in one run.

    .venv-vllm/bin/python -m benchmarks.bench_vllm [--prompts 64] [--new_tokens 64] [--output benchmarks/results/bench_vllm.json]

(the environment scripts/test_vllm.sh builds). One random LoopFormer (opened adaLN gates; hidden 256, 4 heads, k = 2
blocks, L = 4 loops; `--hidden_size` for a wider one) decodes `--prompts` prompts of 8..32 tokens, `--new_tokens`
new tokens each, greedy, no EOS, at
M = 1 and M = L, three ways:

- `generate`, dynamic cache: one left-padded batch of every prompt (a `LoopFormerCache`);
- `generate`, static cache + `torch.compile(model.forward, fullgraph=True)`, the batch as above
  (benchmarks/bench_compile.py's recipe; its set-up is the first call, which compiles);
- vLLM offline (`LLM.generate`, continuous batching, paged attention, one cache per (loop step, block)), a fresh
  process per budget (the budget is fixed per server); set-up is `LLM(...)` construction.

Every side runs on the same `--threads` cores (vLLM: VLLM_CPU_OMP_THREADS_BIND). Tokens/s = all new tokens / wall
time of the timed call (prefill included), median of `--repeats` calls after one warm-up call. The greedy tokens
of the three sides are compared (`same_tokens`).

Then per-request budgets in one vLLM engine (server budget L, `max_request_loop_budget` L): the same prompts all at
M = L, mixed (every other prompt asks `extra_args={"loop_budget": 1}`, the rest run the server's L) and all at M = 1
by request, timed in turn in one process (`--repeats` rounds after a warm-up of each). Each request's tokens are
compared with `generate`'s at its budget (`exact`); `over_all_at_L` (the median of the per-round ratios) is the ratio
that matters: a mixed batch should cost the budgets it asks (1 and L: (1 + L) / 2L of the loop steps), not its
largest. The default width (256) is bound by per-step overheads at batch 64; `--hidden_size 1024` makes the loop
steps' compute the cost, which is what a budget saves.

`--speculative --checkpoint DIR`: vLLM's speculative decoding with the same weights at a shallow budget as the draft
(`speculative_config={"method": "draft_model", "model": <DIR at loop_budget d>}`: vLLM loads the draft as a second
model, so the draft is a second folder, `loopformer_hf.vllm_plugin.write_draft_checkpoint`'s: the checkpoint's files
linked, its generation_config.json at `loop_budget=d`; a second copy of the weights in memory). For each d in `--drafts` and n in
`--num_speculative_tokens`: tokens/s against the same engine without a draft at the checkpoint's full budget L, the
acceptance (vLLM's spec-decode counters: accepted / drafted tokens), and every request's tokens against `generate`'s
at L (`exact`). Prompts: `--prompts` windows of Shakespeare's text through the checkpoint's tokenizer.
"""

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks import write_json


def build_model(path, num_loops=4, seed=0, hidden_size=256):
    import loopformer_hf

    torch.manual_seed(seed)
    config = loopformer_hf.LoopFormerConfig(
        vocab_size=512,
        hidden_size=hidden_size,
        num_attention_heads=hidden_size // 64,  # head_dim 64 (vLLM's CPU attention)
        intermediate_size=4 * hidden_size,
        num_hidden_layers=2,
        num_loops=num_loops,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=None,
    )
    model = loopformer_hf.LoopFormerForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # open the adaLN gates: every loop step then changes the state
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (0.5 if name.endswith("bias") else 0.0))
    model.save_pretrained(path)
    return model


def make_prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 33, (n,), generator=g).tolist()
    return [torch.randint(1, 512, (length,), generator=g).tolist() for length in lengths]


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def bench_generate(model, prompts, budget, new_tokens, repeats, **kwargs):
    """(set-up s = the warm-up call, tokens/s per timed call, new tokens per prompt)."""
    ids, mask = left_padded(prompts)

    def call():
        started = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            loop_budget=budget,
            pad_token_id=0,
            **kwargs,
        )
        return time.perf_counter() - started, out[:, ids.shape[1] :].tolist()

    setup, tokens = call()
    speeds = [len(prompts) * new_tokens / call()[0] for _ in range(repeats)]
    return setup, speeds, tokens


def vllm_side(spec_path, out_path):
    """In its own process: build one LLM for the spec's budget, time `LLM.generate` on every prompt."""
    spec = json.load(open(spec_path))
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    draft = spec.get("draft")  # {"model": a folder, "num_speculative_tokens": n}
    llm = LLM(
        model=spec["checkpoint"],
        dtype="float32",
        max_model_len=spec.get("max_model_len", 256),
        enforce_eager=spec["enforce_eager"],
        skip_tokenizer_init=True,
        distributed_executor_backend="uni",
        seed=0,
        hf_overrides={"loop_budget": spec["budget"], "step_schedule": "uniform"},
        speculative_config=None if draft is None else {"method": "draft_model", **draft},
        disable_log_stats=draft is None,  # the spec-decode counters need the stat loggers
    )
    setup = time.perf_counter() - started
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def params(budget):  # None: the server's budget
        return SamplingParams(
            temperature=0.0,
            max_tokens=spec["new_tokens"],
            ignore_eos=True,
            extra_args=None if budget is None else {"loop_budget": budget},
        )

    def call(budgets):
        started, cpu_started = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, [params(b) for b in budgets], use_tqdm=False)
        # CPU time too: on a shared machine the wall time of one call moves with the other jobs' load
        return (
            time.perf_counter() - started,
            time.process_time() - cpu_started,
            [list(o.outputs[0].token_ids) for o in outs],
        )

    # workload -> the budget each prompt asks for
    workloads = spec.get("workloads") or {"server": [None] * len(prompts)}
    for budgets in workloads.values():
        call(budgets)  # warm-up
    timed = {name: [] for name in workloads}
    for _ in range(spec["repeats"]):  # in turn, so that a slow spell of this shared machine hits every workload
        for name, budgets in workloads.items():
            timed[name].append(call(budgets))
    new_tokens = len(prompts) * spec["new_tokens"]
    counters = (
        {}
        if draft is None
        else {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec")}
    )
    json.dump(
        {
            "setup_s": setup,
            "spec_decode": {
                name.removeprefix("vllm:spec_decode_"): value
                for name, value in counters.items()
                if isinstance(value, (int, float))
            },
            "workloads": {
                name: {
                    "tokens_per_s": [new_tokens / wall for wall, _, _ in runs],
                    "tokens_per_cpu_s": [new_tokens / cpu for _, cpu, _ in runs],
                    "tokens": runs[-1][2],
                }
                for name, runs in timed.items()
            },
        },
        open(out_path, "w"),
    )


def run_vllm(checkpoint, prompts, budget, args, workdir, workloads=None, name=None, **extra):
    spec = {
        **extra,
        "checkpoint": checkpoint,
        "prompts": prompts,
        "budget": budget,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "enforce_eager": not args.vllm_compile,
        "workloads": workloads,
    }
    name = name or str(budget)
    spec_path, out_path = os.path.join(workdir, f"spec{name}.json"), os.path.join(workdir, f"out{name}.json")
    json.dump(spec, open(spec_path, "w"))
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    }
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_vllm", "--vllm_side", spec_path, out_path],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"vLLM side failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.load(open(out_path))
    result["process_s"] = time.perf_counter() - started  # with the import of vllm and the process start
    return result


def bench_per_request(checkpoint, prompts, generated, args, workdir):
    """All at L, mixed 1 / L, all at 1 (by request) in one engine; each request's tokens against `generate`'s."""
    top = args.num_loops
    workloads = {
        "all at L": [None] * len(prompts),
        "mixed 1 / L": [1 if i % 2 == 0 else None for i in range(len(prompts))],
        "all at 1 (per request)": [1] * len(prompts),
    }
    served = run_vllm(checkpoint, prompts, top, args, workdir, workloads, name="per_request")
    rows = {"setup_s": served["setup_s"], "process_s": served["process_s"]}
    print(f"per-request budgets, one engine (server M={top})")
    for name, budgets in workloads.items():
        out = served["workloads"][name]
        exact = all(
            tokens == generated[budget or top][i] for i, (budget, tokens) in enumerate(zip(budgets, out["tokens"]))
        )
        row = rows[name] = {"exact": exact}
        for key in ("tokens_per_s", "tokens_per_cpu_s"):
            row[key] = statistics.median(out[key])
            # the median of the per-round ratios: each round times the workloads back to back, so a slow spell of
            # the machine hits both sides of a ratio
            row[f"{key}_over_all_at_L"] = statistics.median(
                mine / theirs for mine, theirs in zip(out[key], served["workloads"]["all at L"][key])
            )
            row[f"runs_{key}"] = out[key]
        print(
            f"  {name:>24}: {row['tokens_per_s']:8.1f} tok/s ({row['tokens_per_s_over_all_at_L']:5.2f}x all at L)"
            f"  {row['tokens_per_cpu_s']:8.1f} tok/CPU-s ({row['tokens_per_cpu_s_over_all_at_L']:5.2f}x)"
            f"  every request exact {exact}"
        )
    return rows


def bench_speculative(args, workdir):
    """Speculative decoding in vLLM with the checkpoint at budget d drafting for itself at its full budget L."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.bench_self_speculative import prompts_of
    from loopformer_hf.vllm_plugin import write_draft_checkpoint

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    top = model.config.num_loops
    prompts = prompts_of("shakespeare", tokenizer, None, args.prompts, args.prompt_tokens).tolist()
    with torch.no_grad():
        _, _, reference = bench_generate(model, prompts, top, args.new_tokens, 0)
    max_model_len = args.prompt_tokens + args.new_tokens
    plain = run_vllm(args.checkpoint, prompts, top, args, workdir, name="plain", max_model_len=max_model_len)
    plain_speeds = plain["workloads"]["server"]["tokens_per_s"]
    rows = [
        {
            "d": None,
            "tokens_per_s": statistics.median(plain_speeds),
            "exact": plain["workloads"]["server"]["tokens"] == reference,
        }
    ]
    print(f"vLLM at M={top}, no draft: {rows[0]['tokens_per_s']:.1f} tok/s, exact {rows[0]['exact']}")
    for d in args.drafts or range(1, top):
        folder = write_draft_checkpoint(args.checkpoint, os.path.join(workdir, f"draft_at_{d}"), d)
        for n in args.num_speculative_tokens:
            draft = {"model": folder, "num_speculative_tokens": n}
            served = run_vllm(
                args.checkpoint,
                prompts,
                top,
                args,
                workdir,
                name=f"d{d}n{n}",
                max_model_len=max_model_len,
                draft=draft,
            )
            out, counters = served["workloads"]["server"], served["spec_decode"]
            drafted, accepted = counters.get("num_draft_tokens", 0), counters.get("num_accepted_tokens", 0)
            row = {
                "d": d,
                "num_speculative_tokens": n,
                "tokens_per_s": statistics.median(out["tokens_per_s"]),
                "exact": out["tokens"] == reference,
                "acceptance": accepted / drafted if drafted else None,
                "drafted": drafted,
                "accepted": accepted,
                "setup_s": served["setup_s"],
            }
            # each side in its own engine and process, timed in turn round by round is not possible: the ratio is of
            # the medians
            row["over_no_draft"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
            rows.append(row)
            print(
                f"  d={d} n={n}: {row['tokens_per_s']:.1f} tok/s ({row['over_no_draft']:.2f}x), acceptance "
                f"{row['acceptance'] or 0:.2f}, exact {row['exact']}"
            )
    return {"checkpoint": args.checkpoint, "loops": top, "prompts": args.prompts, "rows": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--num_loops", type=int, default=4)
    parser.add_argument("--hidden_size", type=int, default=256, help="width of the random LoopFormer (head_dim 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm_compile", action="store_true", help="let vLLM compile (no enforce_eager)")
    parser.add_argument("--skip_compile", action="store_true", help="leave out the static cache + compile side")
    parser.add_argument(
        "--per_request_only",
        action="store_true",
        help="only the per-request budgets in one engine (and generate's tokens to check them)",
    )
    parser.add_argument("--speculative", action="store_true", help="vLLM's draft_model speculative decoding (below)")
    parser.add_argument("--checkpoint", default=None, help="with --speculative: a trained LoopFormer folder")
    parser.add_argument("--drafts", type=int, nargs="*", default=None, help="draft budgets d (default 1..L-1)")
    parser.add_argument("--num_speculative_tokens", type=int, nargs="*", default=[4])
    parser.add_argument("--prompt_tokens", type=int, default=16, help="with --speculative: tokens per prompt")
    parser.add_argument("--vllm_side", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--output", default="benchmarks/results/bench_vllm.json")
    args = parser.parse_args(argv)
    if args.vllm_side:
        return vllm_side(*args.vllm_side)
    if args.speculative and (args.checkpoint is None or not os.path.isdir(args.checkpoint)):
        parser.error(f"--speculative needs --checkpoint, a trained LoopFormer folder; got {args.checkpoint!r}")
    torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="bench_vllm_")
    if args.speculative:
        results = bench_speculative(args, workdir)
        write_json(args.output, results)
        print(f"wrote {args.output}")
        return results
    checkpoint = os.path.join(workdir, "loopformer")
    model = build_model(checkpoint, args.num_loops, hidden_size=args.hidden_size)
    prompts = make_prompts(args.prompts)
    results = {
        "config": {
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "num_loops": args.num_loops,
            "threads": args.threads,
            "repeats": args.repeats,
            "hidden_size": args.hidden_size,
            "blocks": 2,
            "vllm_enforce_eager": not args.vllm_compile,
            "torch": torch.__version__,
        },
        "budgets": {},
    }
    generated = {}  # budget -> generate's tokens per prompt
    for budget in (1, args.num_loops):
        setup, speeds, tokens = bench_generate(
            model, prompts, budget, args.new_tokens, 0 if args.per_request_only else args.repeats
        )
        reference = generated[budget] = tokens
        if args.per_request_only:
            continue
        row = {"generate dynamic": {"setup_s": setup, "tokens_per_s": statistics.median(speeds)}}
        if not args.skip_compile:
            compiled = copy.deepcopy(model)
            compiled.forward = torch.compile(compiled.forward, fullgraph=True)
            setup, speeds, tokens = bench_generate(
                compiled,
                prompts,
                budget,
                args.new_tokens,
                args.repeats,
                cache_implementation="static",
                disable_compile=True,
            )
            row["generate static+compile"] = {
                "setup_s": setup,
                "tokens_per_s": statistics.median(speeds),
                "same_tokens": tokens == reference,
            }
        served = run_vllm(checkpoint, prompts, budget, args, workdir)
        row["vllm offline"] = {
            "setup_s": served["setup_s"],
            "process_s": served["process_s"],
            "tokens_per_s": statistics.median(served["workloads"]["server"]["tokens_per_s"]),
            "same_tokens": served["workloads"]["server"]["tokens"] == reference,
        }
        base = row["generate dynamic"]["tokens_per_s"]
        for side in row.values():
            side["over_generate_dynamic"] = side["tokens_per_s"] / base
        results["budgets"][str(budget)] = row
        print(f"M={budget}")
        for name, side in row.items():
            print(
                f"  {name:>24}: {side['tokens_per_s']:8.1f} tok/s  {side['over_generate_dynamic']:5.2f}x  "
                f"set-up {side['setup_s']:6.1f} s  same tokens {side.get('same_tokens', True)}"
            )
    results["per_request"] = bench_per_request(checkpoint, prompts, generated, args, workdir)
    import vllm  # noqa: F401  (only for its version)

    results["config"]["vllm"] = vllm.__version__
    write_json(args.output, results)
    print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
