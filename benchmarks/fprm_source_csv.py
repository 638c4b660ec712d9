"""Source CSVs in the columns of the authors' Hub datasets (sapientinc/sudoku-extreme, sapientinc/maze-30x30-hard-1k:
source, question, answer, rating), written from this package's generators, for a machine that cannot reach the Hub.

    python -m benchmarks.fprm_source_csv --task sudoku --num_train 2000 --num_test 200 --output_dir data/sudoku-gen
    python -m benchmarks.fprm_source_csv --task maze --num_train 400 --num_test 50 --output_dir data/maze-gen

`looped_training.fprm.prepare --dataset DIR` then reads DIR as it reads the Hub repo. Sudoku: 9x9 puzzles with
unique solutions, '.' for blanks, rated by the node count of a backtracking solver (Sudoku-Extreme's rating is the
backtrack count of theirs: the same idea, another scale). Maze: perfect mazes carved at the given side (30 for
Maze-Hard), the answer marks the shortest path with 'o', the rating is the path length. Neither is their data: the
figures trained on them show the pipeline, not the paper's numbers.
"""

import argparse
import csv
import os

from looped_training.fprm.tasks import maze, sudoku


def sudoku_rows(count, rng, exclude):
    rows = sudoku._generate(9, count, sudoku.default_blanks_range(9), rng, exclude)
    return [
        (
            "generated",
            rows["puzzle"][i],
            "".join(str(t - sudoku.DIGIT_OFFSET) for t in rows["labels"][i]),
            rows["rating"][i],
        )
        for i in range(count)
    ]


def maze_rows(count, side, rng, seen):
    out = []
    while len(out) < count:
        question, answer, length = maze.make_maze(side, rng)
        key = "".join("".join(r) for r in question)
        if key not in seen:
            seen.add(key)
            out.append(("generated", key, "".join("".join(r) for r in answer), length))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("sudoku", "maze"), required=True)
    p.add_argument("--num_train", type=int, default=1000)
    p.add_argument("--num_test", type=int, default=200)
    p.add_argument("--maze_size", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", required=True)
    args = p.parse_args(argv)
    import random

    rng = random.Random(args.seed)
    if args.task == "sudoku":
        test = sudoku_rows(args.num_test, rng, ())
        train = sudoku_rows(args.num_train, rng, [q for _, q, _, _ in test])
    else:
        seen = set()
        test = maze_rows(args.num_test, args.maze_size, rng, seen)
        train = maze_rows(args.num_train, args.maze_size, rng, seen)
    os.makedirs(args.output_dir, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        with open(os.path.join(args.output_dir, f"{name}.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["source", "question", "answer", "rating"])
            writer.writerows(rows)
        print(f"wrote {len(rows)} rows to {os.path.join(args.output_dir, name + '.csv')}")


if __name__ == "__main__":
    main()
