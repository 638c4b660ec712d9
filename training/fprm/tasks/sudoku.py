"""Sudoku puzzles with unique solutions, generated here and rated by the search-tree size of a backtracking solver.

Sizes 4×4 (2×2 boxes), 6×6 (2×3 boxes) and 9×9 (3×3 boxes). Tokens: 0 = pad, 1 = blank, 2..n+1 = digits 1..n, so
`vocab_size = n + 2` (11 for 9×9, as Sudoku-Extreme). Each row: `input_ids` (the puzzle), `labels` (the solution),
`num_blanks`, `rating` (nodes a backtracking solver visits, the analogue of Sudoku-Extreme's backtrack count) and
`puzzle` (the question as a string, '.' for blanks). Train and test hold no puzzle in common.
"""

import random

from datasets import Dataset, DatasetDict


BOX_SHAPES = {4: (2, 2), 6: (2, 3), 9: (3, 3)}
PAD_ID, BLANK_ID = 0, 1
DIGIT_OFFSET = 1  # digit d -> token d + 1


def vocab_size(size):
    return _check_size(size) + 2


def _check_size(size):
    if size not in BOX_SHAPES:
        raise ValueError(f"Sudoku `size` must be one of {sorted(BOX_SHAPES)}, got {size!r}.")
    return size


def random_solution(size, rng):
    """A random valid grid: the canonical pattern, then digit, row-in-band, band, column-in-stack and stack shuffles."""
    br, bc = BOX_SHAPES[size]
    digits = list(range(1, size + 1))
    rng.shuffle(digits)

    def shuffled_groups(group, count):
        order = list(range(count))
        rng.shuffle(order)
        out = []
        for g in order:
            inner = list(range(group))
            rng.shuffle(inner)
            out += [g * group + i for i in inner]
        return out

    rows = shuffled_groups(br, size // br)
    cols = shuffled_groups(bc, size // bc)
    grid = [[digits[(bc * (r % br) + r // br + c) % size] for c in cols] for r in rows]
    if br == bc and rng.random() < 0.5:
        grid = [list(col) for col in zip(*grid)]
    return grid


class _Solver:
    """Bitmask backtracking with the most-constrained-cell heuristic; counts solutions (up to a limit) and nodes."""

    def __init__(self, size):
        self.size = size
        br, bc = BOX_SHAPES[size]
        self.box = [[(r // br) * (size // bc) + c // bc for c in range(size)] for r in range(size)]
        self.full = (1 << size) - 1

    def solve(self, grid, limit=2):
        n = self.size
        rows, cols, boxes = [0] * n, [0] * n, [0] * n
        empty = []
        for r in range(n):
            for c in range(n):
                v = grid[r][c]
                if v:
                    bit = 1 << (v - 1)
                    if rows[r] & bit or cols[c] & bit or boxes[self.box[r][c]] & bit:
                        return 0, 0  # contradicting givens
                    rows[r] |= bit
                    cols[c] |= bit
                    boxes[self.box[r][c]] |= bit
                else:
                    empty.append((r, c))
        self.count, self.nodes = 0, 0

        def search(cells):
            self.nodes += 1
            if not cells:
                self.count += 1
                return self.count >= limit
            best, best_mask, best_n = None, 0, n + 1
            for i, (r, c) in enumerate(cells):
                mask = self.full & ~(rows[r] | cols[c] | boxes[self.box[r][c]])
                k = bin(mask).count("1")
                if k < best_n:
                    best, best_mask, best_n = i, mask, k
                    if k <= 1:
                        break
            if best_n == 0:
                return False
            r, c = cells[best]
            rest = cells[:best] + cells[best + 1 :]
            b = self.box[r][c]
            mask = best_mask
            while mask:
                bit = mask & -mask
                mask ^= bit
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] |= bit
                done = search(rest)
                rows[r] ^= bit
                cols[c] ^= bit
                boxes[b] ^= bit
                if done:
                    return True
            return False

        search(empty)
        return self.count, self.nodes


def count_solutions(grid, limit=2):
    return _Solver(len(grid)).solve(grid, limit)[0]


def rate(grid):
    """Hardness: nodes of the backtracking search tree needed to find every solution (unique: one)."""
    return _Solver(len(grid)).solve(grid, limit=2)[1]


def make_puzzle(size, rng, target_blanks):
    """Blank cells in random order while the solution stays unique, until `target_blanks` (or no cell can go)."""
    solution = random_solution(size, rng)
    puzzle = [row[:] for row in solution]
    solver = _Solver(size)
    cells = [(r, c) for r in range(size) for c in range(size)]
    rng.shuffle(cells)
    blanks = 0
    for r, c in cells:
        if blanks >= target_blanks:
            break
        keep = puzzle[r][c]
        puzzle[r][c] = 0
        if solver.solve(puzzle, limit=2)[0] == 1:
            blanks += 1
        else:
            puzzle[r][c] = keep
    return puzzle, solution, blanks


def encode(puzzle, solution):
    input_ids = [BLANK_ID if v == 0 else v + DIGIT_OFFSET for row in puzzle for v in row]
    labels = [v + DIGIT_OFFSET for row in solution for v in row]
    return input_ids, labels


def puzzle_string(puzzle):
    return "".join("." if v == 0 else str(v) for row in puzzle for v in row)


def _generate(size, count, blanks_range, rng, exclude):
    rows = {"input_ids": [], "labels": [], "num_blanks": [], "rating": [], "puzzle": []}
    seen = set(exclude)
    attempts = 0
    while len(rows["puzzle"]) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(
                f"Could only generate {len(rows['puzzle'])} distinct {size}x{size} puzzles of the {count} asked with "
                f"blanks in {blanks_range}; ask for fewer or widen the blanks range."
            )
        puzzle, solution, blanks = make_puzzle(size, rng, rng.randint(*blanks_range))
        key = puzzle_string(puzzle)
        if key in seen or blanks < blanks_range[0]:
            continue
        seen.add(key)
        input_ids, labels = encode(puzzle, solution)
        rows["input_ids"].append(input_ids)
        rows["labels"].append(labels)
        rows["num_blanks"].append(blanks)
        rows["rating"].append(rate(puzzle))
        rows["puzzle"].append(key)
    return rows


def default_blanks_range(size):
    """From easy to as hard as the generator reaches quickly."""
    return {4: (4, 12), 6: (10, 26), 9: (40, 58)}[size]


def build_sudoku_dataset(size=4, num_train=1000, num_test=200, blanks_range=None, seed=0):
    """A `DatasetDict` with disjoint 'train' and 'test' splits of `size`×`size` puzzles with unique solutions."""
    _check_size(size)
    for name, value in (("num_train", num_train), ("num_test", num_test)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    blanks_range = tuple(blanks_range or default_blanks_range(size))
    cells = size * size
    if len(blanks_range) != 2 or not (0 <= blanks_range[0] <= blanks_range[1] < cells):
        raise ValueError(f"`blanks_range` must be (low, high) with 0 <= low <= high < {cells}, got {blanks_range!r}.")
    rng = random.Random(seed)
    test = _generate(size, num_test, blanks_range, rng, exclude=())
    train = _generate(size, num_train, blanks_range, rng, exclude=test["puzzle"])
    return DatasetDict({"train": Dataset.from_dict(train), "test": Dataset.from_dict(test)})


__all__ = ["build_sudoku_dataset", "count_solutions", "rate", "make_puzzle", "random_solution", "vocab_size"]
