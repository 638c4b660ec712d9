"""LoopFormer on a real corpus (issue 62): `prepare` writes the authors' flat token files through `datasets`, train
reads them by memmap as their train.py does (`TokenWindows` = their `make_starts` windows), or a stream packed into
the same windows; a killed prepare or run finishes as an uninterrupted one; any tokenizer; continued training."""

import json
import os
import random
from collections import Counter

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from looped_training.loopformer import prepare as prepare_cli
from looped_training.loopformer import train as train_loopformer
from looped_training.loopformer.data import TokenWindows, corpus, sources, token_files
from support.hub_helpers import make_tokenizer

WORDS = "the a cat dog sat ran on under mat log red blue quick slow fox jumps over lazy king queen".split()

TINY_MODEL = ["--hidden_size", "32", "--num_attention_heads", "2", "--num_loops", "3", "--block_size", "16"]
TINY_RUN = [
    "--per_device_train_batch_size", "4", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
    "--logging_steps", "1", "--seed", "0", "--learning_rate", "3e-3",
]  # fmt: skip


def documents(n=60, seed=0):
    """Documents of random words and lengths, with an empty one and a duplicate, as a corpus has them."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(n)]
    return docs[:10] + [""] + docs[10:] + [docs[3]]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(300).save_pretrained(folder)
    return str(folder)


def write_jsonl(path, docs):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"body": d}) + "\n")
    return str(path)


def run_prepare(out, files, tokenizer_dir, *flags):
    return prepare_cli.main(
        ["--train_files", files, "--text_column", "body", "--tokenizer_name", tokenizer_dir, "--output_dir", str(out),
         "--validation_fraction", "0.2", "--batch_size", "7", *flags]
    )  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_dir):
    tmp = tmp_path_factory.mktemp("corpus")
    files = write_jsonl(tmp / "docs.jsonl", documents())
    out = tmp / "tokens"
    meta = run_prepare(out, files, tokenizer_dir)
    return out, files, meta


def split_at_eos(tokens, eos):
    ends = np.flatnonzero(tokens == eos)
    return [tuple(tokens[s + 1 if i else 0 : e + 1].tolist()) for i, (s, e) in enumerate(zip([-1, *ends], ends))]


def test_every_document_comes_back_token_exact_from_the_token_files(prepared, tokenizer_dir):
    out, _, meta = prepared
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    docs = [d for d in documents() if d]
    expected = Counter(tuple(tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for d in docs)
    assert meta["dtype"] == "uint16" and meta["eos_token_id"] == tok.eos_token_id
    found, held = Counter(), Counter()
    for split in ("train", "val"):
        data = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
        assert len(data) == meta["splits"][split]["tokens"] and data[-1] == tok.eos_token_id
        pieces = split_at_eos(data, tok.eos_token_id)
        assert len(pieces) == meta["splits"][split]["documents"]
        found.update(pieces)
        (held if split == "val" else Counter()).update(pieces)
    assert found == expected  # as a multiset: the duplicate twice, the empty document not at all
    assert 0 < sum(held.values()) < len(docs)  # whole documents held out, by the seeded hash
    held_texts = [d for d in docs if corpus.is_validation([d], 0.2, 0)[0]]
    assert sorted(held.elements()) == sorted(tuple(tok(d)["input_ids"] + [tok.eos_token_id]) for d in held_texts)
    assert meta["splits"]["train"]["max_token_id"] == int(np.fromfile(out / "train.bin", np.uint16).max())
    assert not (out / token_files.STAGING_DIR).exists()


def authors_windows(path, block_size):
    """Their utils.py: make_starts(n, T) and MemmapTokenDataset.__getitem__ (re-implemented here as the oracle)."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    starts = np.arange(0, len(data) - block_size - 1 + 1, block_size, dtype=np.int64)
    return [
        (data[s : s + block_size].astype(np.int64), data[s + 1 : s + 1 + block_size].astype(np.int64)) for s in starts
    ]


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_the_windows_are_the_authors_make_starts_windows(prepared, block_size):
    path = prepared[0] / "train.bin"
    windows = TokenWindows(path, block_size)
    theirs = authors_windows(path, block_size)
    assert len(windows) == len(theirs) > 0
    for i, (x, y) in enumerate(theirs):
        item = windows[i]
        assert item["input_ids"].dtype == item["shift_labels"].dtype == torch.int64
        assert torch.equal(item["input_ids"], torch.from_numpy(x)) and torch.equal(
            item["shift_labels"], torch.from_numpy(y)
        )
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_a_file_of_exactly_one_window_and_its_target_has_one_window(tmp_path):
    np.arange(9, dtype=np.uint16).tofile(tmp_path / "train.bin")
    assert len(TokenWindows(tmp_path / "train.bin", 8)) == 1 and len(TokenWindows(tmp_path / "train.bin", 9)) == 0


