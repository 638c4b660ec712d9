"""Tokenize a text corpus into the flat token files LoopFormer trains on (`train --task text --data_dir DIR`), the
format of the authors' data/*/prepare*.py: every document's ids followed by the tokenizer's EOS, one after the other,
as uint16 where the vocabulary fits (uint32 otherwise).

    python -m looped_training.loopformer.prepare --train_files ../shared/data/shakespeare --output_dir data/shakespeare
    python -m looped_training.loopformer.prepare --dataset_name HuggingFaceFW/fineweb-edu \\
        --dataset_config_name sample-10BT --tokenizer_name gpt2 --streaming --validation_fraction 0.0005 \\
        --output_dir data/fineweb-edu

The corpus is read as train reads it (`--dataset_name` or `--train_files`, `--text_column`), through `datasets`:
tokenized by a batched `map` over `--num_proc` processes into Arrow files (or, with `--streaming`, as the documents
arrive), then appended to the token files a batch at a time, so memory stays flat in the corpus size. Whole
documents go to `val.bin` by a seeded hash of their text (`--validation_fraction`, `--seed`).

The folder then holds `train.bin`, `val.bin` (when a document was held out), the tokenizer and `tokens.json` (dtype,
tokenizer, vocabulary size, EOS id, tokens, documents and a sha256 per split, source), written last. Until then the
work lies in `DIR/.prepare/`: a killed run, rerun with the same flags, goes on from its last progress record (the
Arrow files of a finished `map` are kept); a rerun with other flags, or over source files whose sizes or mtimes
changed, starts over. The finished files are staged there whole (their checksums and `tokens.json` included) before
the first is moved in, so a kill anywhere, then the same command, gives the bytes of an uninterrupted run; a file is
never padded or extended to a recorded size. Train refuses a folder without `tokens.json`, or whose files differ from
its record in size or checksum. A lock (`DIR/.prepare.lock`) keeps a second prepare out of the folder while one runs.
`--tokenizer_name` names any AutoTokenizer (a Hub id or a folder); without it the package's byte-level BPE is
trained on the training documents (not with `--streaming`). A document longer than 256k characters is tokenized in
pieces cut before a space (memory flat in the document's length; the same tokens for a byte-level BPE); a non-UTF-8
or binary text file is refused in one line naming it, before any work.
"""

import hashlib
import json
import logging
import os
import shutil
import sys

import numpy as np
from looped_training.loopformer.arguments import PrepareArguments, check_args
from looped_training.loopformer.data.corpus import Tokenize, fingerprint, load_documents
from looped_training.loopformer.data.token_files import (
    SPLITS,
    STAGING_DIR,
    TOKENS_FILE,
    count_tokens,
    dtype_for_vocab,
    file_sha256,
    read_meta,
)
from looped_training.prepare_folder import folder_lock
from transformers import HfArgumentParser

PROG = "python -m looped_training.loopformer.prepare"
FORMAT_VERSION = 2  # 2: a sha256 per split
PROGRESS_FILE = "progress.json"
SETTINGS_FILE = "settings.json"
TOKENIZER_STAGING = "tokenizer"  # the tokenizer's files, staged beside the token files before they move in
CHECKPOINT_TOKENS = 1 << 24  # tokens written between two progress records
logger = logging.getLogger(__name__)


def load_tokenizer(name):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--tokenizer_name {name!r} does not load as an AutoTokenizer ({str(e).splitlines()[0]})"
        ) from None
    check_eos(tokenizer, name)
    return tokenizer


def check_eos(tokenizer, name):
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"The tokenizer {name!r} has no EOS token; each document is ended by it. Give a tokenizer with an "
            f"eos_token (or set one and save it to a folder)."
        )


def settings_of(args, tokenizer):
    """What decides the files' bytes: a rerun with other settings starts over."""
    keep = (
        "dataset_name",
        "dataset_config_name",
        "train_files",
        "text_column",
        "tokenizer_name",
        "tokenizer_vocab_size",
        "validation_fraction",
        "seed",
        "streaming",
        "max_documents",
    )
    settings = {k: getattr(args, k) for k in keep}
    if args.train_files:
        settings["train_files"] = [os.path.abspath(p) for p in args.train_files]
    settings["source_files"] = fingerprint(args.dataset_name, args.train_files)
    if tokenizer is not None:
        vocab = tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else json.dumps(tokenizer.get_vocab())
        settings["tokenizer_sha256"] = hashlib.sha256(vocab.encode()).hexdigest()
    return settings


