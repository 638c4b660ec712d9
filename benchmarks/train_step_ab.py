"""The training step of bench_loopformer (LoopFormer 2⊗4 against Llama with 8 layers, batch 4 × 256, RoPE) for two
source trees, in alternating fresh processes, so that a code change is compared with the code before it under the
same machine noise:

    git worktree add /tmp/before <commit>
    .venv/bin/python -m benchmarks.train_step_ab /tmp/before . --rounds 7

Each process prints one line: the median of 3 steps of each model, measured twice (LoopFormer, Llama, LoopFormer,
Llama), and LoopFormer / Llama; the last line gives each tree's mean ratio."""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch


def measure():
    """(LoopFormer s, Llama s) per training step, in this process's tree."""
    from benchmarks.bench_loopformer import FULL, build_models, train_step_fn

    torch.set_num_threads(1)
    loopformer, llama = build_models(dict(FULL), "rope")[:2]
    batch = torch.randint(1, FULL["vocab"], (FULL["batch"], FULL["seq"]), generator=torch.Generator().manual_seed(0))
    times = {"loopformer": [], "llama": []}
    for name, model in (("loopformer", loopformer), ("llama", llama)) * 2:
        step = train_step_fn(model, batch)
        step()  # warm-up
        rounds = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            rounds.append(time.perf_counter() - start)
        times[name].append(statistics.median(rounds))
    return statistics.mean(times["loopformer"]), statistics.mean(times["llama"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs=2, help="two source trees (a git worktree of the earlier commit, and this one)")
    p.add_argument("--rounds", type=int, default=7, help="processes per tree, alternating")
    args = p.parse_args(argv)
    ratios = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            # this file run as a script: its folder holds no package, so both packages come from `tree`
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--measure"],
                cwd=tree,
                env={**os.environ, "PYTHONPATH": os.path.abspath(tree)},
                capture_output=True,
                text=True,
                check=True,
            )
            package, loopformer, llama = out.stdout.split()[-3:]
            ratios[tree].append(float(loopformer) / float(llama))
            print(
                f"{package}: LoopFormer {float(loopformer):.4f} s, Llama {float(llama):.4f} s, ratio "
                f"{ratios[tree][-1]:.3f}",
                flush=True,
            )
    print("mean ratio:", ", ".join(f"{tree} {statistics.mean(r):.3f}" for tree, r in ratios.items() if r))


if __name__ == "__main__":
    if sys.argv[1:] == ["--measure"]:
        import loopformer_hf

        print(os.path.dirname(os.path.dirname(loopformer_hf.__file__)), *measure())
    else:
        main()