def test_streamed_prepare_writes_the_same_files(prepared, tokenizer_dir, tmp_path):
    out, files, meta = prepared
    streamed = run_prepare(tmp_path / "s", files, tokenizer_dir, "--streaming")
    assert streamed["splits"] == meta["splits"]
    for split in ("train", "val"):
        assert (tmp_path / "s" / f"{split}.bin").read_bytes() == (out / f"{split}.bin").read_bytes()


def test_a_killed_prepare_reruns_to_the_same_files_and_a_half_written_one_never_passes(
    prepared, tokenizer_dir, tmp_path, monkeypatch
):
    out, files, _ = prepared
    monkeypatch.setattr(prepare_cli, "CHECKPOINT_TOKENS", 50)  # a progress record every few batches
    original, calls = prepare_cli.SplitWriter.write, []

    def dies_on_the_fifth_batch(self, table):
        calls.append(1)
        if len(calls) == 5:
            self.files["train"].write(b"\x07\x00" * 13)  # bytes after the last record: what a kill leaves
            raise KeyboardInterrupt
        return original(self, table)

    monkeypatch.setattr(prepare_cli.SplitWriter, "write", dies_on_the_fifth_batch)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(tmp_path / "k", files, tokenizer_dir)
    assert not (tmp_path / "k" / token_files.TOKENS_FILE).exists()
    with pytest.raises(ValueError, match="prepare did not finish there"):
        token_files.open_corpus(tmp_path / "k")
    monkeypatch.setattr(prepare_cli.SplitWriter, "write", original)
    read = []
    monkeypatch.setattr(prepare_cli.SplitWriter, "write", lambda self, t: read.append(t.num_rows) or original(self, t))
    run_prepare(tmp_path / "k", files, tokenizer_dir)
    assert sum(read) < len(documents())  # it went on from its last record
    for split in ("train", "val"):
        assert (tmp_path / "k" / f"{split}.bin").read_bytes() == (out / f"{split}.bin").read_bytes()


def test_a_rerun_with_other_flags_starts_over_and_a_finished_corpus_is_not_replaced_silently(
    prepared, tokenizer_dir, tmp_path, monkeypatch
):
    _, files, _ = prepared
    monkeypatch.setattr(prepare_cli.SplitWriter, "write", lambda self, t: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        run_prepare(tmp_path / "m", files, tokenizer_dir, "--seed", "1")
    monkeypatch.undo()
    meta = run_prepare(tmp_path / "m", files, tokenizer_dir, "--seed", "2")
    fresh = run_prepare(tmp_path / "fresh", files, tokenizer_dir, "--seed", "2")
    assert meta["splits"] == fresh["splits"]
    assert (tmp_path / "m" / "train.bin").read_bytes() == (tmp_path / "fresh" / "train.bin").read_bytes()
    assert run_prepare(tmp_path / "m", files, tokenizer_dir, "--seed", "2") == meta  # the same flags: nothing to do
    with pytest.raises(ValueError, match=r"prepared with other flags \(seed\); give --overwrite_output_dir"):
        run_prepare(tmp_path / "m", files, tokenizer_dir, "--seed", "3")
    assert (
        run_prepare(tmp_path / "m", files, tokenizer_dir, "--seed", "3", "--overwrite_output_dir")["settings"]["seed"]
        == 3
    )


def test_the_stream_packs_the_same_windows_as_the_token_files_and_ranks_share_it(prepared, tokenizer_dir):
    from transformers import AutoTokenizer

    out, files, _ = prepared
    args = train_loopformer.DataArguments(task="text", train_files=[files], text_column="body", streaming=True,
                                          validation_fraction=0.2)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    # one map batch holds every document here, so the stream's windows are the file's (a bigger corpus drops each
    # batch's tail)
    streamed = list(sources.stream_windows(args, tok, 16, "train"))
    files_windows = TokenWindows(out / "train.bin", 16)
    assert len(streamed) == len(files_windows)
    for a, i in zip(streamed, range(len(files_windows))):
        assert torch.equal(a["input_ids"], files_windows[i]["input_ids"])
        assert torch.equal(a["shift_labels"], files_windows[i]["shift_labels"])
    shares = [list(sources.stream_windows(args, tok, 4, "train", rank, 2)) for rank in (0, 1)]
    assert shares[0] and shares[1]
    assert sum(len(s) for s in shares) <= len(list(sources.stream_windows(args, tok, 4, "train")))
    assert {tuple(w["input_ids"].tolist()) for w in shares[0]} != {tuple(w["input_ids"].tolist()) for w in shares[1]}


def train_on(out, *flags, model=TINY_MODEL):
    return train_loopformer.main(["--task", "text", "--output_dir", str(out), *model, *TINY_RUN, *flags])


def test_training_from_token_files_evaluates_on_val_and_saves_the_corpus_tokenizer(prepared, tmp_path):
    from transformers import AutoTokenizer

    trainer = train_on(tmp_path / "run", "--data_dir", str(prepared[0]), "--max_steps", "3", "--eval_strategy",
                       "steps", "--eval_steps", "3", "--save_strategy", "no")  # fmt: skip
    assert isinstance(trainer.train_dataset, TokenWindows)
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [3]
    saved = AutoTokenizer.from_pretrained(tmp_path / "run")
    assert saved.get_vocab() == AutoTokenizer.from_pretrained(prepared[0]).get_vocab()
    assert json.loads((tmp_path / "run" / "loopformer_training.json").read_text())["data"]["data_dir"] == str(
        prepared[0]
    )


def test_the_authors_layout_trains_with_the_named_tokenizer(tmp_path, tokenizer_dir):
    folder = tmp_path / "authors"
    folder.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 300, 2000, dtype=np.uint16).tofile(folder / "train.bin")
    rng.integers(0, 300, 400, dtype=np.uint16).tofile(folder / "val.bin")
    trainer = train_on(tmp_path / "run", "--data_dir", str(folder), "--tokenizer_name", tokenizer_dir,
                       "--max_steps", "2", "--save_strategy", "no")  # fmt: skip
    assert len(trainer.train_dataset) == (2000 - 16 - 1) // 16 + 1
    assert trainer.eval_dataset is None  # eval_strategy "no"; val.bin is read when it asks


