"""A text corpus through `datasets`, for `prepare` and for streamed training: the documents (a Hub dataset or local
files, Arrow-backed or streamed), their seeded split into train and validation by whole documents, their tokens
(each document followed by EOS, as the authors' prepare scripts write them), and, for streaming, their packing into
the authors' windows.

Nothing here holds the corpus in memory: the functions are `map` functions over batches of documents.
"""

import hashlib
import os

import numpy as np

TEXT_SUFFIXES = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_documents(dataset_name=None, dataset_config_name=None, train_files=None, text_column="text", streaming=False):
    """The documents as a `datasets` Dataset (Arrow, memory-mapped) or, with `streaming`, an IterableDataset, with one
    column `text`. `train_files`: .txt files (each file one document, as the plain-text path reads them) or folders
    of them, or .json/.jsonl/.csv/.parquet files whose `text_column` holds one document a row."""
    import datasets

    if (dataset_name is None) == (not train_files):
        raise ValueError(
            f"Give exactly one of --dataset_name (a datasets name or path) or --train_files (text files or folders); "
            f"got dataset_name={dataset_name!r}, train_files={train_files!r}."
        )
    if dataset_name is not None:
        ds = datasets.load_dataset(dataset_name, dataset_config_name, split="train", streaming=streaming)
    else:
        builder, files = data_files(train_files)
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming, **kwargs)
        if builder == "text":
            text_column = "text"
    names = ds.column_names
    if names is not None and text_column not in names:
        raise ValueError(f"--text_column {text_column!r} is not a column of the corpus; it has {names}.")
    if names is not None:
        ds = ds.select_columns([text_column])
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def data_files(train_files):
    """(datasets builder, sorted file list) of `--train_files`: one kind of file, folders read for .txt."""
    import glob

    paths = []
    for entry in train_files:
        if os.path.isdir(entry):
            paths += sorted(glob.glob(os.path.join(entry, "**", "*.txt"), recursive=True))
        elif os.path.isfile(entry):
            paths.append(entry)
        else:
            raise ValueError(f"--train_files entry {entry!r} is neither a file nor a folder.")
    if not paths:
        raise ValueError(f"No .txt files found in --train_files {train_files!r}.")
    kinds = {TEXT_SUFFIXES.get(os.path.splitext(p)[1].lower(), "text") for p in paths}
    if len(kinds) > 1:
        raise ValueError(f"--train_files mixes kinds of file ({sorted(kinds)}); give one kind at a time.")
    return kinds.pop(), paths


def is_validation(texts, fraction, seed):
    """Whether each document is held out: a seeded hash of its text below `fraction`. The split needs no permutation
    in memory, is the same streamed or not, on any rank and in any order, and keeps a duplicated document on one
    side."""
    key = int(seed).to_bytes(8, "little", signed=True)
    hashes = [
        int.from_bytes(hashlib.blake2b((t or "").encode(), digest_size=8, key=key).digest(), "little") for t in texts
    ]
    return np.asarray(hashes, dtype=np.float64) / 2.0**64 < fraction


class Tokenize:
    """The map function of prepare and of streamed training: each document's ids followed by EOS (the authors'
    `ids.append(eos_id)`) as an array of the corpus dtype, and whether it is held out. An empty document gives no
    token (theirs are skipped) but keeps its row, so that rows and documents stay one to one."""

    def __init__(self, tokenizer, dtype, validation_fraction, seed):
        self.tokenizer, self.dtype = tokenizer, np.dtype(dtype)
        self.validation_fraction, self.seed = validation_fraction, seed

    def __call__(self, batch):
        texts = batch["text"]
        ids = self.tokenizer(
            [t or "" for t in texts], add_special_tokens=False, return_attention_mask=False, verbose=False
        )["input_ids"]
        eos = self.tokenizer.eos_token_id
        return {
            "input_ids": [np.asarray([*d, eos] if t else [], dtype=self.dtype) for d, t in zip(ids, texts)],
            "validation": is_validation(texts, self.validation_fraction, self.seed).tolist(),
        }


class PackWindows:
    """The map function of streamed training: the batch's documents (already tokenized, EOS after each) joined and
    cut into the authors' windows, x = data[s:s+T], y = data[s+1:s+T+1] at stride T, as TokenWindows reads a token
    file; the tail that does not fill a window is dropped, per map batch, as run_clm's group_texts drops it."""

    def __init__(self, block_size):
        self.block_size = block_size

    def __call__(self, batch):
        T = self.block_size
        flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in batch["input_ids"]] or [np.zeros(0, np.int64)])
        n = max(0, (len(flat) - T - 1) // T + 1)
        starts = np.arange(n) * T
        windows = [flat[s : s + T + 1] for s in starts]
        return {
            "input_ids": [w[:T] for w in windows],
            "labels": [w[:T] for w in windows],
            "shift_labels": [w[1:] for w in windows],
        }
