"""A text corpus through `datasets`, for `prepare` and for streamed training: the documents (a Hub dataset or local
files, Arrow-backed or streamed), their seeded split into train and validation by whole documents, their tokens
(each document followed by EOS, as the authors' prepare scripts write them), and, for streaming, their packing into
the authors' windows.

Nothing here holds the corpus in memory: the functions are `map` functions over batches of documents.
"""

import hashlib
import os
import re
from functools import partial

import numpy as np
from looped_training.prepare_folder import check_text_file

TEXT_SUFFIXES = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_documents(dataset_name=None, dataset_config_name=None, train_files=None, text_column="text", streaming=False):
    """The documents as a `datasets` Dataset (Arrow, memory-mapped) or, with `streaming`, an IterableDataset, with one
    column `text`. `train_files`: .txt files (each file one document) or folders of them, or .json/.jsonl/.csv/.parquet
    files whose `text_column` holds one document a row. A `--dataset_name` that is a local folder or file of .txt is
    read as `--train_files` reads it (one document a file; `datasets`' own text builder would make one a line).
    Every local text file is checked first (`check_text_file`): an undecodable one is refused in one line naming it."""
    import datasets

    if (dataset_name is None) == (not train_files):
        raise ValueError(
            f"Give exactly one of --dataset_name (a datasets name or path) or --train_files (text files or folders); "
            f"got dataset_name={dataset_name!r}, train_files={train_files!r}."
        )
    local = source_files(dataset_name, train_files)
    if local is not None:
        builder, files = local
        for path in files:
            if builder in ("text", "json", "csv"):
                check_text_file(path)
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        load = partial(datasets.load_dataset, builder, data_files=files, **kwargs)
        if builder == "text":
            text_column = "text"
    else:
        load = partial(datasets.load_dataset, dataset_name, dataset_config_name)
    try:
        ds = load(split="train", streaming=streaming)
    except datasets.exceptions.DatasetGenerationError as e:
        cause = e.__cause__ or e
        raise ValueError(
            f"{dataset_name or train_files!r} does not read as a corpus ({type(cause).__name__}: "
            f"{str(cause).strip().splitlines()[0] if str(cause).strip() else ''})."
        ) from None
    names = ds.column_names
    if names is not None and text_column not in names:
        raise ValueError(f"--text_column {text_column!r} is not a column of the corpus; it has {names}.")
    if names is not None:
        ds = ds.select_columns([text_column])
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def source_files(dataset_name, train_files):
    """(datasets builder, sorted file list) of the local files a corpus reads: `--train_files`, or a `--dataset_name`
    that is a local folder or file of .txt; None for anything else (a Hub dataset, a folder `datasets` reads with
    its own builder)."""
    if train_files:
        return data_files(train_files)
    if dataset_name is not None and os.path.isfile(dataset_name) and dataset_name.lower().endswith(".txt"):
        return data_files([dataset_name])
    if dataset_name is not None and os.path.isdir(dataset_name):
        check_readable_folder(dataset_name, "--dataset_name")
        names = [n for _, _, files in os.walk(dataset_name) for n in files if not n.startswith(".")]
        if names and all(n.lower().endswith(".txt") for n in names):
            return data_files([dataset_name])
    return None


def fingerprint(dataset_name, train_files):
    """What identifies the local source files' contents without reading them: each file's path, size and mtime (a
    rerun of prepare over changed files is not taken for the same corpus); None for a Hub dataset."""
    local = source_files(dataset_name, train_files)
    if local is None and dataset_name is not None and os.path.exists(dataset_name):
        local = (None, sorted(os.path.join(r, n) for r, _, files in os.walk(dataset_name) for n in files))
    if local is None:
        return None
    return [[os.path.abspath(p), st.st_size, st.st_mtime_ns] for p in local[1] for st in [os.stat(p)]]


def check_readable_folder(folder, flag):
    try:
        os.listdir(folder)
    except PermissionError as e:
        raise ValueError(f"{flag} entry {folder!r} cannot be read ({e.strerror}).") from None


def data_files(train_files):
    """(datasets builder, sorted file list) of `--train_files`: one kind of file, folders read for .txt."""
    import glob

    paths = []
    for entry in train_files:
        if os.path.isdir(entry):
            check_readable_folder(entry, "--train_files")
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


