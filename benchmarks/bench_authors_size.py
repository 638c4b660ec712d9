"""The authors' size: a checkpoint of the FineWeb300K shape (armenjeddi/
LoopFormer-3block-8iterations-FineWeb300K: 3 blocks, n_embd 2048, 32 heads, intermediate 5120, vocab 50304, context
1024, 8 loops; 0.28B parameters) with random weights, written in their Hub layout (config.json with model_type
"loopformer", nanoGPT keys and steps = [1/8]*8; bf16 model.safetensors under their GPT's names with a `gpt.` prefix,
the tied head saved only as `transformer.wte.weight`) into a temporary folder, then, side by side in one run:

- load: seconds and peak RSS of ours (`AutoModelForCausalLM.from_pretrained(dir)`, which keeps the checkpoint's
  bf16; and once more with `dtype=torch.float32`) against their code's load, each in its own fresh subprocess, the
  kinds taking turns. Their `GPT.from_pretrained(dir)` first loads the folder through their remote code
  (`AutoModelForCausalLM`, trust_remote_code), then builds their `GPT(GPTConfig(...))` (fp32, randomly initialised)
  and `load_state_dict`s the prefix-stripped, tie-restored state dict into it. The remote-code step is not available
  locally, so "theirs" here times the rest of that path on the same file: read model.safetensors, strip the
  prefixes, restore the tie, build their GPT from config.json's keys, `load_state_dict(strict=True)`; their model
  ends in fp32, as their loader leaves it. Load seconds exclude the imports. Ours maps model.safetensors and reads
  a weight's pages when it is first used, so each child then runs one forward (8 tokens, M=8) and the peak RSS is
  taken over the load and that forward: the child's own high-water mark (VmHWM; imports included), and "RSS added"
  is that peak less the RSS just before the load. Not `resource.getrusage`: its ru_maxrss survives subprocess's
  vfork + exec on Linux, so a child smaller than this benchmark's process reports the parent's peak (the JSON keeps
  it as `getrusage_maxrss_mib`).
- greedy generation, tokens/s (new tokens / wall time of the call, the prompt's prefill included) at M = 1, 2, 4, 8:
  ours (`generate(loop_budget=M, do_sample=False)`, KV cache) against their code (no cache: nanoGPT's loop, the whole
  sequence through `forward(idx, steps=[1/M]*M)` for every token; their model cast to bf16 after their load) and
  against an iso-FLOP Llama (`LlamaForCausalLM`, 24 layers = 3 blocks x 8 loops, same width and heads, random init,
  its cached `generate`). Llama's MLP is gated (three matrices), so its intermediate size is 2/3 of ours (5120 ->
  3413): each of its layers then does the matmuls of one application of our block (attention 4·d², MLP 2·d·5120).
  One round runs every side once (Llama once, ours and theirs at every M), the order reversed each round; each ratio
  is the median of the per-round ratios.
- one training step (forward + backward + AdamW step, batch 1 x 128 tokens, bf16 parameters and optimizer state):
  ours at M = 8 (plain CE at the full budget) against the same Llama, interleaved after one warm-up step each.

Everything runs in bf16, the checkpoint's dtype: on a CPU with AVX512-BF16, bf16 matmuls over many tokens (their
uncached generation, the training steps) run faster than fp32 ones, which keeps the run near 10 minutes on two shared
cores, and bf16 halves the memory of the 1B-parameter Llama's training step. Their code is not part of
this project and is not fetched: clone it and pass its folder (without it, their rows print "not run").

    git clone https://github.com/armenjeddi/loopformer /tmp/authors_loopformer
    python -m benchmarks.bench_authors_size --authors_repo /tmp/authors_loopformer [--threads 1] [--repeats 2]
    python -m benchmarks.bench_authors_size --quick      # a tiny shape, a smoke run (timings meaningless)
"""

import argparse
import contextlib
import gc
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from benchmarks import write_json
from benchmarks.bench_authors import authors_commit, load_authors_module, their_generate_fn
from benchmarks.bench_loopformer import generate_fn, interleaved, train_step_fn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO_ROOT, "benchmarks", "results", "authors_size.json")

