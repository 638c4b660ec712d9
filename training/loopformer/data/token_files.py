"""Flat token files, as the authors' data/*/prepare*.py write them and their train.py reads them.

A corpus folder holds `train.bin` and, optionally, `val.bin`: every document's token ids one after the other, each
followed by the tokenizer's EOS, as unsigned integers (uint16 where the vocabulary fits, the authors' format; uint32
otherwise). `python -m looped_training.loopformer.prepare` writes such a folder with `tokens.json` (dtype,
tokenizer, counts) and the tokenizer beside the files; the authors' folders hold the .bin files alone (uint16 GPT-2
ids). Nothing is read into memory: `TokenWindows` maps the file and reads one window per item.
"""

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

TOKENS_FILE = "tokens.json"  # written last by prepare: a folder without it but with STAGING_DIR is unfinished
STAGING_DIR = ".prepare"
SPLITS = ("train", "val")
DTYPES = ("uint16", "uint32")
AUTHORS_DTYPE = "uint16"
SCAN_CHUNK = 1 << 24  # tokens per read when a file's largest id is looked for


def dtype_for_vocab(vocab_size):
    """The authors' uint16 where every id fits, uint32 otherwise."""
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"


class TokenWindows(torch.utils.data.Dataset):
    """Windows of `block_size` tokens of a flat token file, as the authors' `MemmapTokenDataset` over their
    `make_starts` starts: item i is `input_ids = data[s:s+T]` and `shift_labels = data[s+1:s+T+1]` with `s = i·T`,
    for every start up to n - T - 1 (n tokens in the file), as int64 tensors. `labels` is `input_ids` itself: the
    causal LM computes its loss when `labels` is given, and takes `shift_labels` as the targets, so each window trains
    T next-token targets as their `get_batch` does.

    Map-style, so the Trainer's seeded sampler orders the windows and gives each rank its share. The file is mapped
    when the first item is read (in each DataLoader worker), never held in memory. `dtype`: the file's, default the
    one `tokens.json` beside it names, else the authors' uint16. `vocab_size`: refuse a window holding an id the
    model has no embedding for (a ValueError naming the file and the window) instead of an index error inside it.
    """

    def __init__(self, path, block_size, dtype=None, vocab_size=None):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"`block_size` must be a positive integer, got {block_size!r}.")
        self.path = os.fspath(path)
        self.block_size = block_size
        self.dtype = np.dtype(dtype or file_dtype(self.path))
        self.num_tokens = count_tokens(self.path, self.dtype)
        self.vocab_size = vocab_size
        self._data = None

    def __len__(self):
        # make_starts: np.arange(0, n - T - 1 + 1, T)
        return max(0, (self.num_tokens - self.block_size - 1) // self.block_size + 1)

    def start(self, index):
        return index * self.block_size

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)} in {self.path}")
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        s, T = self.start(index), self.block_size
        window = torch.from_numpy(self._data[s : s + T + 1].astype(np.int64))
        if self.vocab_size is not None and int(window.max()) >= self.vocab_size:
            raise ValueError(
                f"{self.path}: window {index} (tokens {s}..{s + T}) holds token id {int(window.max())}, beyond the "
                f"model's vocabulary of {self.vocab_size}: the file was written with another tokenizer."
            )
        # `labels` one token longer than the input: the causal LM trains its T targets window[1:] (the authors' y),
        # and a stock Trainer keeps the column (`shift_labels`, a keyword of forward, it would drop)
        return {"input_ids": window[:T], "labels": window, "shift_labels": window[1:]}

    def __getstate__(self):  # DataLoader workers map the file themselves
        return {**self.__dict__, "_data": None}


def count_tokens(path, dtype):
    """Tokens in `path`, refusing a size that is not a whole number of `dtype` values."""
    size = os.path.getsize(path)
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(
            f"{path} holds {size} bytes, not a whole number of {np.dtype(dtype).name} tokens ({itemsize} bytes "
            f"each): the file is truncated, or its dtype is not {np.dtype(dtype).name}."
        )
    return size // itemsize


