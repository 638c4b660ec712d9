"""Which text a run trains on, and with which tokenizer:

- `--data_dir`: token files (prepare's output, or the authors' train.bin/val.bin), read by memmap (`TokenWindows`);
- `--streaming`: a `datasets` stream, tokenized on the fly, packed into the same windows and split across ranks with
  `split_dataset_by_node`;
- otherwise (`--train_files` / `--dataset_name`): prepared once into a token folder in datasets' cache
  (`text_cache`), then read as `--data_dir` is; without a tokenizer, prepare trains the package's byte-level BPE.

The tokenizer: `--tokenizer_name`, else the one of `--model_name_or_path`, else the corpus folder's (prepare saves
it there), else, for the authors' folder (GPT-2 ids, no metadata), `gpt2`. A tokenizer that is not the corpus
folder's own is refused: the ids in the files would mean other tokens.
"""

import logging
from functools import partial

import numpy as np
import torch
from looped_training.loopformer.data import corpus as corpus_docs
from looped_training.loopformer.data import token_files

logger = logging.getLogger(__name__)

AUTHORS_TOKENIZER = "gpt2"  # their prepare scripts' TOKENIZER
DEFAULT_BLOCK_SIZE = 128
STREAM_EVAL_WINDOWS = 256  # held-out windows of a streamed run, unless --max_eval_samples says otherwise


def check_text_flags(data_args, max_steps):
    """The data flags' mistakes, before any work."""
    corpus = data_args.dataset_name is not None or bool(data_args.train_files)
    if data_args.task != "text":
        for flag in ("data_dir", "streaming", "tokenizer_name"):
            if getattr(data_args, flag):
                raise ValueError(f"--{flag} is a flag of the text task: add --task text.")
        return
    if data_args.data_dir is not None and (corpus or data_args.streaming):
        raise ValueError(
            "--data_dir reads token files written before (by prepare, or the authors'); it does not combine with "
            "--dataset_name, --train_files or --streaming."
        )
    if data_args.streaming and not corpus:
        raise ValueError("--streaming streams --dataset_name or --train_files: give one.")
    if data_args.streaming and (max_steps is None or max_steps <= 0):
        raise ValueError("--streaming reads a corpus of unknown length: set --max_steps.")
    if data_args.max_train_chars is not None:
        raise ValueError(
            "--max_train_chars capped the in-memory text path, which is gone: text is prepared into token files and "
            "trained from them; cap the run with --max_steps (or the corpus with prepare --max_documents)."
        )
    if not data_args.window_targets:
        raise ValueError(
            "--window_targets false gave the in-memory text path's rows T - 1 targets (run_clm's), and that path is "
            "gone: every text window trains T next-token targets, as the authors' get_batch; leave the flag out."
        )
    if data_args.max_eval_samples is not None and data_args.max_eval_samples < 1:
        raise ValueError(f"--max_eval_samples must be a positive integer, got {data_args.max_eval_samples}.")


def load_tokenizer(name):
    from looped_training.loopformer.prepare import load_tokenizer as load

    return load(name)


def check_same_tokenizer(tokenizer, folder, said):
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(folder)
    if saved.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"{said} is not the tokenizer the corpus in {folder!r} was written with (its vocabulary differs): the ids "
            f"in its files would mean other tokens. Leave it out, or prepare the corpus with it."
        )


def choose_tokenizer(data_args, corpus, source_tokenizer):
    """The run's tokenizer (module docstring), or None where the package's BPE is to be trained."""
    from transformers import AutoTokenizer

    if data_args.tokenizer_name is not None:
        tokenizer, said = load_tokenizer(data_args.tokenizer_name), f"--tokenizer_name {data_args.tokenizer_name!r}"
    elif source_tokenizer is not None:
        tokenizer, said = source_tokenizer, "The tokenizer of --model_name_or_path"
    elif corpus is not None and corpus.meta is not None:
        return AutoTokenizer.from_pretrained(corpus.folder)
    elif corpus is not None:
        logger.info(
            "%s has no tokens.json (the authors' layout): its ids are read as %s's.", corpus.folder, AUTHORS_TOKENIZER
        )
        try:
            return load_tokenizer(AUTHORS_TOKENIZER)
        except ValueError as e:
            raise ValueError(
                f"--data_dir {corpus.folder!r} has no tokens.json (the authors' layout), so its ids are read as "
                f"{AUTHORS_TOKENIZER!r}'s, and that tokenizer does not load here "
                f"({str(e).split(' (', 1)[-1].rstrip('.)')}); give --tokenizer_name (a Hub id or a folder)."
            ) from None
    else:
        if data_args.streaming:
            raise ValueError(
                "--streaming needs --tokenizer_name (or --model_name_or_path): the package's BPE is trained on the "
                "whole corpus, which a stream does not hold."
            )
        return None
    if corpus is not None and corpus.meta is not None:
        check_same_tokenizer(tokenizer, corpus.folder, said)
    return tokenizer


