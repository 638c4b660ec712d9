"""Corpora II (issue 70): nothing silently wrong on LoopFormer's corpus path. Prepare is atomic at every kill point
and refuses or starts over on changed sources; train refuses files that differ from tokens.json; windows train T
targets under a stock Trainer; long documents are tokenized in pieces with the whole document's tokens; undecodable
input is named in one line; a stream without held-out documents is answered in one line."""

import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch
from looped_training.loopformer import prepare as prepare_cli
from looped_training.loopformer import train as train_loopformer
from looped_training.loopformer.data import TokenWindows, corpus, sources, token_files
from looped_training.prepare_folder import folder_lock
from support.hub_helpers import make_tokenizer

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "log",
    "red",
    "blue",
    "quick",
    "slow",
    "fox",
    "jumps",
    "over",
    "lazy",
    "king",
    "queen",
]
TINY_MODEL = ["--hidden_size", "32", "--num_attention_heads", "2", "--num_loops", "2", "--block_size", "16"]
TINY_RUN = [
    "--per_device_train_batch_size", "4", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
    "--logging_steps", "1", "--seed", "0", "--save_strategy", "no",
]  # fmt: skip


def documents(n=40, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(n)]


def write_txt(folder, docs):
    folder.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (folder / f"doc{i:03d}.txt").write_text(d)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(300).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_txt(tmp_path_factory.mktemp("src") / "txt", documents())


def run_prepare(out, files, tokenizer_dir, *flags):
    tok = ["--tokenizer_name", tokenizer_dir] if tokenizer_dir else []
    return prepare_cli.main(
        ["--train_files", files, *tok, "--output_dir", str(out), "--validation_fraction", "0.2", "--batch_size", "7",
         *flags]
    )  # fmt: skip


def folder_bytes(folder):
    """Every file under `folder` (relative path -> bytes)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = f.read()
    return found


# ---- Deliver 1: atomic at every kill point ---------------------------------------------------------------------


def phases_of(out, files, tokenizer_dir, monkeypatch):
    """The phase boundaries an uninterrupted prepare passes, in order (with a progress record every few batches)."""
    seen = []
    monkeypatch.setattr(prepare_cli, "phase", seen.append)
    run_prepare(out, files, tokenizer_dir)
    monkeypatch.setattr(prepare_cli, "phase", lambda name: None)
    return seen


def killed_at(k, out, files, tokenizer_dir):
    """Run prepare in a forked child that dies at its k-th phase boundary by `os._exit` (no cleanup, no flush: a
    kill -9); return the phase name it died at."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        calls = []

        def die(name):
            calls.append(name)
            if len(calls) == k + 1:
                os.write(write, name.encode())
                os._exit(9)

        prepare_cli.phase = die
        try:
            run_prepare(out, files, tokenizer_dir)
        finally:
            os._exit(3)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    name = os.read(read, 1000).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 9, f"the child did not die at boundary {k}"
    return name


@pytest.mark.parametrize("named_tokenizer", [True, False], ids=["named-tokenizer", "trained-bpe"])
def test_a_kill_at_every_phase_boundary_then_a_rerun_gives_the_bytes_of_an_uninterrupted_run(
    source, tokenizer_dir, tmp_path, monkeypatch, named_tokenizer
):
    tok = tokenizer_dir if named_tokenizer else None
    monkeypatch.setattr(prepare_cli, "CHECKPOINT_TOKENS", 200)  # a progress record every few batches
    phases = phases_of(tmp_path / "reference", source, tok, monkeypatch)
    # every step of the finish is a boundary: each file's move, tokens.json's last
    assert {"claimed", "recorded", "finished", "staged", "moved train.bin", "moved val.bin"} <= set(phases)
    assert phases[-1] == "moved tokens.json" and phases.count("recorded") >= 2
    assert ("tokenizer trained" in phases) != named_tokenizer
    reference = folder_bytes(tmp_path / "reference")
    assert sorted(reference) == sorted(
        ["tokens.json", "train.bin", "val.bin", "tokenizer.json", "tokenizer_config.json"]
    )
    killed = []
    for k in range(len(phases)):
        out = tmp_path / f"killed{k}"
        killed.append(killed_at(k, out, source, tok))
        if killed[-1] != "moved tokens.json":  # until tokens.json is in, train refuses the folder
            with pytest.raises(ValueError, match="prepare did not finish there|has no train.bin"):
                token_files.open_corpus(out)
        run_prepare(out, source, tok)
        assert folder_bytes(out) == reference, f"killed after {killed[-1]!r}"
    assert killed == phases


