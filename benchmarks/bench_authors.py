"""LoopFormer against the authors' own code (github.com/armenjeddi/loopformer, `models/loopformer.py`): the same
random weights in both (theirs built by their class, ours converted from its state dict by
`loopformer_hf.convert_authors.convert`), then, side by side:

- logits at the full budget (max |difference|) of each of their model files, models/{loopformer, tmlt, base_loop,
  base}.py, on random weights (their init, 1-D parameters jittered) converted with the matching `model_type`, and the
  greedy tokens of both generation loops (equal or not);
- the cross-entropies of the full and of a short trajectory on one batch (max |difference|), then one
  shortcut-consistency training step timed: their train.py's computation (full and short trajectory, CE +
  0.1·CE_short + 0.1·MSE, AdamW) against ours (`forward(labels=..., shortcut_consistency=...)`). The short trajectory
  is fixed here (L/2 uniform steps); their train.py samples one per step, which changes what is computed, not its
  cost;
- greedy generation of n tokens: theirs has no KV cache (nanoGPT's loop: the whole sequence through the model for
  every new token; their `models/loopformer.py` has no `generate`, so the loop is written here) against our cached
  `generate`.

Their code is not part of this project and is not fetched at run time: clone it yourself and pass its folder.

    git clone https://github.com/armenjeddi/loopformer /tmp/authors_loopformer
    python -m benchmarks.bench_authors --authors_repo /tmp/authors_loopformer [--repeats 5] [--threads 1]

`python -m benchmarks.report_table --authors_repo PATH` puts these rows in the README table.
"""

import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
import transformers

from benchmarks import format_markdown, row, write_json
from benchmarks.bench_loopformer import FULL, QUICK, generate_fn, interleaved
from loopformer_hf import ShortcutConsistency
from loopformer_hf.convert_authors import convert


# our converter's model_type: their file under models/ (LoopFormer, TMLT, Base-Loop, Base)
MODEL_TYPES = ("loopformer", "tmlt", "base_loop", "base")


