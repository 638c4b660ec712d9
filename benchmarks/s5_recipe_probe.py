"""A fast probe of FPRM state-tracking recipes, outside Trainer: the numbers behind the S5 ablations in
benchmarks/writeups/fprm.md.

Fresh random sequences every step; each batch gets enough deep-supervision segments (of `--nb` loops with gradient,
state detached in between, one optimizer step per segment) to reach its last position. Every 30 s it prints the
per-prefix accuracy at k = 1..12 on held-out length-128 sequences; at the end, the accuracy at k = 2..128.

    python -m benchmarks.s5_recipe_probe --kernel 4 --init_std 6 --minutes 7   # the authors' computation, kernel 4
    python -m benchmarks.s5_recipe_probe --kernel 2 --init_std 6 --minutes 7   # ... kernel 2

Flags for the other recipes tried there: --tie (tied head and embeddings), --layers 1, --bos (a start token whose
state the first element composes with), --reach (no loss on positions a segment cannot have reached yet),
--decay_frac (linear lr decay over the last fraction of the time budget), --group S3/S4/A4/A5, and
--table_only (control: a plain MLP learning the table itself: `--table_only --batch 1024`).
"""

import argparse
import json
import math
import time

import torch

from fprm_hf import FPRMConfig, FPRMForReasoning
from looped_training.fprm.tasks.state_tracking import GROUPS, multiplication_table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--group", default="S5", choices=GROUPS)
    p.add_argument("--minlen", type=int, default=2)
    p.add_argument("--maxlen", type=int, default=4)
    p.add_argument("--curriculum", type=float, default=0.0, help="raise maxlen by half when accuracy at it >= this")
    p.add_argument("--cap", type=int, default=32, help="largest training length")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--decay_frac", type=float, default=0.0)
    p.add_argument("--nb", type=int, default=2, help="loops with gradient per segment")
    p.add_argument("--segs", type=int, default=3, help="minimum segments per batch")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--ff", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kernel", type=int, default=2)
    p.add_argument("--tie", action="store_true")
    p.add_argument("--init_std", type=float, default=1.0, help="std of z0 (the authors' S5/A5 configs: 6.0)")
    p.add_argument("--bos", action="store_true")
    p.add_argument("--reach", action="store_true")
    p.add_argument("--minutes", type=float, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_test", type=int, default=200)
    p.add_argument(
        "--table_only",
        action="store_true",
        help="control: a plain SwiGLU MLP learning a·b from the summed embeddings of a and b",
    )
    return p.parse_args(argv)


def learn_table_only(table, a):
    """How fast the bare table is learned without the loop: every (a, b) pair scored every 200 steps."""
    from torch import nn
    from torch.nn import functional as F

    size = len(table)
    left, right = nn.Embedding(size, a.d), nn.Embedding(size, a.d)
    gate, up = nn.Linear(a.d, a.ff, bias=False), nn.Linear(a.d, a.ff, bias=False)
    down, head = nn.Linear(a.ff, a.d, bias=False), nn.Linear(a.d, size, bias=False)
    modules = nn.ModuleList([left, right, gate, up, down, head])
    opt = torch.optim.AdamW(modules.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def logits(x, y):
        h = F.rms_norm(left(x) + right(y), (a.d,))
        return head(F.rms_norm(down(F.silu(gate(h)) * up(h)), (a.d,)))

    all_a, all_b = torch.arange(size).repeat_interleave(size), torch.arange(size).repeat(size)
    start, step, acc = time.time(), 0, 0.0
    while time.time() - start < a.minutes * 60 and acc < 0.99:
        x, y = torch.randint(0, size, (a.batch,)), torch.randint(0, size, (a.batch,))
        loss = F.cross_entropy(logits(x, y), table[x, y])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 200 == 0:
            with torch.no_grad():
                acc = (logits(all_a, all_b).argmax(-1) == table[all_a, all_b]).float().mean().item()
            print(f"{time.time() - start:5.0f}s step {step} table accuracy {acc:.3f}", flush=True)
    result = {"steps": step, "seconds": round(time.time() - start, 1), "table_accuracy": acc}
    print("RESULT " + json.dumps(result), flush=True)
    return result


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    table = torch.tensor(multiplication_table(a.group))
    size = len(table)
    if a.table_only:
        return learn_table_only(table, a)
    bos_id = size + 1  # only with --bos

    def batch(count, lo, hi):
        lengths = torch.randint(lo, hi + 1, (count,))
        seq = torch.randint(0, size, (count, hi))
        labels, state = torch.empty_like(seq), seq[:, 0]
        labels[:, 0] = state
        for t in range(1, hi):
            state = table[state, seq[:, t]]
            labels[:, t] = state
        real = torch.arange(hi)[None] < lengths[:, None]
        ids, labels = torch.where(real, seq + 1, 0), torch.where(real, labels + 1, -100)
        if a.bos:
            ids = torch.cat([torch.full((count, 1), bos_id), ids], 1)
            labels = torch.cat([torch.full((count, 1), -100), labels], 1)
        return ids, labels

    config = FPRMConfig(
        vocab_size=size + 1 + a.bos,
        hidden_size=a.d,
        num_attention_heads=a.heads,
        intermediate_size=a.ff,
        num_hidden_layers=a.layers,
        grid_size=None,
        conv_type="causal_1d",
        conv_kernel_size=a.kernel,
        causal=True,
        position_embedding_type="none",
        num_prefix_tokens=0,
        init_std=a.init_std,
        patience=10,
        gamma_train=0.95,
        tie_word_embeddings=a.tie,
    )
    model = FPRMForReasoning(config)
    decay = [p for n, p in model.named_parameters() if "alpha" not in n and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not ("alpha" not in n and p.dim() > 1)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95)
    )
    test_ids, test_labels = batch(a.num_test, 128, 128)

    @torch.no_grad()
    def accuracy(length, loops):
        model.eval()
        logits = model(test_ids[:, : length + a.bos], max_loops=loops, halting=False).logits
        model.train()
        return (logits.argmax(-1)[:, a.bos :] == test_labels[:, a.bos : length + a.bos]).float().mean(0)

    start, step, maxlen, last_print = time.time(), 0, a.maxlen, 0.0
    while time.time() - start < a.minutes * 60:
        if a.decay_frac:
            left = 1 - (time.time() - start) / (a.minutes * 60)
            for group in opt.param_groups:
                group["lr"] = a.lr * min(1.0, max(0.0, left) / a.decay_frac)
        ids, labels = batch(a.batch, a.minlen, maxlen)
        state = None
        for segment in range(max(a.segs, math.ceil((maxlen + 2) / a.nb))):
            seg_labels = labels
            if a.reach:  # position i (0-based) is reached after i + 1 loops
                seg_labels = torch.where(torch.arange(labels.shape[1])[None] < (segment + 1) * a.nb, labels, -100)
            out = model(ids, labels=seg_labels, max_loops=a.nb, halt_eps=1e-9, solver_state=state)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            step += 1
            state = out.solver_state.detach()
        if time.time() - last_print > 30:
            last_print = time.time()
            acc = accuracy(min(max(maxlen + 4, 12), 128), max(maxlen + 8, 20))
            shown = " ".join(f"k{k}={acc[k - 1]:.2f}" for k in (1, 2, 3, 4, 6, 8, 12))
            print(
                f"{time.time() - start:5.0f}s step {step} maxlen {maxlen} loss {out.loss.item():.3f} {shown}",
                flush=True,
            )
            if a.curriculum and acc[maxlen - 1] >= a.curriculum and maxlen < a.cap:
                maxlen = min(a.cap, maxlen + max(1, maxlen // 2))
    acc = accuracy(128, 160)
    result = {
        "steps": step,
        "max_train_length": maxlen,
        "accuracy_at_k": {k: round(acc[k - 1].item(), 3) for k in (2, 4, 8, 16, 32, 64, 128)},
        "mean_over_128": round(acc.mean().item(), 3),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
