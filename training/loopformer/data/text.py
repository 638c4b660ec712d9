"""Plain text for causal LM training, in memory (small runs): a Hugging Face `datasets` dataset or local text files (a
folder of .txt files such as ../shared/data/shakespeare works), read as `prepare` reads them (one document a .txt
file, undecodable files refused naming them). Whole documents are held out by prepare's seeded hash
(`--validation_fraction` means the same on every path), then each document is tokenized (a long one in pieces cut
before a space, never mid-word), followed by EOS, and the stream is cut into blocks of `block_size` tokens."""

import random

from looped_training.loopformer.data import corpus


def read_text_documents(dataset_name=None, dataset_config_name=None, train_files=None, text_column="text"):
    """A list of documents (strings) from a `datasets` dataset (its train split) or from local files/folders, as
    `corpus.load_documents` reads them (one document a .txt file, for `dataset_name` a folder of .txt too)."""
    if (dataset_name is None) == (not train_files):
        raise ValueError(
            f"Give exactly one of `dataset_name` (a datasets name or path) or `train_files` (text files or folders); "
            f"got dataset_name={dataset_name!r}, train_files={train_files!r}."
        )
    ds = corpus.load_documents(dataset_name, dataset_config_name, train_files, text_column)
    return [t for t in ds["text"] if t and t.strip()]


def split_documents(docs, validation_fraction=0.05, seed=0, max_chars=None):
    """(train documents, validation documents): whole documents held out by prepare's seeded hash of their text
    (`corpus.is_validation`, as prepare and streaming split them), the training documents in a seeded order.
    `max_chars` caps the training text (the last document kept is cut before a space) and the validation text at a
    tenth of it (small CPU runs)."""
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"`validation_fraction` must be in [0, 1), got {validation_fraction!r}.")
    docs = list(docs)
    held = corpus.is_validation(docs, validation_fraction, seed)
    train = [d for d, h in zip(docs, held) if not h]
    valid = [d for d, h in zip(docs, held) if h]
    random.Random(seed).shuffle(train)
    if max_chars is not None:
        train, valid = _cap(train, max_chars), _cap(valid, max(max_chars // 10, 1))
    return train, valid


def _cap(docs, chars):
    kept = []
    for d in docs:
        if chars <= 0:
            break
        if len(d) > chars:
            d = d[:chars].rsplit(" ", 1)[0] if " " in d[:chars] else d[:chars]
        kept.append(d)
        chars -= len(d)
    return kept


def token_ids(text, tokenizer):
    """`text`'s ids, a long text tokenized in `corpus.pieces` (the whole text's tokens for a byte-level BPE)."""
    ids = []
    for piece in corpus.pieces(text):
        ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def chunk_text(text, tokenizer, block_size, window_targets=False):
    """Rows of exactly `block_size` tokens (input_ids, attention_mask, labels = input_ids); the tail is dropped.
    `text`: a list of documents, each followed by the tokenizer's EOS (as prepare writes them), or one string.

    With `window_targets`, each row also holds `shift_labels`, the `block_size` tokens that follow its own, so that a
    window of T tokens trains T next-token targets (x = data[i:i+T], y = data[i+1:i+T+1], as the authors' get_batch)
    where run_clm's rows train T - 1."""
    if isinstance(text, str):
        ids = token_ids(text, tokenizer)
    else:
        ids = []
        for doc in text:
            ids += [*token_ids(doc, tokenizer), tokenizer.eos_token_id]
    n = (len(ids) - window_targets) // block_size
    if n <= 0:
        raise ValueError(
            f"The text holds {len(ids)} tokens, fewer than one block of block_size={block_size}"
            f"{' plus its next-token target' if window_targets else ''}."
        )
    rows = [ids[i * block_size : (i + 1) * block_size] for i in range(n)]
    data = {"input_ids": rows, "attention_mask": [[1] * block_size for _ in rows], "labels": [list(r) for r in rows]}
    if window_targets:
        data["shift_labels"] = [ids[i * block_size + 1 : (i + 1) * block_size + 1] for i in range(n)]
    return data
