"""bf16 as the authors' users run it: how far our bf16 logits are from their GPT's, in bf16 and in fp32.

Their GitHub `GPT.from_pretrained` computes in fp32; users of their Hub code (lm-eval with `dtype="auto"`, vLLM
ports) compute the bf16 checkpoint in bf16. Their `nn.RMSNorm` has no eps, and torch's documentation says eps=None
is `torch.finfo(x.dtype).eps`, 2^-7 = 7.8e-3 for bf16; a third-party port keeps that "dtype-dependent default". This
measures what torch computes (the first line: `F.rms_norm` on a bf16 input against float32's eps and against 2^-7)
and then, on the published-size stand-in (benchmarks/bench_authors_size.py's writer: 3 blocks, width 2048, 32
heads, FFN 5120, random bf16 weights of their init's scale, config.json without sizes), one forward of `--batch` x
`--seq` tokens at M = 8 for: ours bf16 (every RMSNorm in float32 with float32's eps), ours fp32, their GPT in fp32 (the
reference), their GPT cast to bf16, and their GPT in bf16 with every RMSNorm's eps set to 2^-7 (the port). The
residual stream of random weights is small (rms ~0.03), where an eps of 7.8e-3 weighs most, so the learned position
table is also scaled to a larger rms (`--stream_rms`): a trained model's scale is unknown here.

    git clone https://github.com/armenjeddi/loopformer /tmp/authors_loopformer
    python -m benchmarks.bench_bf16_norm --authors_repo /tmp/authors_loopformer [--quick]
"""

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

from benchmarks import write_json
from benchmarks.bench_authors import authors_commit, load_authors_module
from benchmarks.bench_authors_size import FULL, QUICK, write_reference_checkpoint

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO_ROOT, "benchmarks", "results", "bf16_norm.json")
LOOPS = 8


def compare(logits, reference):
    """max and mean |Δ logit|, top-1 agreement and mean KL(reference || logits), all in fp32."""
    a, b = logits.float(), reference.float()
    kl = F.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    return {
        "max_abs": float((a - b).abs().max()),
        "mean_abs": float((a - b).abs().mean()),
        "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "kl": float(kl),
    }


def torch_default_eps():
    """max |F.rms_norm(x bf16, eps=None) - the norm with eps e| for e = float32's eps and 2^-7, on x of rms 0.03."""
    x = (torch.randn(64, 2048, generator=torch.Generator().manual_seed(0)) * 0.03).bfloat16()
    got = F.rms_norm(x, (2048,), None, None).float()
    return {
        name: float((got - x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).abs().max())
        for name, eps in (("float32_eps", torch.finfo(torch.float32).eps), ("bf16_eps", 2.0**-7))
    }


def run(cfg, authors_repo, stream_rms, batch, seq, threads):
    from transformers import AutoModelForCausalLM

    import loopformer_hf  # noqa: F401  (registers the authors' layout)
    from benchmarks.bench_authors_size import load_theirs

    torch.set_num_threads(threads)
    module = load_authors_module(authors_repo)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    steps = [1 / LOOPS] * LOOPS
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        write_reference_checkpoint(cfg, folder)
        theirs = load_theirs(module, folder)  # fp32, as their loader leaves it
        ours = {
            "ours bf16": AutoModelForCausalLM.from_pretrained(folder),
            "ours fp32": AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        }
        norms = [m for m in theirs.modules() if isinstance(m, torch.nn.RMSNorm)]
        base_wpe = theirs.transformer.wpe.weight.detach().clone()
        for rms in stream_rms:
            scale = rms / float(base_wpe.float().pow(2).mean().sqrt())
            logits = {}
            with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
                theirs.float().transformer.wpe.weight.copy_(base_wpe * scale)
                for model in ours.values():
                    model.model.embed_positions.weight.copy_(base_wpe * scale)
                logits["theirs fp32"] = theirs(ids, targets=torch.zeros_like(ids), steps=steps)[0]
                logits["theirs bf16"] = theirs.bfloat16()(ids, targets=torch.zeros_like(ids), steps=steps)[0]
                for norm in norms:
                    norm.eps = 2.0**-7
                logits["theirs bf16, eps 2^-7"] = theirs(ids, targets=torch.zeros_like(ids), steps=steps)[0]
                for norm in norms:
                    norm.eps = None
                for name, model in ours.items():
                    logits[name] = model(ids, loop_budget=LOOPS, use_cache=False).logits
            for name, reference in (
                ("ours bf16", "theirs bf16"),
                ("ours bf16", "theirs fp32"),
                ("theirs bf16", "theirs fp32"),
                ("theirs bf16, eps 2^-7", "theirs fp32"),
                ("ours fp32", "theirs fp32"),
            ):
                rows.append(
                    dict(stream_rms=rms, compared=name, against=reference, **compare(logits[name], logits[reference]))
                )
                print(
                    f"| {rms:g} | {name} | {reference} | {rows[-1]['max_abs']:.3g} | {rows[-1]['mean_abs']:.3g} | "
                    f"{rows[-1]['top1_agree']:.3f} | {rows[-1]['kl']:.3g} |",
                    flush=True,
                )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--authors_repo", required=True, help="a clone of github.com/armenjeddi/loopformer")
    p.add_argument("--quick", action="store_true", help="a tiny shape: a smoke run")
    p.add_argument(
        "--stream_rms",
        type=float,
        nargs="+",
        default=[0.03, 0.3, 1.0],
        help="rms of the learned position table (0.03: their init's scale, as written)",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="results JSON (default benchmarks/results/bf16_norm.json)")
    args = p.parse_args(argv)
    try:
        load_authors_module(args.authors_repo)
    except ValueError as error:
        p.error(str(error))
    cfg = QUICK if args.quick else FULL
    eps = torch_default_eps()
    print(
        f"torch {torch.__version__}: F.rms_norm(bf16, eps=None) differs by {eps['float32_eps']:.3g} from the norm "
        f"with float32's eps and by {eps['bf16_eps']:.3g} from the norm with 2^-7\n"
    )
    print(
        "| stream rms | logits of | against | max abs | mean abs | top-1 agree | KL |\n|---|---|---|---:|---:|---:|---:|"
    )
    rows = run(cfg, args.authors_repo, args.stream_rms, args.batch, args.seq, args.threads)
    output = args.output or (
        os.path.join(tempfile.gettempdir(), "bf16_norm_quick.json") if args.quick else DEFAULT_OUTPUT
    )
    write_json(
        output,
        dict(
            rows=rows,
            torch_default_eps=eps,
            config=dict(cfg, quick=args.quick, batch=args.batch, seq=args.seq, loops=LOOPS),
            authors_commit=authors_commit(args.authors_repo),
            torch=torch.__version__,
        ),
    )
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