def test_without_a_tokenizer_the_authors_layout_is_read_as_gpt2(tmp_path, monkeypatch):
    np.zeros(100, np.uint16).tofile(tmp_path / "train.bin")
    corpus_ = token_files.open_corpus(tmp_path)
    asked = []
    monkeypatch.setattr(sources, "load_tokenizer", lambda name: asked.append(name))
    sources.choose_tokenizer(train_loopformer.DataArguments(task="text", data_dir=str(tmp_path)), corpus_, None)
    assert asked == ["gpt2"]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_killed_run_on_token_files_or_a_stream_resumes_on_the_same_batches(
    prepared, tmp_path, monkeypatch, streaming
):
    import transformers

    out, files, _ = prepared
    data = (
        ["--streaming", "--train_files", files, "--text_column", "body", "--tokenizer_name", str(out),
         "--validation_fraction", "0.2"]
        if streaming else ["--data_dir", str(out)]
    )  # fmt: skip
    flags = [*data, "--max_steps", "6", "--save_steps", "3"]
    reference = train_on(tmp_path / "ref", *flags)
    original = transformers.Trainer.training_step

    def dies_at_step_4(self, *args, **kwargs):
        if self.state.global_step >= 4:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "training_step", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train_on(tmp_path / "killed", *flags)
    monkeypatch.setattr(transformers.Trainer, "training_step", original)
    resumed = train_on(tmp_path / "killed", *flags, "--resume_from_checkpoint", "last")

    def losses(trainer):
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    after = {s: v for s, v in losses(resumed).items() if s > 3}
    assert sorted(after) == [4, 5, 6]
    assert after == {s: losses(reference)[s] for s in after}


