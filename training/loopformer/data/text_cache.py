"""Text given as `--train_files` or `--dataset_name` without `--data_dir` (and without `--streaming`): prepared once
by `python -m looped_training.loopformer.prepare`'s code into a token folder in datasets' cache, then read as
`--data_dir` reads a folder (`TokenWindows`). There is one text path: documents joined by EOS, whole documents held
out by `--validation_fraction` (prepare's seeded hash), long documents tokenized in pieces cut before a space.

The folder is `<datasets cache>/looped_training/text/<key>` (`datasets.config.HF_DATASETS_CACHE`, which
`HF_DATASETS_CACHE` or `HF_HOME` move), the key a hash of prepare's settings (`prepare.settings_of`: the source, text
column, tokenizer (its vocabulary's sha256) or BPE size, validation fraction, seed, and each source file's path, size
and mtime). A run with the same settings over unchanged files reuses the folder without tokenizing again; a changed
file gives another key, so a fresh prepare. Prepare's lock and staging protect the folder as they protect any
`--output_dir`: a kill leaves it for the next run to finish, never a half-written corpus that passes for whole.
"""

import hashlib
import json
import os

from looped_training.loopformer.data.token_files import read_meta

CACHE_FOLDER = os.path.join("looped_training", "text")
BPE_VOCAB_SIZE = 1024  # the package's BPE of a text run without a tokenizer (--tokenizer_vocab_size's default)
# the tokenizer of --model_name_or_path (or a checkpoint's, for evaluate), as prepare's settings and tokens.json name it
MODEL_TOKENIZER = "the model's tokenizer"


def cache_root():
    """Where the prepared folders lie: datasets' cache, read at each call (a test may point it elsewhere)."""
    import datasets

    return os.path.join(os.fspath(datasets.config.HF_DATASETS_CACHE), CACHE_FOLDER)


def prepare_args(data_args, tokenizer_name=None):
    """prepare's arguments for the text of `data_args` (train's data flags), its output folder still unset."""
    from looped_training.loopformer.arguments import PrepareArguments

    return PrepareArguments(
        output_dir="",
        dataset_name=data_args.dataset_name,
        dataset_config_name=data_args.dataset_config_name,
        train_files=data_args.train_files,
        text_column=data_args.text_column,
        tokenizer_name=tokenizer_name,
        tokenizer_vocab_size=data_args.tokenizer_vocab_size or BPE_VOCAB_SIZE,
        validation_fraction=data_args.validation_fraction,
        seed=data_args.corpus_seed,
        overwrite_output_dir=True,  # the folder is the key's alone: whatever else it holds is a broken earlier try
    )


def locate(args, tokenizer=None):
    """(folder, settings) of prepare's `args` with `tokenizer` (None: the one `args` names, or the BPE): the folder
    is named by a hash of the settings, which hold the source files' sizes and mtimes."""
    from looped_training.loopformer.prepare import load_tokenizer, settings_of

    if tokenizer is None and args.tokenizer_name:
        tokenizer = load_tokenizer(args.tokenizer_name)
    settings = settings_of(args, tokenizer)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), key), settings, tokenizer


def is_prepared(folder, settings):
    """Whether `folder` holds the finished corpus of `settings`."""
    try:
        meta = read_meta(folder) if os.path.isdir(folder) else None
    except ValueError:  # an unreadable tokens.json: prepared again
        return False
    return meta is not None and meta.get("settings") == settings


def prepared_folder(data_args, tokenizer=None, tokenizer_name=None, prepare_missing=True):
    """The token folder of `data_args`'s text, prepared now unless the cache holds it: with `tokenizer` (loaded
    already, called `tokenizer_name` in the folder's record), else `tokenizer_name`'s, else `data_args`'s
    `--tokenizer_name`, else the package's BPE trained on the training documents. Prints which folder it uses.
    `prepare_missing=False`: None where the cache does not hold it."""
    from looped_training.loopformer.prepare import prepare

    name = tokenizer_name or data_args.tokenizer_name
    args = prepare_args(data_args, name)
    folder, settings, tokenizer = locate(args, tokenizer)
    args.output_dir = folder
    if is_prepared(folder, settings):
        print(f"Text: the token files prepared before from the same source and settings, in {folder}", flush=True)
        return folder
    if not prepare_missing:
        return None
    print(f"Text: preparing token files (once for this source and these settings) in {folder}", flush=True)
    prepare(args, tokenizer)
    return folder