def write_json(path, data):
    """Write `data` whole or not at all (a temporary file, fsync'd and renamed)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def phase(name):
    """A boundary between two steps of prepare, where a kill leaves the folder in a state a rerun finishes from (the
    kill-point test stops the process at each)."""


def what_differs(old, new):
    """Why a corpus prepared with the settings `old` is not the one asked for (`new`), for a message."""
    if {k: v for k, v in old.items() if k != "source_files"} == {k: v for k, v in new.items() if k != "source_files"}:
        was = {p: (size, mtime) for p, size, mtime in old.get("source_files") or []}
        now = {p: (size, mtime) for p, size, mtime in new.get("source_files") or []}
        changed = sorted(p for p in was.keys() | now.keys() if was.get(p) != now.get(p))
        return f"from source files that changed since ({len(changed)} differ in size, mtime or presence: {changed[0]})"
    flags = sorted(k for k in new if k != "source_files" and old.get(k) != new[k])
    return f"with other flags ({', '.join(flags) or 'format'})"


def claim_folder(args, settings):
    """The staging folder of this run, after refusing or clearing what `--output_dir` holds: None when the folder
    already holds this very corpus (nothing to do)."""
    out, staging = args.output_dir, os.path.join(args.output_dir, STAGING_DIR)
    meta = read_meta(out) if os.path.isdir(out) else None
    if meta is not None and meta.get("settings") == settings:
        if os.path.isdir(staging):  # a kill after tokens.json moved in, before the staging folder went
            shutil.rmtree(staging)
        return None
    stale = meta is not None or (
        not os.path.isdir(staging) and any(os.path.exists(os.path.join(out, n)) for n in ("train.bin", "val.bin"))
    )
    if stale and not args.overwrite_output_dir:
        what = (
            f"a corpus prepared {what_differs(meta.get('settings') or {}, settings)}"
            if meta is not None
            else "a train.bin that prepare did not write"
        )
        raise ValueError(
            f"--output_dir {out!r} holds {what}; give --overwrite_output_dir to replace it, or another --output_dir."
        )
    if stale:  # tokens.json first: from here on the old files never pass for a finished corpus
        for name in (TOKENS_FILE, "train.bin", "val.bin"):
            if os.path.exists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
    staged = read_json(os.path.join(staging, SETTINGS_FILE))
    if staged != settings and os.path.isdir(staging):
        why = what_differs(staged, settings) if isinstance(staged, dict) else "of unreadable settings"
        logger.warning("%s holds an unfinished prepare %s: starting over.", staging, why)
        shutil.rmtree(staging)
    os.makedirs(staging, exist_ok=True)
    write_json(os.path.join(staging, SETTINGS_FILE), settings)
    return staging


def train_tokenizer(docs, args, staging):
    """The package's BPE on the training documents, kept in the staging folder so that a rerun uses the same."""
    from looped_training.loopformer.data.corpus import is_validation
    from looped_training.loopformer.data.tokenizer import train_bpe_tokenizer
    from transformers import AutoTokenizer

    folder = os.path.join(staging, "bpe")
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(folder)

    def texts():
        for batch in docs.iter(batch_size=args.batch_size):
            held = is_validation(batch["text"], args.validation_fraction, args.seed)
            yield from (t for t, h in zip(batch["text"], held) if t and not h)

    tokenizer = train_bpe_tokenizer(texts(), args.tokenizer_vocab_size)
    if os.path.isdir(folder + ".tmp"):
        shutil.rmtree(folder + ".tmp")
    tokenizer.save_pretrained(folder + ".tmp")
    os.replace(folder + ".tmp", folder)
    return AutoTokenizer.from_pretrained(folder)  # as a rerun reads it: the same files saved after a kill or not


