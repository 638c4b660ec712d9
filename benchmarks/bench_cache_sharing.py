"""KV memory and quality of the shared loop cache (benchmarks/cache_sharing.py, an approximation) against the exact one.

    python -m benchmarks.bench_cache_sharing [--steps 300] [--output benchmarks/results/cache_sharing.json]

1. Memory: bytes of keys/values a cache holds after a prompt and `--new_tokens` decode steps, exact (one slot per
   (loop step, block)) against shared modulo n, at budgets M = 8, 16, 24.
2. Quality: a tiny LoopFormer (k=1 block, L=8 loops) is trained here for `--steps` steps on a synthetic order-2
   Markov language (a few seconds of data, no download), then scored by teacher-forced *cached decoding*: the first
   `--prompt_len` tokens of each held-out sequence are one prefill call, every later token one decode call, and
   the perplexity of the decoded positions is compared between the exact cache and shared caches (the prefill is
   exact either way: sharing only changes what later tokens read).
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

import loopformer_hf
from benchmarks import write_json
from benchmarks.cache_sharing import ModuloSharedCache
from loopformer_hf import LoopFormerCache


def markov_language(vocab_size, seed=0):
    """Order-2 Markov chain: each (previous two tokens) pair has 4 likely successors."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab_size, vocab_size, vocab_size), -6.0)
    successors = torch.randint(0, vocab_size, (vocab_size, vocab_size, 4), generator=g)
    logits.scatter_(2, successors, torch.tensor([2.0, 1.5, 1.0, 0.5]).expand(vocab_size, vocab_size, 4).contiguous())
    return logits.softmax(-1)


def sample(probs, batch, length, g):
    v = probs.shape[0]
    seq = torch.randint(0, v, (batch, 2), generator=g)
    for _ in range(length - 2):
        nxt = torch.multinomial(probs[seq[:, -2], seq[:, -1]], 1, generator=g)
        seq = torch.cat([seq, nxt], 1)
    return seq


def kv_bytes(cache):
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
        if layer.is_initialized
    )


def new_cache(config, share_n=None):
    """The exact cache (`share_n=None`) or the shared one holding `share_n` loop-step slots per block."""
    return LoopFormerCache() if share_n is None else ModuloSharedCache(config, share_n)


def decode_nll(model, ids, prompt_len, loop_budget, share_n=None):
    """Mean next-token NLL of positions prompt_len.. when the sequence is fed as one prefill plus one-token steps."""
    with torch.no_grad():
        out = model(
            ids[:, :prompt_len], cache=new_cache(model.config, share_n), use_cache=True, loop_budget=loop_budget
        )
        cache, logits = out.cache if hasattr(out, "cache") else out.past_key_values, [out.logits[:, -1:]]
        for i in range(prompt_len, ids.shape[1] - 1):
            out = model(ids[:, i : i + 1], cache=cache, use_cache=True, loop_budget=loop_budget)
            logits.append(out.logits)
    logits = torch.cat(logits, 1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, prompt_len:].reshape(-1)).item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--share_n", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--memory_budgets", type=int, nargs="+", default=[8, 16, 24])
    parser.add_argument("--prompt_len", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=56)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="benchmarks/results/cache_sharing.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = 32
    cfg = loopformer_hf.LoopFormerConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=256,
        num_hidden_layers=1,
        num_loops=8,
        max_position_embeddings=128,
        frequency_embedding_size=32,
        max_loop_budget_factor=4,
    )
    model = loopformer_hf.LoopFormerForCausalLM(cfg)

    # 1. memory, exact vs shared (untrained weights: bytes do not depend on them)
    model.eval()
    prompt = torch.randint(0, vocab, (1, 8))
    memory = {}
    for budget in args.memory_budgets:
        row = {}
        for n in [None] + args.share_n:
            out = model.generate(
                prompt,
                cache=new_cache(model.config, n),
                loop_budget=budget,
                max_new_tokens=args.new_tokens,
                do_sample=False,
                min_new_tokens=args.new_tokens,
                return_dict_in_generate=True,
            )
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            row["exact" if n is None else f"shared n={n}"] = kv_bytes(cache)
        memory[f"M={budget}"] = row

    # 2. train on the Markov language, then perplexity of cached decoding
    probs = markov_language(vocab)
    g = torch.Generator().manual_seed(1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    start = time.perf_counter()
    for step in range(args.steps):
        batch = sample(probs, 16, args.seq_len, g)
        loss = model(batch, labels=batch, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    train_s = time.perf_counter() - start
    model.eval()
    held_out = sample(probs, 16, args.seq_len, torch.Generator().manual_seed(2))
    # the language's own entropy: the best perplexity any model can reach on it
    floor = -(probs[held_out[:, :-2], held_out[:, 1:-1]].gather(-1, held_out[:, 2:, None]).log()).mean().item()
    quality = {}
    for budget in (cfg.num_loops,):
        row = {"exact": math.exp(decode_nll(model, held_out, args.prompt_len, budget))}
        for n in args.share_n:
            row[f"shared n={n}"] = math.exp(decode_nll(model, held_out, args.prompt_len, budget, n))
        quality[f"M={budget}"] = row
    report = {
        "config": vars(args),
        "kv_bytes": memory,
        "perplexity": quality,
        "train_s": train_s,
        "final_train_loss": loss.item(),
        "language_perplexity_floor": math.exp(floor),
    }

    names = list(next(iter(memory.values())))
    print("KV bytes held after a prompt of 8 and", args.new_tokens, "decoded tokens (k=1, d=64, fp32):")
    print(f"{'budget':>7} | " + " | ".join(f"{n:>12}" for n in names))
    for key, row in memory.items():
        print(f"{key:>7} | " + " | ".join(f"{row[n]:12d}" for n in names))
    print(
        f"perplexity of cached decoding after {args.steps} training steps ({train_s:.0f} s; train loss "
        f"{loss.item():.3f}; the language's floor {math.exp(floor):.2f}):"
    )
    for key, row in quality.items():
        print(f"{key:>7} | " + " | ".join(f"{n} {v:.3f}" for n, v in row.items()))
    if args.output:
        write_json(args.output, report)
    return report


if __name__ == "__main__":
    main()
