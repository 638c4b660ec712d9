"""LoopFormer speed on CPU: training step and cached generation vs an iso-FLOP Llama, KV-cache speed-up, and how
generation time scales with the loop budget M. One command; prints a table and writes JSON.

    .venv/bin/python -m benchmarks.bench_loopformer                      # full run (tens of minutes on 2 cores)
    .venv/bin/python -m benchmarks.bench_loopformer --quick --output /tmp/loopformer_quick.json   # smoke run
    .venv/bin/python -m benchmarks.bench_loopformer --against 8070f4b     # decode speed: that commit against this tree

Models (small config: hidden 256, 4 heads, vocab 512, fp32, sdpa attention):

- LoopFormer k⊗L = 2⊗4 with `hidden_act="swiglu"` (3-matrix gated MLP, width 1024) and RoPE, so that each of its
  k·L block applications does exactly the matmuls of one Llama decoder layer; the only differences left are the
  looping and the adaLN modulation (plus the t/Δ embedders). The reference model's GELU MLP / learned positions are
  not used here: they would change FLOPs and position costs, not the loop machinery being measured.
- `transformers.LlamaForCausalLM` with k·L = 8 layers of the same hidden / intermediate size / heads, tied
  embeddings: the iso-FLOP unlooped baseline.

Method: the two sides of every ratio run interleaved (A B, B A, ...) in the same process, after one warm-up
each; each ratio is the median over repeats of the per-repeat ratio (adjacent runs see the same machine load),
and the medians of the raw times are reported too. Greedy decoding with `min_new_tokens = max_new_tokens`, so both
sides produce exactly the same number of tokens. `torch.set_num_threads` is fixed (`--threads`).

`--against REV` measures only decoding, old against new in one process: the package at git revision REV (checked
out in a temporary `git worktree`, removed afterwards, imported under another module name) and this tree's
`loopformer_hf` build the same LoopFormer with the same weights (a state dict copy); their greedy tokens must be
identical, then cached greedy `generate` runs interleaved over `--repeats` rounds, timed in this process's CPU time
(`time.process_time`: steadier than wall time on a machine other jobs load).
"""

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import loopformer_hf

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO_ROOT, "benchmarks", "results", "loopformer.json")
DEFAULT_AGAINST_OUTPUT = os.path.join(REPO_ROOT, "benchmarks", "results", "loopformer_against.json")

FULL = dict(
    hidden=256,
    heads=4,
    intermediate=1024,
    vocab=512,
    k=2,
    loops=4,
    seq=256,
    batch=4,
    prompt=32,
    gen_short=256,
    gen_long=1024,
    gen_vs_llama=256,
    gen_budget=256,
    repeats=5,
    repeats_long=3,
    train_repeats=7,
)
QUICK = dict(
    hidden=64,
    heads=4,
    intermediate=256,
    vocab=512,
    k=2,
    loops=4,
    seq=64,
    batch=2,
    prompt=8,
    gen_short=16,
    gen_long=48,
    gen_vs_llama=16,
    gen_budget=16,
    repeats=2,
    repeats_long=2,
    train_repeats=2,
)

TARGETS = {  # name: (comparison, bound description)
    "train_step_loopformer_over_llama": "<= 1.15",
    "generate_tokens_per_s_loopformer_over_llama": ">= 0.85",
    "cached_over_uncached_speedup_short": ">= 3.0",
    "cached_over_uncached_speedup_long": "> short (gap widens)",
}


# ---- models --------------------------------------------------------------------------------------------------------


def build_loopformer(cfg, position_embedding, package=loopformer_hf, seed=0):
    """The benchmark's LoopFormer (2⊗4 SwiGLU at the full size), built with `package`'s classes: this tree's
    `loopformer_hf`, or another revision's (`--against`)."""
    torch.manual_seed(seed)
    config = package.LoopFormerConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        num_attention_heads=cfg["heads"],
        intermediate_size=cfg["intermediate"],
        hidden_act="swiglu",
        num_hidden_layers=cfg["k"],
        num_loops=cfg["loops"],
        position_embedding_type=position_embedding,
        max_position_embeddings=max_positions(cfg),
        tie_word_embeddings=True,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = package.LoopFormerForCausalLM(config)
    with torch.no_grad():  # adaLN starts small (or zero): give it trained-like random values
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name:
                p.normal_(0.0, 0.02) if name.endswith("weight") else p.fill_(0.5)
    return model


def max_positions(cfg):
    return max(2048, cfg["prompt"] + cfg["gen_long"] + 1, cfg["seq"])


