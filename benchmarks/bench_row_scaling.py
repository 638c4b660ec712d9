"""What a matrix product over half the rows costs on this machine: the ceiling of per-row loop budgets.

    .venv/bin/python -m benchmarks.bench_row_scaling [--threads 2] [--hidden_size 1024]

A mixed batch (half at M=1, half at M=L) computes loop steps 2..L over half the rows; it saves their share of the
compute only where a step over n/2 rows costs half a step over n. Timed side by side in one run: the MLP's up
projection (hidden -> 4 x hidden, fp32) at decode batches of 32, 64, 128 and 256 rows, and the ratio of each half
batch to its full one (0.5 is the saving the method promises; 1.0 is none).
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden_size", type=int, default=1024)
    parser.add_argument("--min_run_time", type=float, default=2.0, help="seconds timed per row count")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    weight = torch.randn(4 * args.hidden_size, args.hidden_size)
    rows = (32, 64, 128, 256)
    ms = {
        n: 1e3
        * Timer("F.linear(x, w)", globals={"F": F, "x": torch.randn(n, args.hidden_size), "w": weight})
        .blocked_autorange(min_run_time=args.min_run_time)
        .median
        for n in rows
    }
    print(
        f"F.linear {args.hidden_size} -> {4 * args.hidden_size}, {args.threads} thread(s): "
        + ", ".join(f"{n} rows {t:.2f} ms" for n, t in ms.items())
    )
    ratios = {n: ms[n // 2] / ms[n] for n in rows[1:]}
    print("half the rows / all: " + ", ".join(f"{n // 2}/{n} = {r:.2f}" for n, r in ratios.items()))
    return ratios


if __name__ == "__main__":
    main()