PIECE_CHARS = 1 << 18  # a longer document is tokenized in pieces of about this many characters (`pieces`)
# where a piece may end: before a space that follows a non-space; failing that, before any whitespace after one
CUT_AT_SPACE, CUT_AT_WHITESPACE = re.compile(r"(?<=\S) "), re.compile(r"(?<=\S)\s")


def is_validation(texts, fraction, seed):
    """Whether each document is held out: a seeded hash of its text below `fraction`. The split needs no permutation
    in memory, is the same streamed or not, on any rank and in any order, and keeps a duplicated document on one
    side. A long text is hashed a piece at a time (the same digest: UTF-8 of a concatenation is the concatenation)."""
    key = int(seed).to_bytes(8, "little", signed=True)
    hashes = []
    for t in texts:
        h = hashlib.blake2b(digest_size=8, key=key)
        t = t or ""
        for start in range(0, len(t), PIECE_CHARS):
            h.update(t[start : start + PIECE_CHARS].encode())
        hashes.append(int.from_bytes(h.digest(), "little"))
    return np.asarray(hashes, dtype=np.float64) / 2.0**64 < fraction


def pieces(text, size=PIECE_CHARS):
    """`text` cut into pieces of at least size/2 characters, each cut just before a space that follows a non-space
    (else before any whitespace that follows one; a text with neither stays whole). A byte-level BPE (GPT-2's
    pre-tokenizer, or this package's) never joins a non-space and the whitespace after it into one pre-token, and
    its pre-tokens depend on no text before them, so the pieces' tokens, joined, are the whole text's: memory stays
    flat in the length of a document (tests/training/loopformer/test_corpora.py checks the equality)."""
    start = 0
    while len(text) - start > size:
        at = start + size // 2
        m = CUT_AT_SPACE.search(text, at) or CUT_AT_WHITESPACE.search(text, at)
        if m is None:
            break
        yield text[start : m.start()]
        start = m.start()
    yield text[start:]


class Tokenize:
    """The map function of prepare and of streamed training: each document's ids followed by EOS (the authors'
    `ids.append(eos_id)`) as an array of the corpus dtype, and whether it is held out. An empty document gives no
    token (theirs are skipped) but keeps its row, so that rows and documents stay one to one. Text that spells a
    special token (a literal `<|endoftext|>`) is tokenized as text: a document never holds an EOS but its last. A
    document longer than `PIECE_CHARS` is tokenized in `pieces`."""

    def __init__(self, tokenizer, dtype, validation_fraction, seed):
        self.tokenizer, self.dtype = tokenizer, np.dtype(dtype)
        self.validation_fraction, self.seed = validation_fraction, seed

    def ids(self, texts):
        return self.tokenizer(
            texts, add_special_tokens=False, return_attention_mask=False, verbose=False, split_special_tokens=True
        )["input_ids"]

    def __call__(self, batch):
        texts = [t or "" for t in batch["text"]]
        out = [None] * len(texts)
        group, size = [], 0
        for i, t in enumerate(texts):  # short documents a group of at most PIECE_CHARS characters a call
            if not t:
                out[i] = np.zeros(0, self.dtype)  # an empty document: no token, its row kept
                continue
            if len(t) > PIECE_CHARS:
                out[i] = self.document(t)
                continue
            if size + len(t) > PIECE_CHARS and group:
                self.tokenize_group(texts, group, out)
                group, size = [], 0
            group.append(i)
            size += len(t)
        self.tokenize_group(texts, group, out)
        return {
            "input_ids": out,
            "validation": is_validation(texts, self.validation_fraction, self.seed).tolist(),
        }

    def tokenize_group(self, texts, group, out):
        """The ids of the documents `group` (indices into `texts`) by one call, each as an array right away: what
        the tokenizer holds at a time is at most PIECE_CHARS characters' encodings, whatever the batch."""
        eos = self.tokenizer.eos_token_id
        for i, ids in zip(group, self.ids([texts[i] for i in group]) if group else []):
            out[i] = np.asarray([*ids, eos], dtype=self.dtype)

    def document(self, text):
        """A long document's ids, tokenized a piece at a time (`pieces`), and its EOS."""
        parts = [np.asarray(self.ids([p])[0], dtype=self.dtype) for p in pieces(text)]
        return np.concatenate([*parts, np.asarray([self.tokenizer.eos_token_id], self.dtype)])


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