def build_models(cfg, position_embedding, seed=0):
    loopformer = build_loopformer(cfg, position_embedding, seed=seed)
    max_pos = max_positions(cfg)
    llama_config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["k"] * cfg["loops"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"],
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    llama = LlamaForCausalLM(llama_config)
    return loopformer, llama


def count_params(model):
    return sum(p.numel() for p in model.parameters())


# ---- timing --------------------------------------------------------------------------------------------------------


def interleaved(fns, repeats, warmup=1, clock=time.perf_counter):
    """Run every callable `warmup` times, then `repeats` rounds in alternating order; seconds per call by name
    (`clock`: wall time, or e.g. `time.process_time`, this process's CPU time, on a machine others load)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            start = clock()
            fns[name]()
            times[name].append(clock() - start)
    return times


def paired_ratio(times, num, den):
    """Median of per-round ratios num/den (each round measured back to back)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def med(xs):
    return statistics.median(xs)


def train_step_fn(model, batch):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()

    return step


def generate_fn(model, prompt, new_tokens, use_cache=True, **kwargs):
    result = {}

    def run():
        with torch.inference_mode():
            result["tokens"] = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=use_cache,
                pad_token_id=0,
                **kwargs,
            )

    run.result = result
    return run


# ---- the benchmark ---------------------------------------------------------------------------------------------------