# their GPTConfig defaults (models/loopformer.py), which the FineWeb300K checkpoint uses
FULL = dict(
    n_layer=3,
    n_head=32,
    n_embd=2048,
    intermediate_dim=5120,
    vocab_size=50304,
    block_size=1024,
    loops=8,
    prompt=32,
    new_tokens=16,
    batch=1,
    seq=128,
    repeats=2,
    load_rounds=2,
)
QUICK = dict(
    n_layer=3,
    n_head=4,
    n_embd=64,
    intermediate_dim=160,
    vocab_size=512,
    block_size=64,
    loops=8,
    prompt=8,
    new_tokens=4,
    batch=1,
    seq=16,
    repeats=1,
    load_rounds=1,
)
BUDGETS = (1, 2, 4, 8)
CONFIG_KEYS = ("n_layer", "n_head", "n_embd", "intermediate_dim", "vocab_size", "block_size")
DTYPE = torch.bfloat16
LOAD_KINDS = ("ours", "ours_fp32", "theirs")
NOT_RUN = "not run"


# ---- the checkpoint in their layout --------------------------------------------------------------------------------


def reference_names(cfg):
    """{name: shape} of their models/loopformer.py GPT's state dict, less the tied lm_head (their RMSNorms in the
    blocks have no weight)."""
    d, mlp, freq = cfg["n_embd"], cfg["intermediate_dim"], 256
    shapes = {"transformer.wte.weight": (cfg["vocab_size"], d), "transformer.wpe.weight": (cfg["block_size"], d)}
    for j in range(cfg["n_layer"]):
        p = f"transformer.h.blocks.{j}."
        shapes.update(
            {
                p + "attn.c_attn.weight": (3 * d, d),
                p + "attn.c_proj.weight": (d, d),
                p + "mlp.c_fc.weight": (mlp, d),
                p + "mlp.c_proj.weight": (d, mlp),
                p + "adaLN_modulation.1.weight": (4 * d, d),
                p + "adaLN_modulation.1.bias": (4 * d,),
            }
        )
    shapes["transformer.norm_f.weight"] = (d,)
    for name in ("time_embedder", "dt_embedder"):
        shapes.update(
            {
                f"{name}.mlp.0.weight": (d, freq),
                f"{name}.mlp.0.bias": (d,),
                f"{name}.mlp.2.weight": (d, d),
                f"{name}.mlp.2.bias": (d,),
            }
        )
    return shapes