@pytest.fixture(scope="module")
def source_run(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("source") / "run"
    train_on(out, "--data_dir", str(prepared[0]), "--max_steps", "2", "--save_strategy", "no")
    return out


def test_continued_training_at_lr_0_saves_the_source_weights_unchanged(prepared, source_run, tmp_path):
    train_on(tmp_path / "cont", "--model_name_or_path", str(source_run), "--data_dir", str(prepared[0]),
             "--learning_rate", "0", "--max_steps", "2", "--save_strategy", "no")  # fmt: skip
    before, after = load_file(source_run / "model.safetensors"), load_file(tmp_path / "cont" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    record = json.loads((tmp_path / "cont" / "loopformer_training.json").read_text())
    assert record["model"]["hidden_size"] == 32 and record["model"]["model_name_or_path"] == str(source_run)


def test_continued_training_refuses_a_contradicting_flag_by_name(prepared, source_run, tmp_path):
    with pytest.raises(ValueError, match=r"--hidden_size 64 \(the checkpoint has 32\)"):
        train_on(tmp_path / "c", "--model_name_or_path", str(source_run), "--data_dir", str(prepared[0]),
                 "--hidden_size", "64", "--max_steps", "1")  # fmt: skip
    with pytest.raises(ValueError, match="--variant base_loop contradicts --model_name_or_path"):
        train_on(tmp_path / "c", "--model_name_or_path", str(source_run), "--data_dir", str(prepared[0]),
                 "--variant", "base_loop", "--max_steps", "1")  # fmt: skip


def test_continued_training_from_an_authors_repo(prepared, tmp_path):
    from support.reference_oracle import write_authors_repo

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepared[0])
    write_authors_repo(tmp_path / "repo", tokenizer=tok, vocab=320)
    trainer = train_on(tmp_path / "cont", "--model_name_or_path", str(tmp_path / "repo"), "--data_dir",
                       str(prepared[0]), "--max_steps", "1", "--save_strategy", "no", model=["--block_size", "16"])  # fmt: skip
    assert trainer.model.config.vocab_size == 320 and trainer.model.config.num_loops > 1


# ---- bad inputs: one line, before any work, nothing half-written ------------------------------------------------


def test_a_missing_train_bin_or_a_truncated_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no train.bin"):
        token_files.open_corpus(tmp_path)
    (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="3 bytes, not a whole number of uint16 tokens"):
        token_files.open_corpus(tmp_path)


def test_a_token_id_beyond_the_vocabulary_is_refused(tmp_path, tokenizer_dir):
    np.array([5, 7, 299, 400, 3] * 40, np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match=r"holds token id 400, beyond the model's vocabulary of 300"):
        train_on(tmp_path / "run", "--data_dir", str(tmp_path), "--tokenizer_name", tokenizer_dir, "--max_steps", "1")
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_a_tokenizer_without_eos_and_an_empty_corpus_are_refused_leaving_nothing(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "no_eos")
    files = write_jsonl(tmp_path / "docs.jsonl", documents(5))
    with pytest.raises(ValueError, match="has no EOS token"):
        run_prepare(tmp_path / "out", files, str(tmp_path / "no_eos"))
    assert not (tmp_path / "out").exists()
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(ValueError, match="holds no non-empty training document; nothing was written"):
        run_prepare(tmp_path / "out", empty, tokenizer_dir)
    assert not (tmp_path / "out").exists()  # nothing was written, not even the folder


def test_streaming_without_max_steps_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="--streaming reads a corpus of unknown length: set --max_steps"):
        train_on(tmp_path / "run", "--streaming", "--train_files", str(tmp_path))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data_dir", "x", "--train_files", "y"], "does not combine"),
        (["--streaming", "--max_steps", "2"], "--streaming streams --dataset_name or --train_files"),
        (["--train_files", "x", "--max_train_chars", "9"], "--max_train_chars capped the in-memory text path"),
        (["--train_files", "x", "--window_targets", "false"], "every text window trains T next-token targets"),
    ],
)
def test_flags_that_do_not_combine_are_refused(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        train_on(tmp_path / "run", *flags)


# the authors' recipe at CPU size: the preset with its shape and batch shrunk (docs/training.md runs the same)
CPU_SIZED = [
    "--hidden_size", "32", "--num_attention_heads", "2", "--intermediate_size", "64", "--num_blocks", "1",
    "--num_loops", "3", "--block_size", "32", "--vocab_size", "320", "--per_device_train_batch_size", "4",
    "--gradient_accumulation_steps", "1", "--max_steps", "6", "--warmup_steps", "2", "--eval_steps", "3",
    "--save_steps", "3", "--max_eval_samples", "8", "--bf16", "false", "--use_cpu", "--disable_tqdm", "true",
]  # fmt: skip


def test_the_authors_recipe_runs_at_cpu_size_prepare_train_evaluate(prepared, tmp_path):
    from looped_training.loopformer import evaluate as evaluate_elastic

    out = tmp_path / "run"
    trainer = train_loopformer.main(
        ["--preset", "authors-3blk-8loops", "--data_dir", str(prepared[0]), "--output_dir", str(out), *CPU_SIZED]
    )
    assert trainer.args.weight_decay == 0.2 and trainer.args.adam_beta2 == 0.95 and trainer.args.seed == 1337
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [3, 6]
    assert (out / "checkpoint-6").is_dir() and trainer.model.config.vocab_size == 320
    records = evaluate_elastic.main([str(out), "--output_dir", str(tmp_path / "eval"), "--disable_tqdm", "true"])
    ppl = [r["ppl"] for r in records[0]["results"]]
    assert len(ppl) >= 3 and all(1 < p < 320 for p in ppl)  # every budget scored on val.bin's windows