class SplitWriter:
    """Appends token batches to `train.bin.partial` and `val.bin.partial` in the staging folder, and records its
    progress (documents read, bytes, counts) after fsync'ing them, so that a rerun truncates the files to the last
    record and goes on from its document."""

    def __init__(self, staging, dtype):
        self.staging, self.dtype = staging, np.dtype(dtype)
        self.progress = read_json(os.path.join(staging, PROGRESS_FILE))
        sizes = {s: os.path.getsize(self.path(s)) if os.path.exists(self.path(s)) else 0 for s in ("train", "val")}
        recorded = self.progress and {s: r["tokens"] * self.dtype.itemsize for s, r in self.progress["splits"].items()}
        if recorded and any(sizes[s] < recorded[s] for s in sizes):
            # never padded to the record: the files lost bytes the record counts, so the work starts over
            logger.warning("%s holds less than its progress record counts: tokenizing from the start.", staging)
            self.progress = None
        self.progress = self.progress or {
            "documents_read": 0,
            "finished": False,
            "splits": {s: {"tokens": 0, "documents": 0, "max_token_id": -1} for s in ("train", "val")},
        }
        self.files = {}
        for split, record in self.progress["splits"].items():
            f = open(self.path(split), "r+b" if os.path.exists(self.path(split)) else "wb")  # noqa: SIM115 (close())
            f.truncate(record["tokens"] * self.dtype.itemsize)  # what followed the last record is written again
            f.seek(0, os.SEEK_END)
            self.files[split] = f
        self.unrecorded = 0

    def path(self, split):
        return os.path.join(self.staging, f"{split}.bin.partial")

    def write(self, table):
        import pyarrow.compute as pc

        held = table.column("validation").combine_chunks()
        ids = table.column("input_ids").combine_chunks()
        for split, mask in (("train", pc.invert(held)), ("val", held)):
            docs = ids.filter(mask)
            flat = docs.flatten().to_numpy(zero_copy_only=False).astype(self.dtype, copy=False)
            record = self.progress["splits"][split]
            record["documents"] += int(pc.sum(pc.greater(pc.list_value_length(docs), 0)).as_py() or 0)
            record["tokens"] += len(flat)
            if len(flat):
                record["max_token_id"] = max(record["max_token_id"], int(flat.max()))
                self.files[split].write(flat.tobytes())
            self.unrecorded += len(flat)
        self.progress["documents_read"] += table.num_rows
        if self.unrecorded >= CHECKPOINT_TOKENS:
            self.record()

    def record(self, finished=False):
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        self.progress["finished"] = finished
        write_json(os.path.join(self.staging, PROGRESS_FILE), self.progress)
        self.unrecorded = 0
        phase("finished" if finished else "recorded")

    def close(self):
        for f in self.files.values():
            f.close()


def tokenized_rows(docs, tokenize, args, staging, dtype, done):
    """The documents after `done` as Arrow batches of (input_ids, validation): a `map` over `--num_proc` processes
    into Arrow files in the staging folder (a rerun reuses a finished one), or the stream tokenized as it arrives."""
    import datasets

    features = datasets.Features(
        {"input_ids": datasets.Sequence(datasets.Value(dtype)), "validation": datasets.Value("bool")}
    )
    kwargs = {"batched": True, "batch_size": args.batch_size, "remove_columns": ["text"], "features": features}
    if args.streaming:
        return docs.skip(done).map(tokenize, **kwargs).with_format("arrow").iter(batch_size=args.batch_size)
    if args.num_proc > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # each process tokenizes on one core
    rows = docs.map(
        tokenize,
        num_proc=args.num_proc if args.num_proc > 1 else None,
        cache_file_name=os.path.join(staging, "tokens.arrow"),
        desc="Tokenizing",
        **kwargs,
    )
    if done >= len(rows):  # killed after its last batch was recorded, before the record of the end
        return iter(())
    return rows.select(range(done, len(rows))).with_format("arrow").iter(batch_size=args.batch_size)


def stage(args, staging, tokenizer, dtype, progress):
    """Stage the finished corpus whole in `staging`: the token files checked against the progress record and their
    sha256, the tokenizer's files, and tokens.json, written last (from then on a rerun only moves files in)."""
    splits = progress["splits"]
    if splits["train"]["tokens"] == 0:
        shutil.rmtree(staging)
        raise ValueError(
            "The corpus holds no non-empty training document"
            + (" (every document went to validation: lower --validation_fraction)" if splits["val"]["tokens"] else "")
            + "; nothing was written."
        )
    for split, record in splits.items():
        partial = os.path.join(staging, f"{split}.bin.partial")
        if record["tokens"] == 0:
            if os.path.exists(partial):
                os.remove(partial)
            continue
        if count_tokens(partial, dtype) != record["tokens"]:
            shutil.rmtree(staging)
            raise ValueError(
                f"{partial} does not hold the {record['tokens']} tokens recorded (changed while prepare ran?); the "
                f"staging folder was removed: rerun the command."
            )
        record["sha256"] = file_sha256(partial)
    folder = os.path.join(staging, TOKENIZER_STAGING)
    if os.path.isdir(folder + ".tmp"):
        shutil.rmtree(folder + ".tmp")
    tokenizer.save_pretrained(folder + ".tmp")
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.replace(folder + ".tmp", folder)
    phase("tokenizer staged")
    settings = read_json(os.path.join(staging, SETTINGS_FILE))
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "tokenizer": args.tokenizer_name or "looped_training BPE (trained by prepare, saved here)",
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "splits": splits,
        "source": {
            k: settings[k]
            for k in (
                "dataset_name",
                "dataset_config_name",
                "train_files",
                "text_column",
                "streaming",
                "max_documents",
                "validation_fraction",
                "seed",
            )
        },
        "settings": settings,
    }
    write_json(os.path.join(staging, TOKENS_FILE), meta)
    phase("staged")
    return meta