def write_reference_checkpoint(cfg, folder, seed=0):
    """A random bf16 checkpoint of `cfg`'s shape in the authors' Hub layout; returns its parameter count."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in reference_names(cfg).items():
        if name == "transformer.norm_f.weight":
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        else:  # their init's std, non-zero adaLN (theirs starts at zero) so that the modulation is not trivial
            t = 0.02 * torch.randn(shape, generator=g)
        tensors["gpt." + name] = t.to(DTYPE)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    # as published: config.json states no size (transformers 4.57 saves only what differs from the configuration
    # class's defaults), the class in the repo's own code carries them
    config = {
        "architectures": ["LoopFormerGPTForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_loopformer.LoopFormerGPTConfig",
            "AutoModelForCausalLM": "modeling_loopformer.LoopFormerGPTForCausalLM",
        },
        "dtype": "bfloat16",
        "model_type": "loopformer",
        "transformers_version": "4.57.0",
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    defaults = dict(
        {k: cfg[k] for k in CONFIG_KEYS}, dropout=0.0, bias=False, steps=[1.0 / cfg["loops"]] * cfg["loops"]
    )
    with open(os.path.join(folder, "configuration_loopformer.py"), "w") as f:
        f.write(
            "from transformers import PretrainedConfig\n\n\nclass LoopFormerGPTConfig(PretrainedConfig):\n"
            '    model_type = "loopformer"\n\n    def __init__(self, '
            + ", ".join(f"{k}={v!r}" for k, v in defaults.items())
            + ", **kwargs):\n"
            + "".join(f"        self.{k} = {k}\n" for k in defaults)
            + "        super().__init__(**kwargs)\n"
        )
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": True, "transformers_version": "4.57.0"}, f)
    return sum(t.numel() for t in tensors.values())


# ---- loading ---------------------------------------------------------------------------------------------------------


def load_ours(folder, dtype=None):
    from transformers import AutoModelForCausalLM

    import loopformer_hf  # noqa: F401  (registers the authors' model types)

    return AutoModelForCausalLM.from_pretrained(folder, **({} if dtype is None else {"dtype": dtype}))


def load_theirs(module, folder):
    """Their `GPT.from_pretrained` after its remote-code step: GPT(GPTConfig(config.json's keys)) (fp32, their
    init), then load_state_dict of the stripped, tie-restored state dict (see the module docstring)."""
    from safetensors.torch import load_file

    from loopformer_hf.authors.weights import strip_wrapper_prefixes

    from loopformer_hf.authors.code_defaults import source_defaults

    keep = (
        "model_type",
        "block_size",
        "vocab_size",
        "n_layer",
        "n_head",
        "n_embd",
        "dropout",
        "bias",
        "intermediate_dim",
    )  # their loader's KEEP
    # their AutoConfig: the repo's configuration class, config.json's values over its defaults
    with open(os.path.join(folder, "configuration_loopformer.py")) as f:
        config = source_defaults(f.read(), "LoopFormerGPTConfig")
    with open(os.path.join(folder, "config.json")) as f:
        config.update(json.load(f))
    config = {k: v for k, v in config.items() if k in keep and v is not None}
    state_dict = strip_wrapper_prefixes(load_file(os.path.join(folder, "model.safetensors")))
    state_dict.setdefault("lm_head.weight", state_dict["transformer.wte.weight"])  # their `_fix_tied`
    with contextlib.redirect_stdout(io.StringIO()):  # their constructor prints its parameter count
        model = module.GPT(module.GPTConfig(**config))
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def _status_mib(field):
    """VmRSS (resident now) or VmHWM (this process's peak) from /proc/self/status, in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def load_child(kind, folder, authors_repo, threads):
    """In a fresh process: load once, print {seconds, peak RSS, RSS before} as JSON."""
    torch.set_num_threads(threads)
    module = load_authors_module(authors_repo) if kind == "theirs" else None
    if kind != "theirs":
        from transformers import AutoModelForCausalLM  # noqa: F401  (imports are not the load)

        import loopformer_hf  # noqa: F401
    gc.collect()
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    model = (
        load_theirs(module, folder)
        if kind == "theirs"
        else load_ours(folder, torch.float32 if kind == "ours_fp32" else None)
    )
    seconds = time.perf_counter() - start
    load_peak = _status_mib("VmHWM")
    # ours maps model.safetensors (its pages become resident when first read): one forward reads every weight
    ids = torch.arange(8)[None] % model.config.vocab_size
    start = time.perf_counter()
    with torch.inference_mode():
        if kind == "theirs":
            model(ids, steps=[1.0 / 8] * 8)
        else:
            model(ids, loop_budget=model.config.num_loops, use_cache=False)
    forward_s = time.perf_counter() - start
    peak = _status_mib("VmHWM")
    # getrusage's ru_maxrss (KiB) is kept for the record only: after subprocess's vfork + exec, Linux carries the
    # parent's peak into it, so a small child reports the benchmark process's own peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dtype = str(next(model.parameters()).dtype)
    print(
        json.dumps(
            dict(
                kind=kind,
                seconds=seconds,
                first_forward_s=forward_s,
                load_peak_rss_mib=load_peak,
                peak_rss_mib=peak,
                getrusage_maxrss_mib=maxrss,
                rss_before_mib=before,
                rss_after_mib=_status_mib("VmRSS"),
                dtype=dtype,
                params=sum(p.numel() for p in model.parameters()),
            )
        )
    )


def time_loads(folder, kinds, rounds, authors_repo, threads, log):
    """Each kind `rounds` times, each load in its own subprocess, the kinds taking turns (order reversed each
    round). {kind: [child results]}."""
    results = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.bench_authors_size",
                "--load_child",
                kind,
                "--checkpoint",
                folder,
                "--threads",
                str(threads),
            ]
            if authors_repo:
                cmd += ["--authors_repo", authors_repo]
            proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"the {kind} load failed:\n{proc.stderr[-3000:]}")
            results[kind].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            r = results[kind][-1]
            log(
                f"  load {kind}: {r['seconds']:.2f} s (first forward {r['first_forward_s']:.2f} s), peak RSS "
                f"{r['load_peak_rss_mib']:.0f} MiB after the load, {r['peak_rss_mib']:.0f} MiB after the forward"
            )
    return results


# ---- models for generation and training ------------------------------------------------------------------------------


