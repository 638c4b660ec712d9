"""Tiny datasets the tests feed the models."""

import torch
from datasets import Dataset


def grid_dataset(rows=6, labels=True):
    """`rows` 4x4 grids of tokens 0..6 (seed 0) and, with `labels`, random labels 1..6."""
    g = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(0, 7, (rows, 16), generator=g).tolist()}
    if labels:
        data["labels"] = torch.randint(1, 7, (rows, 16), generator=g).tolist()
    return Dataset.from_dict(data)
