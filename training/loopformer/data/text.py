"""Plain text for causal LM training: a Hugging Face `datasets` dataset or local text files (a folder of .txt
files such as ../shared/data/shakespeare works). Documents are split into train / validation by document, then
tokenized, joined with `<|endoftext|>` and cut into blocks of `block_size` tokens, as run_clm.py does."""

import glob
import os
import random


def read_text_documents(dataset_name=None, dataset_config_name=None, train_files=None, text_column="text"):
    """A list of documents (strings) from a `datasets` dataset (its train split) or from local files/folders."""
    if (dataset_name is None) == (not train_files):
        raise ValueError(
            f"Give exactly one of `dataset_name` (a datasets name or path) or `train_files` (text files or folders); "
            f"got dataset_name={dataset_name!r}, train_files={train_files!r}."
        )
    if dataset_name is not None:
        import datasets

        ds = datasets.load_dataset(dataset_name, dataset_config_name, split="train")
        if text_column not in ds.column_names:
            raise ValueError(
                f"`text_column`={text_column!r} is not a column of {dataset_name}; it has {ds.column_names}."
            )
        return [t for t in ds[text_column] if t and t.strip()]
    paths = []
    for entry in train_files:
        if os.path.isdir(entry):
            paths += sorted(glob.glob(os.path.join(entry, "**", "*.txt"), recursive=True))
        elif os.path.isfile(entry):
            paths.append(entry)
        else:
            raise ValueError(f"`train_files` entry {entry!r} is neither a file nor a folder.")
    if not paths:
        raise ValueError(f"No .txt files found in {train_files!r}.")
    docs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            docs.append(f.read())
    return docs


def split_documents(docs, validation_fraction=0.05, seed=0, max_chars=None):
    """(train_text, validation_text). Each document gives its last `validation_fraction` to validation, so both
    splits see every play/author; `max_chars` caps the training text (small CPU runs)."""
    if not 0 < validation_fraction < 1:
        raise ValueError(f"`validation_fraction` must be in (0, 1), got {validation_fraction!r}.")
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    train, valid = [], []
    for doc in docs:
        cut = int(len(doc) * (1 - validation_fraction))
        train.append(doc[:cut])
        valid.append(doc[cut:])
    train_text, valid_text = "\n".join(train), "\n".join(valid)
    if max_chars is not None:
        train_text = train_text[:max_chars]
        valid_text = valid_text[: max(max_chars // 10, 1)]
    return train_text, valid_text


def chunk_text(text, tokenizer, block_size, chunk_chars=100_000, window_targets=False):
    """Rows of exactly `block_size` tokens (input_ids, attention_mask, labels = input_ids); the tail is dropped.

    With `window_targets`, each row also holds `shift_labels`, the `block_size` tokens that follow its own, so that a
    window of T tokens trains T next-token targets (x = data[i:i+T], y = data[i+1:i+T+1], as the authors' get_batch)
    where run_clm's rows train T - 1."""
    ids = []
    for start in range(0, len(text), chunk_chars):
        ids += tokenizer(text[start : start + chunk_chars], add_special_tokens=False)["input_ids"]
    n = (len(ids) - window_targets) // block_size
    if n == 0:
        raise ValueError(
            f"The text holds {len(ids)} tokens, fewer than one block of block_size={block_size}"
            f"{' plus its next-token target' if window_targets else ''}."
        )
    rows = [ids[i * block_size : (i + 1) * block_size] for i in range(n)]
    data = {"input_ids": rows, "attention_mask": [[1] * block_size for _ in rows], "labels": [list(r) for r in rows]}
    if window_targets:
        data["shift_labels"] = [ids[i * block_size + 1 : (i + 1) * block_size + 1] for i in range(n)]
    return data