def file_sha256(path, chunk=1 << 24):
    """The sha256 of a file, read in chunks (memory flat in its size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_meta(folder):
    """The folder's tokens.json, checked for the fields train reads, or None for the authors' layout."""
    path = os.path.join(folder, TOKENS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable tokens.json ({e}): rerun prepare into this folder.") from None
    splits = meta.get("splits") if isinstance(meta, dict) else None
    if not isinstance(splits, dict) or not all(
        isinstance(splits.get(s), dict) and isinstance(splits[s].get("tokens"), int) for s in SPLITS
    ):
        raise ValueError(
            f"{path} has no 'splits' with the token counts of {list(SPLITS)} (prepare writes them): it was not written "
            f"by `python -m looped_training.loopformer.prepare`, or was edited; rerun prepare into this folder."
        )
    return meta


def file_dtype(path):
    meta = read_meta(os.path.dirname(os.path.abspath(path)))
    return meta["dtype"] if meta else AUTHORS_DTYPE


@dataclass(frozen=True)
class TokenCorpus:
    """A checked corpus folder: its files, their dtype and token counts, and tokens.json (None: the authors')."""

    folder: str
    dtype: str
    train: str
    val: str | None
    num_tokens: dict
    meta: dict | None

    @property
    def tokenizer_folder(self):
        return self.folder if self.meta is not None else None


def open_corpus(folder, block_size=None, verify=False):
    """Check a corpus folder before any work: the files exist, are whole, agree with tokens.json (their sizes; with
    `verify`, their sha256 too, read in full), and (with `block_size`) hold at least one training window."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ValueError(
            f"--data_dir {folder!r} is not a folder; give the --output_dir of prepare or a folder "
            f"holding the authors' train.bin."
        )
    try:
        os.listdir(folder)
    except PermissionError as e:
        raise ValueError(f"--data_dir {folder!r} cannot be read ({e.strerror}).") from None
    meta = read_meta(folder)
    if meta is None and os.path.isdir(os.path.join(folder, STAGING_DIR)):
        raise ValueError(
            f"--data_dir {folder!r}: prepare did not finish there (it has {STAGING_DIR}/ but no {TOKENS_FILE}); "
            f"rerun the same prepare command to finish it."
        )
    train = os.path.join(folder, "train.bin")
    if not os.path.isfile(train):
        raise ValueError(
            f"--data_dir {folder!r} has no train.bin; give the --output_dir of "
            f"`python -m looped_training.loopformer.prepare`, or a folder holding the authors' train.bin."
        )
    dtype = meta["dtype"] if meta else AUTHORS_DTYPE
    if dtype not in DTYPES:
        raise ValueError(f"{os.path.join(folder, TOKENS_FILE)} names dtype {dtype!r}; one of {DTYPES} is read.")
    val = os.path.join(folder, "val.bin")
    val = val if os.path.isfile(val) else None
    counts = {split: count_tokens(path, dtype) for split, path in (("train", train), ("val", val)) if path}
    for split, n in counts.items():
        written = meta and meta["splits"].get(split, {}).get("tokens")
        if meta and written != n:
            raise ValueError(
                f"{split}.bin in {folder!r} holds {n} tokens where {TOKENS_FILE} says {written}: the file was changed "
                f"or cut short after prepare wrote it; rerun prepare."
            )
    if meta:
        for split in SPLITS:
            if meta["splits"][split]["tokens"] and split not in counts:
                raise ValueError(
                    f"{folder!r} has no {split}.bin where {TOKENS_FILE} counts {meta['splits'][split]['tokens']} "
                    f"tokens in it: rerun prepare."
                )
    if meta and verify:
        for split, path in (("train", train), ("val", val)):
            recorded = meta["splits"][split].get("sha256") if path else None
            if recorded is None:
                continue  # tokens.json of format 1 (before checksums): the sizes were checked
            if file_sha256(path) != recorded:
                raise ValueError(
                    f"{split}.bin in {folder!r} does not have the sha256 {TOKENS_FILE} records (its bytes changed "
                    f"after prepare wrote it, its size did not): rerun prepare."
                )
    if block_size is not None and counts["train"] < block_size + 1:
        raise ValueError(
            f"{train} holds {counts['train']} tokens, fewer than one window of block_size={block_size} plus its "
            f"next-token target; give a larger corpus or a smaller --block_size."
        )
    return TokenCorpus(folder, dtype, train, val, counts, meta)


def largest_token_id(path, dtype, progress=None):
    """The largest id in a token file, read in chunks (memory flat in the file's size)."""
    data = np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
    largest = -1
    for start in range(0, len(data), SCAN_CHUNK):
        largest = max(largest, int(data[start : start + SCAN_CHUNK].max()))
        if progress is not None:
            progress.update(min(SCAN_CHUNK, len(data) - start))
    return largest


def check_vocabulary(corpus, vocab_size):
    """Refuse a corpus holding an id >= `vocab_size`: tokens.json's `max_token_id`, or a scan of the authors' files."""
    for split, path in (("train", corpus.train), ("val", corpus.val)):
        if path is None:
            continue
        if corpus.meta is not None:
            largest = corpus.meta["splits"][split]["max_token_id"]
        else:
            largest = largest_token_id(path, corpus.dtype)
        if largest >= vocab_size:
            raise ValueError(
                f"{path} holds token id {largest}, beyond the model's vocabulary of {vocab_size}: the corpus was "
                f"tokenized with another tokenizer than the model's."
            )