def test_a_kill_after_train_bin_moved_in_never_gives_a_zero_padded_corpus(source, tokenizer_dir, tmp_path):
    """The reproduction of issue 70: killed right after train.bin is moved in, before tokens.json; the rerun used to
    recreate the missing .partial and pad it with zeros to the recorded size."""
    reference = run_prepare(tmp_path / "ref", source, tokenizer_dir)
    phases = []
    prepare_cli_phase = prepare_cli.phase
    try:
        prepare_cli.phase = phases.append
        run_prepare(tmp_path / "probe", source, tokenizer_dir)
    finally:
        prepare_cli.phase = prepare_cli_phase
    k = phases.index("moved train.bin")
    assert killed_at(k, tmp_path / "k", source, tokenizer_dir) == "moved train.bin"
    assert (tmp_path / "k" / "train.bin").exists() and not (tmp_path / "k" / "tokens.json").exists()
    meta = run_prepare(tmp_path / "k", source, tokenizer_dir)
    data = np.fromfile(tmp_path / "k" / "train.bin", np.uint16)
    assert (
        meta["splits"] == reference["splits"] and np.count_nonzero(data == 0) == meta["splits"]["train"]["documents"]
    )
    assert (tmp_path / "k" / "train.bin").read_bytes() == (tmp_path / "ref" / "train.bin").read_bytes()


