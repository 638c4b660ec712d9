"""N×N mazes with a shortest path as the label, over the charset "# SGo" of Maze-Hard.

Tokens: 0 = pad, 1 = '#' wall, 2 = ' ' open, 3 = 'S' start, 4 = 'G' goal, 5 = 'o' path (labels only); vocab 6.
Mazes are perfect (carved by a randomised depth-first search), so the shortest path is unique and the label
unambiguous; `extra_openings` knocks out extra walls to create loops (the label is then one BFS shortest path).
Each row: `input_ids`, `labels` (the input with the path cells between S and G marked 'o'), `path_length`.
"""

import random
from collections import deque

from datasets import Dataset, DatasetDict


CHARSET = "# SGo"
PAD_ID = 0
TOKEN = {ch: i + 1 for i, ch in enumerate(CHARSET)}
VOCAB_SIZE = len(CHARSET) + 1


def carve(size, rng, extra_openings=0.0):
    """A maze as a list of rows of characters: walls '#' and open cells ' ' (odd coordinates are rooms)."""
    grid = [["#"] * size for _ in range(size)]
    rooms = [(r, c) for r in range(1, size - 1, 2) for c in range(1, size - 1, 2)]
    start = rng.choice(rooms)
    grid[start[0]][start[1]] = " "
    stack, seen = [start], {start}
    while stack:
        r, c = stack[-1]
        options = [
            (r + dr, c + dc)
            for dr, dc in ((2, 0), (-2, 0), (0, 2), (0, -2))
            if 0 < r + dr < size - 1 and 0 < c + dc < size - 1 and (r + dr, c + dc) not in seen
        ]
        if not options:
            stack.pop()
            continue
        nr, nc = rng.choice(options)
        grid[(r + nr) // 2][(c + nc) // 2] = " "
        grid[nr][nc] = " "
        seen.add((nr, nc))
        stack.append((nr, nc))
    if extra_openings:
        walls = [
            (r, c)
            for r in range(1, size - 1)
            for c in range(1, size - 1)
            if grid[r][c] == "#" and ((r % 2 == 1) != (c % 2 == 1))
        ]
        for r, c in rng.sample(walls, int(extra_openings * len(walls))):
            grid[r][c] = " "
    return grid


def shortest_path(grid, start, goal):
    """The cells of one shortest path from start to goal (both included), by breadth-first search."""
    size = len(grid)
    parent = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            break
        r, c = cell
        for nxt in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and grid[nxt[0]][nxt[1]] != "#" and nxt not in parent:
                parent[nxt] = cell
                queue.append(nxt)
    if goal not in parent:
        return None
    path, cell = [], goal
    while cell is not None:
        path.append(cell)
        cell = parent[cell]
    return path[::-1]


def make_maze(size, rng, min_path_length=None, extra_openings=0.0):
    grid = carve(size, rng, extra_openings)
    open_cells = [(r, c) for r in range(size) for c in range(size) if grid[r][c] == " "]
    min_path_length = size if min_path_length is None else min_path_length
    best = None
    for _ in range(20):  # prefer far-apart start and goal
        start, goal = rng.sample(open_cells, 2)
        path = shortest_path(grid, start, goal)
        if best is None or len(path) > len(best[2]):
            best = (start, goal, path)
        if len(path) >= min_path_length:
            break
    start, goal, path = best
    question = [row[:] for row in grid]
    question[start[0]][start[1]] = "S"
    question[goal[0]][goal[1]] = "G"
    answer = [row[:] for row in question]
    for r, c in path[1:-1]:
        answer[r][c] = "o"
    return question, answer, len(path)


def encode(grid):
    return [TOKEN[ch] for row in grid for ch in row]


def build_maze_dataset(size=15, num_train=1000, num_test=200, extra_openings=0.0, seed=0):
    """A `DatasetDict` with 'train' and 'test' mazes (no maze in both)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 5:
        raise ValueError(f"Maze `size` must be an integer >= 5, got {size!r}.")
    if not 0.0 <= extra_openings <= 1.0:
        raise ValueError(f"`extra_openings` must be a fraction in [0, 1], got {extra_openings!r}.")
    rng = random.Random(seed)
    seen = set()
    splits = {}
    for split, count in (("test", num_test), ("train", num_train)):
        rows = {"input_ids": [], "labels": [], "path_length": []}
        while len(rows["input_ids"]) < count:
            question, answer, length = make_maze(size, rng, extra_openings=extra_openings)
            key = "".join("".join(r) for r in question)
            if key in seen:
                continue
            seen.add(key)
            rows["input_ids"].append(encode(question))
            rows["labels"].append(encode(answer))
            rows["path_length"].append(length)
        splits[split] = Dataset.from_dict(rows)
    return DatasetDict({"train": splits["train"], "test": splits["test"]})


__all__ = ["build_maze_dataset", "make_maze", "shortest_path", "carve", "VOCAB_SIZE", "TOKEN", "CHARSET"]