def move_in(out, staging, meta):
    """Move the staged files into `out` one by one, tokens.json last, then remove the staging folder. Each move is a
    rename; a rerun after a kill between two moves goes on with the files still staged."""
    folder = os.path.join(staging, TOKENIZER_STAGING)
    moves = [(os.path.join(folder, n), n) for n in sorted(os.listdir(folder))] if os.path.isdir(folder) else []
    moves += [(os.path.join(staging, f"{s}.bin.partial"), f"{s}.bin") for s in SPLITS if meta["splits"][s]["tokens"]]
    for source, name in moves:
        final = os.path.join(out, name)
        if os.path.exists(source):
            os.replace(source, final)
            phase(f"moved {name}")
        elif not os.path.exists(final):
            raise ValueError(
                f"{staging} lost {os.path.basename(source)} before it was moved to {final}; rerun with "
                f"--overwrite_output_dir."
            )
    for split in SPLITS:
        final = os.path.join(out, f"{split}.bin")
        if not meta["splits"][split]["tokens"] and os.path.exists(final):
            os.remove(final)
    os.replace(os.path.join(staging, TOKENS_FILE), os.path.join(out, TOKENS_FILE))
    phase("moved tokens.json")
    shutil.rmtree(staging)
    return meta


def prepare(args, tokenizer=None):
    """Write `args.output_dir`'s corpus (see the module docstring); its tokens.json. `tokenizer`: one loaded already
    (train's text cache passes the model's), else `--tokenizer_name`'s, else the package's BPE trained here."""
    check_args(args)
    if tokenizer is not None:
        check_eos(tokenizer, args.tokenizer_name)
    elif args.tokenizer_name:
        tokenizer = load_tokenizer(args.tokenizer_name)
    docs = load_documents(
        args.dataset_name, args.dataset_config_name, args.train_files, args.text_column, streaming=args.streaming
    )
    if args.max_documents is not None:
        docs = (
            docs.take(args.max_documents) if args.streaming else docs.select(range(min(args.max_documents, len(docs))))
        )
    if not args.streaming and len(docs) == 0:
        raise ValueError("The corpus holds no document; nothing was written.")
    with folder_lock(args.output_dir):
        staging = claim_folder(args, settings_of(args, tokenizer))
        if staging is None:
            logger.warning("%s already holds this corpus (same flags): nothing to do.", args.output_dir)
            return read_meta(args.output_dir)
        phase("claimed")
        meta = read_json(os.path.join(staging, TOKENS_FILE))
        if meta is None:  # not staged yet
            meta = tokenize_and_stage(args, docs, tokenizer, staging)
        return move_in(args.output_dir, staging, meta)


def tokenize_and_stage(args, docs, tokenizer, staging):
    from tqdm.auto import tqdm

    if tokenizer is None:
        tokenizer = train_tokenizer(docs, args, staging)
        phase("tokenizer trained")
    dtype = dtype_for_vocab(len(tokenizer))
    writer = SplitWriter(staging, dtype)
    try:
        done = writer.progress["documents_read"]
        if not writer.progress["finished"]:
            tokenize = Tokenize(tokenizer, dtype, args.validation_fraction, args.seed)
            rows = tokenized_rows(docs, tokenize, args, staging, dtype, done)  # the map runs here (Arrow)
            phase("mapped")
            total = None if args.streaming else len(docs)
            bar = tqdm(total=total, initial=done, unit="doc", desc="Writing token files", file=sys.stderr)
            for table in rows:
                writer.write(table)
                bar.update(table.num_rows)
            bar.close()
            writer.record(finished=True)
    finally:
        writer.close()
    return stage(args, staging, tokenizer, dtype, writer.progress)


def main(argv=None):
    (args,) = HfArgumentParser(PrepareArguments, prog=PROG).parse_args_into_dataclasses(
        args=sys.argv[1:] if argv is None else argv, look_for_args_file=False
    )
    logging.basicConfig(format="%(levelname)s - %(message)s", level=logging.INFO)
    meta = prepare(args)
    splits = meta["splits"]
    print(
        f"{args.output_dir}: train.bin {splits['train']['tokens']:,} tokens ({splits['train']['documents']:,} documents), "
        f"val.bin {splits['val']['tokens']:,} tokens ({splits['val']['documents']:,} documents), {meta['dtype']}, "
        f"vocabulary {meta['vocab_size']:,}"
    )
    return meta


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, PROG)
