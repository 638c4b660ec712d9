"""LoopFormer on a CUDA device: cache exactness, generate in fp32/fp16/bf16, halt_eps, and cached-generate speed by
budget. One short script for a lent GPU: python -m benchmarks.cuda_check [--output results.json]"""

import argparse
import json
import time

import torch
import transformers

import loopformer_hf
from loopformer_hf.modeling_loopformer import CACHE_FIELD


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default="benchmarks/results/cuda_check.json")
    args = parser.parse_args()
    dev = "cuda"
    res = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0),
    }
    torch.manual_seed(0)
    cfg = loopformer_hf.LoopFormerConfig(
        vocab_size=512,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_loops=4,
        max_position_embeddings=2048,
    )
    model = loopformer_hf.LoopFormerForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "adaLN" in n:
                p.normal_(0, 0.05)
    model = model.to(dev).eval()
    ids = torch.randint(3, 512, (2, 40), device=dev)
    # (a) cached prefill + decode == uncached, fp32, every budget
    errs = {}
    with torch.no_grad():
        for M in range(1, 5):
            full = model(ids, loop_budget=M, use_cache=False).logits
            out = model(ids[:, :20], loop_budget=M)
            pieces = [out.logits]
            for i in range(20, 40):
                out = model(ids[:, i : i + 1], loop_budget=M, **{CACHE_FIELD: getattr(out, CACHE_FIELD)})
                pieces.append(out.logits)
            errs[M] = (torch.cat(pieces, 1) - full).abs().max().item()
    res["cache_max_abs_err_fp32"] = errs
    g1 = model.generate(ids[:, :8], max_new_tokens=32, min_new_tokens=32, do_sample=False, loop_budget=3)
    g2 = model.generate(
        ids[:, :8], max_new_tokens=32, min_new_tokens=32, do_sample=False, loop_budget=3, use_cache=False
    )
    res["greedy_cached_equals_uncached"] = bool(torch.equal(g1, g2))
    for dtype in (torch.float16, torch.bfloat16):
        m = model.to(dtype)
        with torch.no_grad():
            lo = m(ids, loop_budget=4).logits
        g = m.generate(ids[:, :8], max_new_tokens=16, do_sample=False, loop_budget=2, halt_eps=0.3)
        res[f"{dtype}_finite"] = bool(torch.isfinite(lo).all()) and g.shape[1] == 24
    model = model.float()
    # speed by budget, cached generate, 256 tokens
    times = {}
    prompt = ids[:1, :32]
    for rep in range(3):
        for M in (1, 2, 3, 4):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(prompt, max_new_tokens=256, min_new_tokens=256, do_sample=False, loop_budget=M)
            torch.cuda.synchronize()
            times.setdefault(M, []).append(time.perf_counter() - t)
    med = {M: sorted(v)[1] for M, v in times.items()}
    res["generate_256_tokens_s"] = med
    res["time_ratio_vs_L"] = {M: med[M] / med[4] for M in med}
    print(json.dumps(res, indent=1))
    import os

    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
