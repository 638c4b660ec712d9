"""Cached greedy decoding, eager against `torch.compile`d, at several loop budgets.

    python -m benchmarks.bench_compile [--budgets 4 1] [--backend inductor] [--output benchmarks/results/compile.json]
    python -m benchmarks.bench_compile --device cuda --mode reduce-overhead   # on an accelerator: CUDA graphs

Ways to decode the same prompt with the same weights, run interleaved (a round runs each once, in rotated order)
after a warm-up that compiles, medians over `--repeats` rounds:

- eager, dynamic cache (a `LoopFormerCache`);
- eager, static cache (`cache_implementation="static"`, a `LoopFormerStaticCache`);
- compiled, static cache: `model.forward = torch.compile(model.forward, fullgraph=True)` (the decode steps compiled,
  one graph per trajectory; generate runs the prefill eager, as transformers' own compiled generation does);
- compiled, dynamic cache: a second compiled copy with generate's default cache (one decode graph per trajectory:
  generate marks the cached lengths dynamic). Dynamo keeps at most
  `torch._dynamo.config.recompile_limit` (8) graphs per code object, shared by every copy of the model, so each copy
  is compiled with `isolate_recompiles=True` where torch has it (2.13), else the limit is raised for this run;
- on CUDA, also generate's own compilation: `cache_implementation="static"` alone, where transformers compiles the
  decode steps with its default `CompileConfig` (inductor, mode "reduce-overhead", i.e. CUDA graphs).
The first four pass `disable_compile=True`, so on CUDA transformers does not compile them behind our back.

Tokens/s counts the new tokens over the whole `generate` call (prefill of the prompt included). Every side's tokens
are checked against the others'. Recompiles are counted with `torch._dynamo.utils.counters` ("unique_graphs").
"""

import argparse
import copy
import inspect
import statistics
import time

import torch
import torch._dynamo

import loopformer_hf
from benchmarks import write_json


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
    return loopformer_hf.LoopFormerForCausalLM(cfg).eval()


def compiled_copy(model, backend="inductor", mode=None):
    """A copy of `model` whose forward is `torch.compile`d with fullgraph=True (generate compiles its decode steps)."""
    compiled = copy.deepcopy(model)
    own = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
    if not own:  # older torch: one limit for the forward of both compiled copies
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    compiled.forward = torch.compile(compiled.forward, backend=backend, mode=mode, fullgraph=True, **own)
    return compiled


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 1])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--output", default="benchmarks/results/compile.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    eager = tiny_random_model(args.hidden_size).to(args.device)
    compiled = compiled_copy(eager, args.backend, args.mode)
    prompt = torch.randint(3, 512, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)).to(args.device)
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sides = {
        "eager dynamic": (eager, {"disable_compile": True}),
        "eager static": (eager, {"cache_implementation": "static", "disable_compile": True}),
        "compiled static": (compiled, {"cache_implementation": "static", "disable_compile": True}),
        "compiled dynamic": (compiled_copy(eager, args.backend, args.mode), {"disable_compile": True}),
    }
    if prompt.is_cuda:
        sides["generate compile"] = (copy.deepcopy(eager), {"cache_implementation": "static"})

    def run(name, budget):
        model, kw = sides[name]
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                prompt,
                loop_budget=budget,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                **kw,
            )
        sync()
        return args.new_tokens / (time.perf_counter() - start), out

    torch._dynamo.utils.counters.clear()
    results = {}
    for budget in args.budgets:
        start = time.perf_counter()
        _, first = run("compiled static", budget)  # compiles
        warmup = time.perf_counter() - start
        if "generate compile" in sides:
            run("generate compile", budget)
        tokens = {name: run(name, budget)[1] for name in sides}  # warm every side
        same = all(torch.equal(t, first) for t in tokens.values())
        speeds = {name: [] for name in sides}
        names = list(sides)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                speeds[name].append(run(name, budget)[0])
        results[f"M={budget}"] = {
            "tokens_per_s": {name: statistics.median(v) for name, v in speeds.items()},
            "tokens_per_s_spread": {name: [min(v), max(v)] for name, v in speeds.items()},
            "compiled_over_eager_static": statistics.median(
                c / e for c, e in zip(speeds["compiled static"], speeds["eager static"])
            ),
            "compiled_over_eager_dynamic": statistics.median(
                c / e for c, e in zip(speeds["compiled static"], speeds["eager dynamic"])
            ),
            "compiled_dynamic_over_eager_dynamic": statistics.median(
                c / e for c, e in zip(speeds["compiled dynamic"], speeds["eager dynamic"])
            ),
            **(
                {
                    "generate_compile_over_eager_dynamic": statistics.median(
                        c / e for c, e in zip(speeds["generate compile"], speeds["eager dynamic"])
                    )
                }
                if "generate compile" in speeds
                else {}
            ),
            "same_tokens": same,
            "first_call_s": warmup,
        }
    # "stats" counts the frames dynamo compiled ("unique_graphs"), i.e. the (re)compiles
    frames = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if k in ("stats", "frames", "recompiles")}
    report = {
        "config": vars(args),
        "results": results,
        "dynamo_frames": frames,
        "device": torch.cuda.get_device_name(0) if prompt.is_cuda else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }

    names = list(sides)
    print(
        f"{'budget':>7} | "
        + " | ".join(f"{n:>16}" for n in names)
        + " | compiled/eager dyn | same tokens | first call"
    )
    for key, r in results.items():
        t = r["tokens_per_s"]
        print(
            f"{key:>7} | "
            + " | ".join(f"{t[n]:16.1f}" for n in names)
            + f" | {r['compiled_over_eager_dynamic']:17.2f}x | {str(r['same_tokens']):>11} | {r['first_call_s']:.0f} s"
        )
    print(f"tokens/s ({args.backend}, medians of {args.repeats} interleaved rounds); dynamo frames: {frames}")
    if args.output:
        write_json(args.output, report)
    return report


if __name__ == "__main__":
    main()
