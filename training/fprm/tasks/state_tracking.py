"""A5 / S5 state tracking (Merrill et al., "The Illusion of State"): a sequence of group elements, and at every
position the running product of the prefix so far.

Elements are permutations of {0..n-1} in lexicographic order (S5: 120, A5: the 60 even ones; the smaller S3, S4 and
A4 share the format, for quick runs and tests). Tokens: 0 = pad,
element i -> i + 1, for inputs and labels alike (`vocab_size = |G| + 1`); padded label positions are -100.
The running product is p_t = p_{t-1} · g_t with (p · g)(i) = g(p(i)): apply the prefix, then the new element.
"""

import itertools
import random

import torch
from datasets import Dataset, DatasetDict


GROUPS = ("S5", "A5", "S4", "A4", "S3")
PAD_ID = 0
IGNORE_INDEX = -100


def _parity(perm):
    inversions = sum(1 for i in range(len(perm)) for j in range(i + 1, len(perm)) if perm[i] > perm[j])
    return inversions % 2


def group_elements(group):
    if group not in GROUPS:
        raise ValueError(f"`group` must be one of {GROUPS}, got {group!r}.")
    perms = list(itertools.permutations(range(int(group[1]))))
    return perms if group[0] == "S" else [p for p in perms if _parity(p) == 0]


def multiplication_table(group):
    """table[a][b] = index of a · b (apply a, then b)."""
    elements = group_elements(group)
    index = {p: i for i, p in enumerate(elements)}
    return [[index[tuple(b[i] for i in a)] for b in elements] for a in elements]


def vocab_size(group):
    return len(group_elements(group)) + 1


def running_products(sequence, table):
    out, state = [], None
    for g in sequence:
        state = g if state is None else table[state][g]
        out.append(state)
    return out


def _rows(count, lengths, pad_to, table, rng):
    rows = {"input_ids": [], "labels": [], "length": []}
    size = len(table)
    for _ in range(count):
        length = rng.randint(*lengths)
        seq = [rng.randrange(size) for _ in range(length)]
        prods = running_products(seq, table)
        pad = pad_to - length
        rows["input_ids"].append([g + 1 for g in seq] + [PAD_ID] * pad)
        rows["labels"].append([p + 1 for p in prods] + [IGNORE_INDEX] * pad)
        rows["length"].append(length)
    return rows


def build_state_tracking_dataset(
    group="S5",
    num_train=10000,
    num_test=1000,
    train_length=32,
    min_train_length=None,
    test_length=128,
    pad_train_to=None,
    seed=0,
):
    """'train': sequences of length in [min_train_length, train_length] (default: exactly train_length), padded to
    `pad_train_to` (default train_length; the authors' build_state_tracking_dataset pads to the test length, 128:
    the loss and gradients are the same under causal attention and a causal conv, but the halting residual, a
    maximum over every position, also reads the padded ones);
    'test': `num_test` sequences of length `test_length`, for per-prefix accuracy at every k <= test_length."""
    table = multiplication_table(group)
    min_train_length = train_length if min_train_length is None else min_train_length
    pad_train_to = train_length if pad_train_to is None else pad_train_to
    if not 1 <= min_train_length <= train_length <= pad_train_to:
        raise ValueError(
            f"Need 1 <= min_train_length <= train_length <= pad_train_to, got {min_train_length}, {train_length}, "
            f"{pad_train_to}."
        )
    if not isinstance(test_length, int) or test_length < 1:
        raise ValueError(f"`test_length` must be a positive integer, got {test_length!r}.")
    rng = random.Random(seed)
    train = _rows(num_train, (min_train_length, train_length), pad_train_to, table, rng)
    test = _rows(num_test, (test_length, test_length), test_length, table, rng)
    return DatasetDict({"train": Dataset.from_dict(train), "test": Dataset.from_dict(test)})


class StateTrackingStream(torch.utils.data.IterableDataset):
    """Endless fresh training sequences with lengths uniform in [min_length, max_length], padded to max_length.

    `max_length` may be raised while training (a length curriculum,
    `looped_training.fprm.callbacks.LengthCurriculumCallback`): the next sequence drawn uses the new value. Fresh samples
    every step rather than a fixed set, so a sample's deep-supervision segments are the only repeats (the group
    table is then learned, not a training set).
    """

    def __init__(self, group="S5", min_length=2, max_length=4, seed=0, pad_to=None):
        self.table = multiplication_table(group)
        self.min_length, self.seed = min_length, seed
        if pad_to is not None and (not isinstance(pad_to, int) or pad_to < 1):
            raise ValueError(f"`pad_to` must be None or a positive integer, got {pad_to!r}.")
        self.pad_to = pad_to
        self.set_max_length(max_length)

    def set_max_length(self, max_length):
        if not isinstance(max_length, int) or max_length < self.min_length:
            raise ValueError(f"`max_length` must be an integer >= min_length={self.min_length}, got {max_length!r}.")
        self.max_length = max_length

    def sample(self, count, rng):
        """`count` rows at the current maximum length, as lists (input_ids, labels, length), padded to the
        current maximum length or to `pad_to` if that is longer."""
        return _rows(
            count, (self.min_length, self.max_length), max(self.max_length, self.pad_to or 0), self.table, rng
        )

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.seed * 1009 + (info.id if info else 0))
        while True:
            row = self.sample(1, rng)
            yield {"input_ids": row["input_ids"][0], "labels": row["labels"][0]}


__all__ = [
    "StateTrackingStream",
    "build_state_tracking_dataset",
    "group_elements",
    "multiplication_table",
    "running_products",
    "vocab_size",
]