def load_authors_module(authors_repo, model_type="loopformer"):
    """Their `models/<model_type>.py` as a module (it needs only torch)."""
    path = os.path.join(os.fspath(authors_repo), "models", f"{model_type}.py")
    if not os.path.isfile(path):
        raise ValueError(
            f"--authors_repo must be a clone of github.com/armenjeddi/loopformer (a folder holding "
            f"models/{model_type}.py); {path!r} does not exist."
        )
    spec = importlib.util.spec_from_file_location(f"authors_{model_type}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def authors_commit(authors_repo):
    """The commit of their clone (None if it is not a git checkout), recorded beside the results."""
    proc = subprocess.run(["git", "-C", os.fspath(authors_repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def build_pair(module, cfg, workdir, seed=0, model_type="loopformer", jitter=0.0):
    """(their GPT, our converted LoopFormerForCausalLM) holding the same weights: their init (with `jitter`, every 1-D
    parameter moved by N(0, jitter) so that norm weights and biases are not their trivial init), our converter. Base
    (not looped) gets the k·L blocks of one pass."""
    n_layer = cfg["k"] * cfg["loops"] if model_type == "base" else cfg["k"]
    config = module.GPTConfig(
        block_size=cfg["max_positions"],
        vocab_size=cfg["vocab"],
        n_layer=n_layer,
        n_head=cfg["heads"],
        n_embd=cfg["hidden"],
        dropout=0.0,
        bias=False,
        intermediate_dim=cfg["intermediate"],
    )
    torch.manual_seed(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # their constructor prints its parameter count
        theirs = module.GPT(config)
    with torch.no_grad():
        for p in theirs.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * jitter)
    checkpoint = os.path.join(workdir, f"{model_type}.pt")
    torch.save({"model": theirs.state_dict()}, checkpoint)
    ours = convert(
        checkpoint,
        os.path.join(workdir, f"converted_{model_type}"),
        n_layer=n_layer,
        n_loops=None if model_type == "base" else cfg["loops"],
        n_embd=cfg["hidden"],
        n_head=cfg["heads"],
        vocab_size=cfg["vocab"],
        block_size=cfg["max_positions"],
        mlp_hidden=cfg["intermediate"],
        model_type=model_type,
        allow_pickle=True,
    )
    return theirs, ours


def their_full_logits(model, ids, model_type, num_loops):
    """Logits at every position from their forward at the full budget (with targets they keep every position)."""
    steps = {"loopformer": [1.0 / num_loops] * num_loops, "base": None}.get(model_type, num_loops)
    return model(ids, ids)[0] if steps is None else model(ids, ids, steps)[0]


def their_generate_fn(model, prompt, new_tokens, steps):
    """Greedy decoding with their forward (no cache): nanoGPT's loop, the whole sequence each token."""
    result = {}

    def run():
        idx = prompt
        with torch.inference_mode():
            for _ in range(new_tokens):
                logits = model(idx[:, -model.config.block_size :], steps=steps)[0]
                idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        result["tokens"] = idx

    run.result = result
    return run


def their_train_step_fn(model, batch, long_steps, short_steps):
    """Their train.py's LoopFormer step: loss1 + 0.1·loss2 + 0.1·MSE(x1.detach(), x2), AdamW from their
    `configure_optimizers` (weight decay on ≥ 2-D parameters)."""
    with contextlib.redirect_stdout(io.StringIO()):
        optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), "cpu")
    x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # their loss `.view`s the targets

    def step():
        optimizer.zero_grad(set_to_none=True)
        _, loss1, x1 = model(x, y, long_steps)
        _, loss2, x2 = model(x, y, short_steps)
        loss = loss1 + 0.1 * loss2 + 0.1 * F.mse_loss(x1.detach(), x2)
        loss.backward()
        optimizer.step()

    return step


def our_train_step_fn(model, batch, short_steps):
    """The same objective through our forward (labels are shifted inside, so it reads the batch's seq + 1 tokens and
    predicts the same seq targets as theirs), AdamW with the same groups."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.95)
    )

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(
            input_ids=batch, labels=batch, shortcut_consistency=ShortcutConsistency(short_steps), use_cache=False
        ).loss.backward()
        optimizer.step()

    return step


def authors_rows(cfg, repeats, authors_repo, log=print):
    """Rows (`benchmarks.row`) comparing our LoopFormer with the authors' code on the same weights."""
    module = load_authors_module(authors_repo)
    transformers.utils.logging.disable_progress_bar()  # the converter's save_pretrained
    cfg = dict(cfg, max_positions=max(1024, cfg["prompt"] + cfg["gen_vs_llama"]))
    L = cfg["loops"]
    long_steps = [1.0 / L] * L
    short_steps = [1.0 / (L // 2)] * (L // 2) if L > 1 else long_steps
    g = torch.Generator().manual_seed(4)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        ids = torch.randint(0, cfg["vocab"], (2, cfg["prompt"]), generator=g)
        for model_type in MODEL_TYPES:  # the forward of each of their model files, on non-trivial weights
            theirs, ours = build_pair(
                load_authors_module(authors_repo, model_type), cfg, workdir, model_type=model_type, jitter=0.1
            )
            with torch.inference_mode():
                diff = (
                    (their_full_logits(theirs.eval(), ids, model_type, L) - ours.eval()(ids, use_cache=False).logits)
                    .abs()
                    .max()
                    .item()
                )
            rows.append(
                row(
                    f"logits, max abs(ours - theirs): models/{model_type}.py, converted",
                    diff,
                    0.0,
                    [diff],
                    "<= 1e-4",
                    diff <= 1e-4,
                )
            )

        theirs, ours = build_pair(module, cfg, workdir)
        theirs.train()
        ours.train()
        batch = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
        with torch.no_grad():  # the objective's two CE terms on one batch (dropout is 0 in both)
            x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            theirs_ce = torch.stack([theirs(x, y, long_steps)[1], theirs(x, y, short_steps)[1]])
            out = ours(
                input_ids=batch, labels=batch, shortcut_consistency=ShortcutConsistency(short_steps), use_cache=False
            )
            diff = (torch.stack([out.ce_full, out.ce_short]) - theirs_ce).abs().max().item()
        rows.append(
            row(
                "CE of the full and the short trajectory, max abs(ours - theirs)",
                diff,
                0.0,
                [diff],
                "<= 1e-4",
                diff <= 1e-4,
            )
        )
        log(f"vs authors: shortcut-consistency train step, batch {cfg['batch']} x seq {cfg['seq']}, {repeats} rounds")
        t = interleaved(
            {
                "ours": our_train_step_fn(ours, batch, short_steps),
                "theirs": their_train_step_fn(theirs, batch, long_steps, short_steps),
            },
            repeats,
        )
        ratios = [a / b for a, b in zip(t["ours"], t["theirs"])]
        rows.append(
            row(
                f"train step with the consistency objective (b{cfg['batch']}x{cfg['seq']}), s: ours / authors'",
                statistics.median(t["ours"]),
                statistics.median(t["theirs"]),
                ratios,
                "<= 1.0",
                statistics.median(ratios) <= 1.0,
            )
        )

        theirs.eval()
        ours.eval()
        n = cfg["gen_vs_llama"]
        prompt = torch.randint(0, cfg["vocab"], (1, cfg["prompt"]), generator=g)
        log(f"vs authors: greedy generate {n} tokens at M={L}, {repeats} rounds")
        sides = {
            "ours": generate_fn(ours, prompt, n, loop_budget=L),
            "theirs": their_generate_fn(theirs, prompt, n, long_steps),
        }
        t = interleaved(sides, repeats)
        same = torch.equal(sides["ours"].result["tokens"], sides["theirs"].result["tokens"])
        ratios = [b / a for a, b in zip(t["ours"], t["theirs"])]
        rows.append(
            row(
                f"greedy generate {n} tok at M={L}, tokens/s: ours (KV cache) / authors' (no cache)"
                + ("" if same else " (TOKENS DIFFER)"),
                n / statistics.median(t["ours"]),
                n / statistics.median(t["theirs"]),
                ratios,
                ">= 1.0",
                statistics.median(ratios) >= 1.0 and same,
            )
        )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--authors_repo", required=True, help="a clone of github.com/armenjeddi/loopformer")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds: a smoke run (timings meaningless)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per measurement (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--output", default="benchmarks/results/authors.json")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    cfg = dict(QUICK if args.quick else FULL)
    repeats = args.repeats or cfg["repeats"]
    torch.set_num_threads(args.threads)
    start = time.time()
    try:
        rows = authors_rows(cfg, repeats, args.authors_repo, log=lambda s: print(s, flush=True))
    except ValueError as e:
        p.error(str(e))
    print()
    print(format_markdown(rows))
    write_json(
        args.output,
        dict(
            config=dict(cfg, threads=args.threads, repeats=repeats, quick=args.quick),
            authors_repo=os.path.abspath(args.authors_repo),
            authors_commit=authors_commit(args.authors_repo),
            torch=torch.__version__,
            wall_s=time.time() - start,
            rows=rows,
        ),
    )
    print(f"\nwrote {args.output} ({time.time() - start:.0f} s)")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