def stream_windows(data_args, tokenizer, block_size, split, rank=0, world_size=1):
    """The windows of the streamed corpus's `split` documents ("train" or "val", by prepare's seeded hash), this
    rank's share (`split_dataset_by_node`), as torch tensors."""
    from datasets.distributed import split_dataset_by_node

    docs = corpus_docs.load_documents(
        data_args.dataset_name,
        data_args.dataset_config_name,
        data_args.train_files,
        data_args.text_column,
        streaming=True,
    )
    if world_size > 1:
        docs = split_dataset_by_node(docs, rank=rank, world_size=world_size)
    tokenize = corpus_docs.Tokenize(tokenizer, np.int64, data_args.validation_fraction, data_args.corpus_seed)
    tokenized = docs.map(tokenize, batched=True, remove_columns=["text"])
    kept = tokenized.filter(partial(_in_split, split=split), input_columns="validation", batched=True)
    packed = kept.map(corpus_docs.PackWindows(block_size), batched=True, remove_columns=["input_ids", "validation"])
    return packed.with_format("torch")


def _in_split(held, split):
    return [h == (split == "val") for h in held]


def stream_eval_windows(data_args, tokenizer, block_size):
    """The held-out windows of a streamed run, read once (the first `--max_eval_samples`, default 256) and kept in
    memory, so each evaluation reads the same windows without streaming the corpus again."""
    fraction = data_args.validation_fraction
    rows = []
    if fraction > 0:
        n = data_args.max_eval_samples or STREAM_EVAL_WINDOWS
        rows = list(stream_windows(data_args, tokenizer, block_size, "val").take(n))
    if not rows:
        raise ValueError(
            f"--streaming: no window of {block_size} tokens is held out at --validation_fraction {fraction} (no "
            f"document of the corpus fell to validation, or none is that long), so there is nothing to evaluate on; "
            f"raise --validation_fraction, or give --eval_strategy no."
        )
    return Rows(rows)


class Rows(torch.utils.data.Dataset):
    """A list of rows (dicts of tensors) as a map-style dataset."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def token_data(folder, data_args, block_size, vocab_size, evaluate=False):
    """(train, eval or None) windows of the token folder `folder` (`--data_dir`, or the text cache's), after checking
    its files against tokens.json (sizes and checksums) and that its ids fit `vocab_size`. `evaluate`, for the text
    cache's folder: refuse one where no document was held out."""
    corpus = token_files.open_corpus(folder, block_size, verify=True)
    token_files.check_vocabulary(corpus, vocab_size)
    train = token_files.TokenWindows(corpus.train, block_size, corpus.dtype, vocab_size)
    evaluation = None
    if corpus.val is None and evaluate:
        raise ValueError(
            f"No document of the corpus is held out at --validation_fraction {data_args.validation_fraction} "
            f"(whole documents are held out, by a seeded hash of their text), so there is nothing to evaluate on; "
            f"raise --validation_fraction, give more documents, or give --eval_strategy no."
        )
    if corpus.val is not None:
        evaluation = token_files.TokenWindows(corpus.val, block_size, corpus.dtype, vocab_size)
        if len(evaluation) == 0:
            logger.warning("%s holds fewer than %d tokens: no evaluation.", corpus.val, block_size + 1)
            evaluation = None
        elif data_args.max_eval_samples is not None:
            evaluation = _first(evaluation, data_args.max_eval_samples)
    return train, evaluation


def _first(dataset, n):
    import torch

    return torch.utils.data.Subset(dataset, range(min(n, len(dataset))))


def held_out_windows(data_args, tokenizer, block_size, max_rows):
    """The held-out windows of a token-file or streamed run, as tensors (input_ids, attention_mask, labels,
    shift_labels): what `evaluate` scores."""
    import torch

    if data_args.data_dir is not None:
        corpus = token_files.open_corpus(data_args.data_dir, verify=True)
        if corpus.val is None:
            raise ValueError(f"{data_args.data_dir!r} has no val.bin: nothing is held out to evaluate on.")
        windows = token_files.TokenWindows(corpus.val, block_size, corpus.dtype)
        rows = [windows[i] for i in range(min(max_rows, len(windows)))]
    else:
        rows = list(stream_windows(data_args, tokenizer, block_size, "val").take(max_rows))
    if not rows:
        raise ValueError("The held-out data holds no whole window of the run's block_size.")
    data = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "shift_labels")}
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    return data