def iso_flop_llama(cfg, seed=0):
    """Llama with k·L layers of our width and heads; gated MLP of 2/3 our intermediate size (same matmul FLOPs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["n_embd"],
        intermediate_size=llama_intermediate(cfg),
        num_hidden_layers=cfg["n_layer"] * cfg["loops"],
        num_attention_heads=cfg["n_head"],
        num_key_value_heads=cfg["n_head"],
        max_position_embeddings=cfg["block_size"],
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, dtype=DTYPE)


def llama_intermediate(cfg):
    return round(2 * cfg["intermediate_dim"] / 3)


# ---- the benchmark ---------------------------------------------------------------------------------------------------


def med(xs):
    return statistics.median(xs) if xs else None


def paired(num, den):
    return statistics.median(a / b for a, b in zip(num, den))


def run(cfg, authors_repo, threads, repeats, log=print):
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message="LoopFormer trajectory")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    module = load_authors_module(authors_repo) if authors_repo else None
    report = dict(generate={}, train={})
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        report["checkpoint_params"] = write_reference_checkpoint(cfg, folder)
        report["checkpoint_bytes"] = os.path.getsize(os.path.join(folder, "model.safetensors"))
        report["checkpoint_mib"] = report["checkpoint_bytes"] / 2**20
        log(
            f"checkpoint: {report['checkpoint_params'] / 1e6:.1f}M parameters, bf16, "
            f"{report['checkpoint_mib']:.0f} MiB, written in {time.perf_counter() - start:.1f} s"
        )
        gc.collect()

        kinds = LOAD_KINDS if module else LOAD_KINDS[:2]
        log(f"load: {', '.join(kinds)}, each in a fresh subprocess, {cfg['load_rounds']} round(s)")
        report["load"] = time_loads(folder, kinds, cfg["load_rounds"], authors_repo, threads, log)

        ours = load_ours(folder)
        theirs = load_theirs(module, folder).to(DTYPE) if module else None
    llama = iso_flop_llama(cfg)
    report["params"] = dict(
        ours=sum(p.numel() for p in ours.parameters()), llama=sum(p.numel() for p in llama.parameters())
    )
    d, k, L = cfg["n_embd"], cfg["n_layer"], cfg["loops"]
    report["matmul_weights_per_token"] = dict(  # attention and MLP per layer application (adaLN is per step)
        ours_at_L=k * L * (4 * d * d + 2 * d * cfg["intermediate_dim"]),
        llama=k * L * (4 * d * d + 3 * d * llama_intermediate(cfg)),
    )

    n = cfg["new_tokens"]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, cfg["vocab_size"], (1, cfg["prompt"]), generator=g)
    fns = {"llama": generate_fn(llama, prompt, n)}
    for M in BUDGETS:
        fns[f"ours M={M}"] = generate_fn(ours, prompt, n, loop_budget=M)
        if theirs is not None:
            fns[f"theirs M={M}"] = their_generate_fn(theirs, prompt, n, [1.0 / M] * M)
    log(
        f"generate: {n} new tokens after a {cfg['prompt']}-token prompt, warm-up (2 tokens each), then "
        f"{repeats} round(s) of {len(fns)} runs"
    )
    warm = {"llama": generate_fn(llama, prompt, 2), "ours": generate_fn(ours, prompt, 2, loop_budget=cfg["loops"])}
    if theirs is not None:
        warm["theirs"] = their_generate_fn(theirs, prompt, 2, [1.0 / cfg["loops"]] * cfg["loops"])
    for fn in warm.values():
        fn()
    t = interleaved(fns, repeats, warmup=0)
    report["generate"]["llama"] = dict(tokens_per_s=n / med(t["llama"]), times=t["llama"])
    for M in BUDGETS:
        entry = dict(
            ours_tokens_per_s=n / med(t[f"ours M={M}"]),
            ours_times=t[f"ours M={M}"],
            ours_over_llama=paired(t["llama"], t[f"ours M={M}"]),
        )
        if theirs is not None:
            entry.update(
                theirs_tokens_per_s=n / med(t[f"theirs M={M}"]),
                theirs_times=t[f"theirs M={M}"],
                ours_over_theirs=paired(t[f"theirs M={M}"], t[f"ours M={M}"]),
                same_tokens=bool(
                    torch.equal(fns[f"ours M={M}"].result["tokens"], fns[f"theirs M={M}"].result["tokens"])
                ),
            )
        report["generate"][str(M)] = entry
        log(
            f"  M={M}: ours {entry['ours_tokens_per_s']:.2f} tok/s"
            + (f", theirs {entry['theirs_tokens_per_s']:.2f}" if theirs is not None else "")
            + f", Llama {report['generate']['llama']['tokens_per_s']:.2f}"
        )
    del theirs, fns, warm
    gc.collect()

    log(
        f"train step: batch {cfg['batch']} x {cfg['seq']}, AdamW, bf16, ours at M={cfg['loops']}; one warm-up step "
        f"each, then {repeats} round(s)"
    )
    ours.train()
    llama.train()
    batch = torch.randint(3, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g)
    t = interleaved({"ours": train_step_fn(ours, batch), "llama": train_step_fn(llama, batch)}, repeats)
    report["train"] = dict(
        ours_s=med(t["ours"]), llama_s=med(t["llama"]), ours_over_llama=paired(t["ours"], t["llama"]), times=t
    )
    report["peak_rss_mib_main_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return report


# ---- the table -------------------------------------------------------------------------------------------------------


def _fmt(x, digits=2):
    return NOT_RUN if x is None else f"{x:.{digits}f}"


def table_rows(report):
    """[measurement, ours, theirs, Llama, ours/theirs, ours/Llama] as strings."""
    load = report["load"]

    def stat(kind, key):
        if not load.get(kind):
            return None
        return med([r["peak_rss_mib"] - r["rss_before_mib"] if key == "added" else r[key] for r in load[kind]])

    def ratio(a, b):
        return NOT_RUN if b is None else f"{a / b:.2f}"

    rows = []
    for kind, label in (("ours", "ours keeps the checkpoint's bf16"), ("ours_fp32", "ours with dtype=float32")):
        for key, what, digits in (
            ("seconds", "load s", 2),
            ("first_forward_s", "first forward s (8 tokens, M=8)", 2),
            ("peak_rss_mib", "peak RSS MiB (load + first forward)", 0),
            ("added", "RSS added MiB (that peak - RSS before the load)", 0),
        ):
            a, b = stat(kind, key), stat("theirs", key)
            rows.append([f"{what}; {label}, theirs ends fp32", _fmt(a, digits), _fmt(b, digits), "", ratio(a, b), ""])
    llama_tps = report["generate"]["llama"]["tokens_per_s"]
    for M in BUDGETS:
        e = report["generate"][str(M)]
        same = "" if "same_tokens" not in e else (" (same tokens)" if e["same_tokens"] else " (tokens differ)")
        rows.append(
            [
                f"generate tokens/s, M={M}{same}",
                _fmt(e["ours_tokens_per_s"]),
                _fmt(e.get("theirs_tokens_per_s")),
                _fmt(llama_tps),
                _fmt(e.get("ours_over_theirs")),
                _fmt(e["ours_over_llama"]),
            ]
        )
    tr = report["train"]
    rows.append(
        [
            f"train step s (lower is better), ours at M={report['config']['loops']}",
            _fmt(tr["ours_s"]),
            "",
            _fmt(tr["llama_s"]),
            "",
            _fmt(tr["ours_over_llama"]),
        ]
    )
    return rows


def format_table(report):
    header = ["measurement", "ours", "theirs", "Llama", "ours/theirs", "ours/Llama"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * 5) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(report)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--authors_repo",
        default=None,
        help="a clone of github.com/armenjeddi/loopformer (without it their rows print 'not run')",
    )
    p.add_argument("--quick", action="store_true", help="a tiny shape, one round: a smoke run (timings meaningless)")
    p.add_argument("--repeats", type=int, default=None, help="rounds of generation and of training steps (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads, here and in the load subprocesses")
    p.add_argument(
        "--output",
        default=None,
        help=f"results JSON (default {os.path.relpath(DEFAULT_OUTPUT, REPO_ROOT)}, or a temporary file with --quick)",
    )
    p.add_argument("--load_child", choices=LOAD_KINDS, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.load_child:
        return load_child(args.load_child, args.checkpoint, args.authors_repo, args.threads)
    if args.authors_repo:
        try:
            load_authors_module(args.authors_repo)
        except ValueError as e:
            p.error(str(e))
    cfg = dict(QUICK if args.quick else FULL)
    repeats = args.repeats or cfg["repeats"]
    output = args.output or (
        os.path.join(tempfile.gettempdir(), "published_size_quick.json") if args.quick else DEFAULT_OUTPUT
    )
    import transformers

    start = time.time()
    report = run(cfg, args.authors_repo, args.threads, repeats, log=lambda s: print(s, flush=True))
    report.update(
        config=dict(
            cfg,
            threads=args.threads,
            repeats=repeats,
            quick=args.quick,
            dtype="bfloat16",
            llama_layers=cfg["n_layer"] * cfg["loops"],
            llama_intermediate=llama_intermediate(cfg),
        ),
        authors_repo=args.authors_repo and os.path.abspath(args.authors_repo),
        authors_commit=args.authors_repo and authors_commit(args.authors_repo),
        torch=torch.__version__,
        transformers=transformers.__version__,
        wall_s=time.time() - start,
    )
    report["table"] = table_rows(report)
    print()
    print(
        f"params: ours {report['params']['ours'] / 1e6:.1f}M, Llama {report['params']['llama'] / 1e6:.1f}M; "
        f"attention + MLP weights per token: ours at M={cfg['loops']} "
        f"{report['matmul_weights_per_token']['ours_at_L'] / 1e6:.1f}M, Llama "
        f"{report['matmul_weights_per_token']['llama'] / 1e6:.1f}M"
    )
    print(format_table(report))
    write_json(output, report)
    print(f"\nwrote {output} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