def test_staged_files_that_lost_bytes_are_started_over_never_padded(source, tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_cli, "CHECKPOINT_TOKENS", 200)
    reference = folder_bytes(tmp_path / "ref") if run_prepare(tmp_path / "ref", source, tokenizer_dir) else None
    original, calls = prepare_cli.SplitWriter.write, []

    def dies_on_the_fourth_batch(self, table):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(self, table)

    monkeypatch.setattr(prepare_cli.SplitWriter, "write", dies_on_the_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(tmp_path / "k", source, tokenizer_dir)
    monkeypatch.setattr(prepare_cli.SplitWriter, "write", original)
    staging = tmp_path / "k" / token_files.STAGING_DIR
    progress = json.loads((staging / prepare_cli.PROGRESS_FILE).read_text())
    assert progress["splits"]["train"]["tokens"] > 0
    os.remove(staging / "train.bin.partial")  # what the recorded progress counts is gone
    run_prepare(tmp_path / "k", source, tokenizer_dir)
    assert folder_bytes(tmp_path / "k") == reference


def test_train_refuses_token_files_whose_size_or_checksum_differ_from_tokens_json(source, tokenizer_dir, tmp_path):
    run_prepare(tmp_path / "c", source, tokenizer_dir)
    train_bin = tmp_path / "c" / "train.bin"
    good = train_bin.read_bytes()
    assert token_files.open_corpus(tmp_path / "c", verify=True).meta["splits"]["train"]["sha256"]
    train_bin.write_bytes(good[:2] + bytes([good[2] ^ 1]) + good[3:])  # one bit, the same size
    with pytest.raises(ValueError, match=r"train.bin in .* does not have the sha256 tokens.json records"):
        train_on(tmp_path / "run", "--data_dir", str(tmp_path / "c"), "--max_steps", "1")
    train_bin.write_bytes(good + b"\0\0")
    with pytest.raises(ValueError, match=r"holds \d+ tokens where tokens.json says \d+"):
        token_files.open_corpus(tmp_path / "c")
    train_bin.write_bytes(good)
    meta = json.loads((tmp_path / "c" / "tokens.json").read_text())
    del meta["splits"]
    (tmp_path / "c" / "tokens.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="tokens.json has no 'splits'"):
        token_files.open_corpus(tmp_path / "c")


def test_a_second_prepare_into_a_locked_folder_is_refused_and_the_lock_goes_with_its_holder(
    source, tokenizer_dir, tmp_path
):
    out = tmp_path / "out"
    with folder_lock(str(out)), pytest.raises(ValueError, match=r"being written by another prepare \(pid \d+ on .*\)"):
        run_prepare(out, source, tokenizer_dir)
    assert run_prepare(out, source, tokenizer_dir)["splits"]["train"]["tokens"] > 0
    assert not (out / ".prepare.lock").exists()
    # a killed holder's lock is released by the kernel: the next prepare takes it
    pid = os.fork()
    if pid == 0:
        with folder_lock(str(tmp_path / "dead")):
            os._exit(9)
    os.waitpid(pid, 0)
    assert (tmp_path / "dead" / ".prepare.lock").exists()
    run_prepare(tmp_path / "dead", source, tokenizer_dir)


def test_changed_source_files_are_refused_in_a_finished_folder_and_started_over_in_an_unfinished_one(
    tokenizer_dir, tmp_path, monkeypatch
):
    src = write_txt(tmp_path / "src", documents(12))
    run_prepare(tmp_path / "out", src, tokenizer_dir)
    with open(os.path.join(src, "doc003.txt"), "a") as f:
        f.write(" and a new ending")
    with pytest.raises(ValueError, match=r"prepared from source files that changed since \(1 differ .*doc003.txt"):
        run_prepare(tmp_path / "out", src, tokenizer_dir)
    assert run_prepare(tmp_path / "out", src, tokenizer_dir, "--overwrite_output_dir")
    fresh = folder_bytes(tmp_path / "fresh") if run_prepare(tmp_path / "fresh", src, tokenizer_dir) else None
    assert folder_bytes(tmp_path / "out") == fresh
    # unfinished: killed mid-way, a source changed, then the rerun starts over on the new files
    monkeypatch.setattr(prepare_cli.SplitWriter, "write", lambda self, t: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        run_prepare(tmp_path / "k", src, tokenizer_dir)
    monkeypatch.undo()
    with open(os.path.join(src, "doc005.txt"), "a") as f:
        f.write(" more")
    run_prepare(tmp_path / "k", src, tokenizer_dir)
    run_prepare(tmp_path / "fresh2", src, tokenizer_dir)
    assert folder_bytes(tmp_path / "k") == folder_bytes(tmp_path / "fresh2")


# ---- Deliver 2: windows train T targets under a stock Trainer -------------------------------------------------


def test_token_windows_train_the_authors_t_targets_under_a_stock_trainer_with_default_arguments(tmp_path):
    """A stock `Trainer` with default `TrainingArguments` (CPU, no reporting): every batch forward receives holds
    the targets `data[s+1:s+T+1]` of its windows `data[s:s+T]` (as `labels` one token longer than the input, the
    whole window: the Trainer keeps that column), and the loss is the mean CE over all T targets of each window (the
    authors' get_batch), not run_clm's T - 1."""
    from transformers import Trainer, TrainingArguments

    from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM

    T, vocab = 8, 50
    data = np.random.default_rng(0).integers(0, vocab, 8 * T + 1, dtype=np.uint16)  # 8 windows: one default batch
    data.tofile(tmp_path / "train.bin")
    windows = TokenWindows(tmp_path / "train.bin", T)
    assert len(windows) == 8
    model = LoopFormerForCausalLM(
        LoopFormerConfig(vocab_size=vocab, hidden_size=16, num_attention_heads=2, num_hidden_layers=1, num_loops=2,
                         max_position_embeddings=T)
    )  # fmt: skip
    seen = []

    def spy(module, args, kwargs, output):
        seen.append((kwargs, output))

    model.register_forward_hook(spy, with_kwargs=True)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none")
    Trainer(model=model, args=args, train_dataset=windows).train()
    assert seen
    full = torch.from_numpy(data.astype(np.int64))
    for kwargs, output in seen:
        x, labels = kwargs["input_ids"], kwargs["labels"]
        assert labels.shape[1] == T + 1, "the window's last target did not reach forward: it trains T - 1 targets"
        y = labels[:, 1:]
        for row_x, row_y in zip(x, y):
            (s,) = [i * T for i in range(8) if torch.equal(full[i * T : i * T + T], row_x)]
            assert torch.equal(row_y, full[s + 1 : s + T + 1])  # the authors' y = data[s+1:s+T+1]
        ce = torch.nn.functional.cross_entropy(output.logits.float().reshape(-1, vocab), y.reshape(-1))
        assert torch.allclose(output.loss.float(), ce, atol=1e-5)  # all T targets of each window


# ---- Deliver 3: long documents in pieces ----------------------------------------------------------------------


def awkward_text(n_words, seed=0):
    """Text with every kind of whitespace run a cut could meet: single and double spaces, newlines, tabs, a space
    before a newline, leading spaces on a line, unicode letters and punctuation, numbers."""
    rng = random.Random(seed)
    words = [*WORDS, "naïve", "café", "東京", "'s", "don't", "3.14", "--", "...", "«quoted»", "x" * 30]
    gaps = [" ", " ", " ", "  ", "\n", "\n\n", " \n", "\t", " \t ", "\n   ", "   "]
    return "".join(rng.choice(words) + rng.choice(gaps) for _ in range(n_words))


@pytest.mark.parametrize("vocab_size", [300, 2000])
def test_a_long_document_tokenized_in_pieces_has_the_whole_documents_tokens(monkeypatch, vocab_size):
    from looped_training.loopformer.data.tokenizer import train_bpe_tokenizer

    text = awkward_text(20_000)
    tok = train_bpe_tokenizer([awkward_text(3000, seed=1)], vocab_size)
    whole = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    monkeypatch.setattr(corpus, "PIECE_CHARS", 500)
    parts = list(corpus.pieces(text, 500))
    assert len(parts) > 50 and "".join(parts) == text
    out = corpus.Tokenize(tok, "uint16", 0.0, 0)({"text": [text, "short one"]})
    assert out["input_ids"][0].tolist() == [*whole, tok.eos_token_id]
    # short documents go to the tokenizer in groups of at most PIECE_CHARS characters: each keeps its own tokens
    short = [awkward_text(30, seed=s) for s in range(60)] + ["", None]
    out = corpus.Tokenize(tok, "uint16", 0.0, 0)({"text": short})
    expected = [[*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id] if d else [] for d in short]
    assert [ids.tolist() for ids in out["input_ids"]] == expected
    # the held-out hash of a document is the same hashed whole or by pieces
    key = (3).to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(text.encode(), digest_size=8, key=key).digest()
    share = int.from_bytes(digest, "little") / 2.0**64
    assert corpus.is_validation([text], share + 1e-6, 3)[0] and not corpus.is_validation([text], share - 1e-6, 3)[0]


def test_pieces_cut_before_a_space_that_follows_a_non_space():
    text = "aaaa bbbb  cccc\n dddd eeee"
    parts = list(corpus.pieces(text, 8))
    assert "".join(parts) == text
    assert all(p[0] == " " for p in parts[1:]) and all(not p[-1].isspace() for p in parts[:-1])
    assert list(corpus.pieces("x" * 50, 8)) == ["x" * 50]  # nowhere to cut: whole


# ---- Deliver 4: undecodable input, one line naming the file ----------------------------------------------------


@pytest.mark.parametrize(
    "content, message",
    [
        ("café".encode("latin-1"), r"bad\.txt is not UTF-8 text \(byte 3 does not decode"),
        (b"ELF\x00\x01\x02binary", r"bad\.txt holds a NUL byte at byte 3: a binary file"),
    ],
    ids=["latin-1", "binary"],
)
def test_an_undecodable_text_file_is_refused_naming_it_before_any_work(tokenizer_dir, tmp_path, content, message):
    src = write_txt(tmp_path / "src", documents(3))
    (tmp_path / "src" / "bad.txt").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        run_prepare(tmp_path / "out", src, tokenizer_dir)
    assert not (tmp_path / "out").exists()


def test_a_literal_eos_in_a_document_is_text_and_the_document_stays_one(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    src = write_txt(tmp_path / "src", ["before <|endoftext|> after", "another one"])
    meta = run_prepare(tmp_path / "out", src, tokenizer_dir, "--validation_fraction", "0")
    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    data = np.fromfile(tmp_path / "out" / "train.bin", np.uint16)
    assert meta["splits"]["train"]["documents"] == 2 == int(np.count_nonzero(data == eos))


def test_dataset_name_on_a_folder_of_txt_reads_one_document_a_file(tokenizer_dir, tmp_path):
    src = write_txt(tmp_path / "src", ["line one\nline two\nline three", "a\nb"])
    meta = prepare_cli.main(
        ["--dataset_name", src, "--tokenizer_name", tokenizer_dir, "--output_dir", str(tmp_path / "o"),
         "--validation_fraction", "0"]
    )  # fmt: skip
    assert meta["splits"]["train"]["documents"] == 2


# ---- Deliver 5: streaming ---------------------------------------------------------------------------------------


def train_on(out, *flags):
    return train_loopformer.main(["--task", "text", "--output_dir", str(out), *TINY_MODEL, *TINY_RUN, *flags])


def test_a_stream_without_held_out_documents_is_refused_in_one_line_or_trains_without_evaluation(
    tokenizer_dir, tmp_path
):
    src = write_txt(tmp_path / "src", documents(4))
    stream = ["--streaming", "--train_files", src, "--tokenizer_name", tokenizer_dir, "--max_steps", "2",
              "--validation_fraction", "0.0001"]  # fmt: skip
    with pytest.raises(ValueError, match=r"--streaming: no window of 16 tokens is held out at --validation_fraction"):
        train_on(tmp_path / "run", *stream, "--eval_strategy", "steps", "--eval_steps", "1")
    trainer = train_on(tmp_path / "run2", *stream)  # --eval_strategy no (the default): no evaluation, no error
    assert trainer.eval_dataset is None and trainer.state.global_step == 2


def test_a_streamed_run_reads_its_evaluation_windows_once(tokenizer_dir, tmp_path, monkeypatch):
    src = write_txt(tmp_path / "src", documents(60))
    calls = []
    original = sources.stream_windows
    monkeypatch.setattr(sources, "stream_windows", lambda *a, **k: calls.append(a[3]) or original(*a, **k))
    trainer = train_on(tmp_path / "run", "--streaming", "--train_files", src, "--tokenizer_name", tokenizer_dir,
                       "--max_steps", "4", "--validation_fraction", "0.3", "--eval_strategy", "steps",
                       "--eval_steps", "1", "--max_eval_samples", "4")  # fmt: skip
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [1, 2, 3, 4]
    assert calls.count("val") == 1
    assert len(trainer.eval_dataset) == 4


# ---- Deliver 7: the weak rows ----------------------------------------------------------------------------------


def test_the_record_keeps_an_absolute_data_dir(source, tokenizer_dir, tmp_path, monkeypatch):
    run_prepare(tmp_path / "c", source, tokenizer_dir)
    monkeypatch.chdir(tmp_path)
    train_on("run", "--data_dir", "c", "--max_steps", "1")
    record = json.loads((tmp_path / "run" / "loopformer_training.json").read_text())
    assert record["data"]["data_dir"] == str(tmp_path / "c")


def test_the_authors_layout_without_a_tokenizer_names_the_missing_flag(tmp_path, monkeypatch):
    np.zeros(100, np.uint16).tofile(tmp_path / "train.bin")

    def offline(name):
        raise ValueError(f"--tokenizer_name {name!r} does not load as an AutoTokenizer (no network)")

    monkeypatch.setattr(sources, "load_tokenizer", offline)
    with pytest.raises(ValueError, match=r"has no tokens.json \(the authors' layout\), .* give --tokenizer_name") as e:
        sources.choose_tokenizer(
            train_loopformer.DataArguments(task="text", data_dir=str(tmp_path)),
            token_files.open_corpus(tmp_path),
            None,
        )
    assert "--tokenizer_name 'gpt2'" not in str(e.value)


def test_a_refused_run_leaves_no_output_dir(tmp_path):
    with pytest.raises(ValueError, match="has no train.bin"):
        train_on(tmp_path / "run", "--data_dir", str(tmp_path), "--max_steps", "1")
    assert not (tmp_path / "run").exists()


def test_a_one_process_launch_of_accelerate_cpu_with_several_processes_is_refused(tmp_path, monkeypatch):
    for name in train_loopformer.MPI_SIZES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # what accelerate's --cpu launcher sets for N > 1, starting one
    with pytest.raises(ValueError, match="accelerate launch --cpu --num_processes N started one process, not N"):
        train_on(tmp_path / "run", "--max_steps", "1")
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launcher that started them all (torchrun, the DDP config, mpirun)
    train_loopformer.check_launcher()