def run_benchmark(cfg, threads, position_embedding, log=print):
    torch.set_num_threads(threads)
    # uniform budgets such as M=3 of L=4 are off the 1/L grid: the model warns once; the timing does not care
    warnings.filterwarnings("ignore", message="LoopFormer trajectory")
    loopformer, llama = build_models(cfg, position_embedding)
    g = torch.Generator().manual_seed(1)
    results = {}

    # (i) training step, fp32
    log(f"[i] training step: batch {cfg['batch']} x seq {cfg['seq']}, {cfg['train_repeats']} rounds")
    loopformer.train()
    llama.train()
    batch = torch.randint(3, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    t = interleaved(
        {"loopformer": train_step_fn(loopformer, batch), "llama": train_step_fn(llama, batch)}, cfg["train_repeats"]
    )
    results["train_step"] = dict(
        loopformer_s=med(t["loopformer"]),
        llama_s=med(t["llama"]),
        ratio=paired_ratio(t, "loopformer", "llama"),
        times=t,
    )
    loopformer.eval()
    llama.eval()

    prompt = torch.randint(3, cfg["vocab"], (1, cfg["prompt"]), generator=g)

    # (ii-a) cached generate vs Llama
    n = cfg["gen_vs_llama"]
    log(f"[ii] cached generate vs Llama: {n} new tokens, {cfg['repeats']} rounds")
    t = interleaved(
        {"loopformer": generate_fn(loopformer, prompt, n), "llama": generate_fn(llama, prompt, n)}, cfg["repeats"]
    )
    results["generate_vs_llama"] = dict(
        new_tokens=n,
        loopformer_tokens_per_s=n / med(t["loopformer"]),
        llama_tokens_per_s=n / med(t["llama"]),
        ratio=paired_ratio(t, "llama", "loopformer"),  # tokens/s ratio = inverse time ratio
        times=t,
    )

    # (ii-b) cached vs uncached, short and long
    # The long pair skips its warm-up (the short pair has warmed the same code paths): one uncached run of 1024
    # tokens takes minutes on two cores.
    for label, n, repeats, warmup in (
        ("short", cfg["gen_short"], cfg["repeats"], 1),
        ("long", cfg["gen_long"], cfg["repeats_long"], 0),
    ):
        log(f"[ii] cached vs uncached generate: {n} new tokens, {repeats} rounds")
        cached, uncached = generate_fn(loopformer, prompt, n, True), generate_fn(loopformer, prompt, n, False)
        t = interleaved({"cached": cached, "uncached": uncached}, repeats, warmup=warmup)
        results[f"cached_vs_uncached_{label}"] = dict(
            new_tokens=n,
            cached_s=med(t["cached"]),
            uncached_s=med(t["uncached"]),
            speedup=paired_ratio(t, "uncached", "cached"),
            same_tokens=bool(torch.equal(cached.result["tokens"], uncached.result["tokens"])),
            times=t,
        )

    # (iii) generate time at budget M over time at L
    n, L = cfg["gen_budget"], cfg["loops"]
    log(f"[iii] cached generate at budget M = 1..{L}: {n} new tokens, {cfg['repeats']} rounds")
    fns = {M: generate_fn(loopformer, prompt, n, loop_budget=M) for M in range(1, L + 1)}
    t = interleaved(fns, cfg["repeats"])
    results["budget_scaling"] = {
        str(M): dict(time_s=med(t[M]), ratio=paired_ratio(t, M, L), bound=M / L + 0.1) for M in range(1, L + 1)
    }
    # supplementary: the same for one forward pass over a full sequence (model compute without generate's loop)
    log(f"[iii'] forward over seq {cfg['seq']} at budget M = 1..{L}")
    seq = batch[:1]

    def forward_fn(M):
        def run():
            with torch.inference_mode():
                loopformer(seq, loop_budget=M, use_cache=False)

        return run

    t = interleaved({M: forward_fn(M) for M in range(1, L + 1)}, cfg["repeats"])
    results["budget_scaling_forward"] = {
        str(M): dict(time_s=med(t[M]), ratio=paired_ratio(t, M, L), bound=M / L + 0.1) for M in range(1, L + 1)
    }

    ratios = {
        "train_step_loopformer_over_llama": results["train_step"]["ratio"],
        "generate_tokens_per_s_loopformer_over_llama": results["generate_vs_llama"]["ratio"],
        "cached_over_uncached_speedup_short": results["cached_vs_uncached_short"]["speedup"],
        "cached_over_uncached_speedup_long": results["cached_vs_uncached_long"]["speedup"],
    }
    for M in range(1, L + 1):
        ratios[f"generate_time_budget_{M}_over_{L}"] = results["budget_scaling"][str(M)]["ratio"]
    met = {
        "train_step_loopformer_over_llama": ratios["train_step_loopformer_over_llama"] <= 1.15,
        "generate_tokens_per_s_loopformer_over_llama": ratios["generate_tokens_per_s_loopformer_over_llama"] >= 0.85,
        "cached_over_uncached_speedup_short": ratios["cached_over_uncached_speedup_short"] >= 3.0,
        "cached_over_uncached_speedup_long": ratios["cached_over_uncached_speedup_long"]
        > ratios["cached_over_uncached_speedup_short"],
    }
    targets = dict(TARGETS)
    for M in range(1, L + 1):
        key = f"generate_time_budget_{M}_over_{L}"
        targets[key] = f"<= {M / L + 0.1:.3f}"
        met[key] = ratios[key] <= M / L + 0.1
    return dict(
        ratios=ratios,
        targets=targets,
        met=met,
        results=results,
        models=dict(loopformer_params=count_params(loopformer), llama_params=count_params(llama)),
    )


def format_table(report):
    cfg, res, ratios, targets, met = (
        report["config"],
        report["results"],
        report["ratios"],
        report["targets"],
        report["met"],
    )
    L = cfg["loops"]
    rows = [("measurement", "LoopFormer", "baseline", "ratio", "target", "met")]
    tr = res["train_step"]
    rows.append(
        (
            f"train step (b{cfg['batch']}x{cfg['seq']}) s, vs Llama {cfg['k'] * L}L",
            f"{tr['loopformer_s']:.4f}",
            f"{tr['llama_s']:.4f}",
        )
    )
    gl = res["generate_vs_llama"]
    rows.append(
        (
            f"cached generate {gl['new_tokens']} tok/s, vs Llama",
            f"{gl['loopformer_tokens_per_s']:.1f}",
            f"{gl['llama_tokens_per_s']:.1f}",
        )
    )
    for label in ("short", "long"):
        c = res[f"cached_vs_uncached_{label}"]
        rows.append(
            (f"cached vs uncached, {c['new_tokens']} new tok (s)", f"{c['cached_s']:.3f}", f"{c['uncached_s']:.3f}")
        )
    for M in range(1, L + 1):
        b = res["budget_scaling"][str(M)]
        rows.append(
            (f"generate at M={M} vs M={L} (s)", f"{b['time_s']:.3f}", f"{res['budget_scaling'][str(L)]['time_s']:.3f}")
        )
    keys = list(ratios)
    table = [rows[0]] + [
        row + (f"{ratios[k]:.3f}", targets[k], "yes" if met[k] else "NO") for row, k in zip(rows[1:], keys)
    ]
    for M in range(1, L + 1):
        f = res["budget_scaling_forward"][str(M)]
        table.append(
            (
                f"(suppl.) forward seq {cfg['seq']} M={M} vs M={L} (s)",
                f"{f['time_s']:.4f}",
                f"{res['budget_scaling_forward'][str(L)]['time_s']:.4f}",
                f"{f['ratio']:.3f}",
                f"<= {f['bound']:.3f}",
                "yes" if f["ratio"] <= f["bound"] else "NO",
            )
        )
    widths = [max(len(str(r[i])) for r in table) for i in range(len(table[0]))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- --against REV: decode speed, another revision's package against this tree's ------------------------------------


def git(*args):
    return subprocess.run(["git", "-C", REPO_ROOT, *args], check=False, capture_output=True, text=True)


def resolve_revision(rev):
    """(commit, None) for a revision whose tree holds loopformer_hf, else (None, a one-line reason)."""
    if git("rev-parse", "--is-inside-work-tree").returncode != 0:
        return None, f"--against needs a git checkout; {REPO_ROOT} is not one"
    found = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if found.returncode != 0:
        return None, f"--against: unknown git revision {rev!r}"
    commit = found.stdout.strip()
    if git("cat-file", "-e", f"{commit}:loopformer_hf/__init__.py").returncode != 0:
        return None, f"--against: revision {rev!r} ({commit[:10]}) has no loopformer_hf/__init__.py"
    return commit, None


@contextlib.contextmanager
def package_at(commit):
    """`loopformer_hf` as it is at `commit`, imported as `loopformer_hf_at_<commit>` from a temporary git worktree
    (removed on exit). sys.modules["loopformer_hf"] stays this tree's; its import registers this tree's classes with
    the Auto classes again, after the old import registered the old ones."""
    tmp = tempfile.mkdtemp(prefix="loopformer_against_")
    tree = os.path.join(tmp, "tree")
    name = f"loopformer_hf_at_{commit[:10]}"
    try:
        added = git("worktree", "add", "--detach", "--quiet", tree, commit)
        if added.returncode != 0:
            raise RuntimeError(f"git worktree add {commit[:10]} failed: {added.stderr.strip()}")
        package_dir = os.path.join(tree, "loopformer_hf")
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        finally:
            importlib.reload(loopformer_hf)
        yield module
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        git("worktree", "remove", "--force", tree)
        shutil.rmtree(tmp, ignore_errors=True)
        git("worktree", "prune")


def decode_against(old, new, prompt, new_tokens, repeats, clock=time.process_time):
    """Greedy cached generate of `old` and `new` (the same weights): one run each, whose tokens must agree
    (AssertionError naming the first differing step otherwise), then `repeats` interleaved rounds."""
    fns = {"old": generate_fn(old, prompt, new_tokens), "new": generate_fn(new, prompt, new_tokens)}
    for fn in fns.values():  # the check run is the warm-up
        fn()
    a, b = fns["old"].result["tokens"], fns["new"].result["tokens"]
    if a.shape != b.shape or not torch.equal(a, b):
        differ = (a != b).any(0).nonzero() if a.shape == b.shape else None
        where = f"first at generated token {int(differ[0]) - prompt.shape[1]}" if differ is not None else "shapes"
        raise AssertionError(f"old and new decode differently ({where}): the comparison would time different work")
    times = interleaved(fns, repeats, warmup=0, clock=clock)
    n = prompt.shape[0] * new_tokens
    return dict(
        new_tokens=new_tokens,
        batch=prompt.shape[0],
        identical_tokens=True,
        tokens_per_s=dict(old=n / med(times["old"]), new=n / med(times["new"])),
        time_s=dict(old=med(times["old"]), new=med(times["new"])),
        ratio_new_over_old_time=paired_ratio(times, "new", "old"),
        times=times,
    )


def run_against(cfg, threads, position_embedding, commit, new_tokens, log=print):
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message="LoopFormer trajectory")
    with package_at(commit) as old_package:
        log(f"old: loopformer_hf at {commit[:10]} (module {old_package.__name__}); new: {loopformer_hf.__file__}")
        new = build_loopformer(cfg, position_embedding).eval()
        old = build_loopformer(cfg, position_embedding, package=old_package).eval()
        old.load_state_dict(new.state_dict())
        prompt = torch.randint(
            3, cfg["vocab"], (cfg["batch"], cfg["prompt"]), generator=torch.Generator().manual_seed(1)
        )
        log(f"greedy cached generate, batch {cfg['batch']} x {new_tokens} new tokens, {cfg['repeats']} rounds")
        result = decode_against(old, new, prompt, new_tokens, cfg["repeats"])
    return dict(result, loopformer_params=count_params(new))


def format_against(report):
    r = report["result"]
    rows = [
        (f"{side} ({report[side]})", f"{r['tokens_per_s'][side]:.1f}", f"{r['time_s'][side]:.3f}")
        for side in ("old", "new")
    ]
    lines = [f"{'':<{max(len(x[0]) for x in rows)}}   tokens/s   CPU s per generate"]
    lines += [f"{a:<{max(len(x[0]) for x in rows)}}   {b:>8}   {c}" for a, b, c in rows]
    lines.append(
        f"new/old time (median of per-round ratios): {r['ratio_new_over_old_time']:.3f}; identical tokens: yes"
    )
    return "\n".join(lines)


def describe_tree():
    """This tree's commit, with '+uncommitted' when its files differ from it."""
    head = git("rev-parse", "--short=10", "HEAD").stdout.strip() or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head + ("+uncommitted" if dirty else "")


def timing_arguments(doc, default_output, repeats_help):
    """The options every timing script here takes: --output, --quick, --threads, --repeats."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--output", default=default_output, help=f"JSON file to write (default: {default_output})")
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes and few repeats: a smoke run (timings meaningless)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1, the least noisy)")
    p.add_argument("--repeats", type=int, default=None, help=repeats_help)
    return p


def write_report(report, output, table):
    """Print `table`, write `report` as JSON to `output` (its folder made)."""
    print()
    print(table)
    out_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(out_dir, exist_ok=True)
    with open(output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {output} ({report['wall_s']:.0f} s)")


def main(argv=None):
    p = timing_arguments(__doc__, DEFAULT_OUTPUT, "rounds per measurement (default: 5; 2 with --quick)")
    p.add_argument(
        "--repeats_long",
        type=int,
        default=None,
        help="rounds for the long cached-vs-uncached pair (default: 3; 2 with --quick)",
    )
    p.add_argument(
        "--position_embedding",
        default="rope",
        choices=("rope", "learned"),
        help="LoopFormer positions (default: rope, as the Llama baseline)",
    )
    p.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="measure only cached greedy decoding: loopformer_hf at git revision REV (old) against this tree's (new), "
        f"the same weights, interleaved; writes {os.path.relpath(DEFAULT_AGAINST_OUTPUT, REPO_ROOT)} by default",
    )
    p.add_argument(
        "--new_tokens",
        type=int,
        default=None,
        help=f"with --against: new tokens (default: {FULL['gen_vs_llama']}, as the generate-vs-Llama row; "
        f"{QUICK['gen_vs_llama']} with --quick)",
    )
    p.set_defaults(output=None)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    for name in ("repeats", "repeats_long", "new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be >= 1, got {value}")
    if args.new_tokens is not None and args.against is None:
        p.error("--new_tokens only applies with --against")

    cfg = dict(QUICK if args.quick else FULL)
    if args.repeats is not None:
        cfg["repeats"] = cfg["train_repeats"] = args.repeats
    if args.repeats_long is not None:
        cfg["repeats_long"] = args.repeats_long
    start = time.time()
    if args.against is not None:
        commit, error = resolve_revision(args.against)
        if error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return main_against(args, cfg, commit, start)
    report = run_benchmark(cfg, args.threads, args.position_embedding, log=lambda s: print(s, flush=True))
    report = dict(
        config=run_config(cfg, args),
        environment=environment(),
        wall_s=time.time() - start,
        **report,
    )
    write_report(report, args.output or DEFAULT_OUTPUT, format_table(report))
    return 0


def run_config(cfg, args, **extra):
    """The report's `config`: the sizes, the command's settings and the fixed ones."""
    return dict(
        cfg,
        threads=args.threads,
        quick=args.quick,
        dtype="float32",
        attn_implementation="sdpa",
        loopformer_mlp="swiglu",
        position_embedding=args.position_embedding,
        **extra,
    )


def environment():
    return dict(
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
    )


def main_against(args, cfg, commit, start):
    new_tokens = args.new_tokens or cfg["gen_vs_llama"]
    # the generate-vs-Llama row's setting (one prompt row); the positions cover prompt + new tokens
    keep = ("hidden", "heads", "intermediate", "vocab", "k", "loops", "prompt", "repeats")
    cfg = dict({k: cfg[k] for k in keep}, batch=1, gen_long=new_tokens, seq=0)

    def log(line):
        print(line, flush=True)

    try:
        result = run_against(cfg, args.threads, args.position_embedding, commit, new_tokens, log=log)
    except AssertionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    report = dict(
        against=args.against,
        old=commit[:10],
        new=describe_tree(),
        config=run_config(cfg, args, clock="time.process_time"),
        environment=environment(),
        wall_s=time.time() - start,
        result=result,
    )
    write_report(report, args.output or DEFAULT_AGAINST_OUTPUT, format_against(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
