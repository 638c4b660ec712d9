"""The bad-input registry's rows of the corpus path (issue 70): LoopFormer's prepare, train's text paths and
fprm.prepare; each refuses in one line (exit status 2 as a command), or does what its `HANDLED` row says."""

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from support.bad_inputs.commands import FPRM_PREPARE, TRAIN
from support.bad_inputs.shared import Case, Handled, cli, without_root_override

PREPARE = cli("looped_training.loopformer.prepare")
CORPORA = "tests/training/loopformer/test_corpora.py::"
TEXT_CACHE = "tests/training/loopformer/test_text_cache.py::"
FPRM_FAULTS = "tests/training/fprm/test_fprm_prepare_faults.py::"
PUZZLE, ANSWER = "." * 81, "1" * 81


def texts(tmp, bad=None, name="texts"):
    """A folder of three .txt documents (and `bad.txt` holding the bytes `bad`)."""
    folder = Path(tmp) / name
    folder.mkdir(exist_ok=True)
    for i in range(3):
        if not (folder / f"d{i}.txt").exists():  # written once: a second call keeps their mtimes
            (folder / f"d{i}.txt").write_text(f"the cat sat on the mat and the dog ran {i} " * 20)
    if bad is not None:
        (folder / "bad.txt").write_bytes(bad)
    return str(folder)


def tokenizer(tmp):
    from support.hub_helpers import make_tokenizer

    folder = Path(tmp) / "tokenizer"
    if not folder.exists():
        make_tokenizer(300).save_pretrained(folder)
    return str(folder)


def prepared(tmp):
    """A corpus folder prepare wrote (with the test tokenizer)."""
    from looped_training.loopformer import prepare

    out = Path(tmp) / "corpus"
    prepare.main(
        [
            "--train_files",
            texts(tmp),
            "--tokenizer_name",
            tokenizer(tmp),
            "--output_dir",
            str(out),
            "--validation_fraction",
            "0",
        ]
    )
    return out


def train_on_changed(change):
    def run(tmp):
        folder = prepared(tmp)
        change(folder)
        TRAIN("--task", "text", "--data_dir", str(folder), "--output_dir", "{tmp}/run", "--max_steps", "1")(tmp)

    return run


def flip_a_byte(folder):
    data = bytearray((folder / "train.bin").read_bytes())
    data[5] ^= 1
    (folder / "train.bin").write_bytes(bytes(data))


def drop_splits(folder):
    meta = json.loads((folder / "tokens.json").read_text())
    del meta["splits"]
    (folder / "tokens.json").write_text(json.dumps(meta))


def prepare_while_locked(tmp):
    """prepare into a folder whose lock another prepare holds: an flock on `.prepare.lock` naming its holder (fixed
    values keep the table the same on every machine)."""
    import fcntl

    out = Path(tmp) / "out"
    out.mkdir()
    fd = os.open(out / ".prepare.lock", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, json.dumps({"pid": 4321, "host": "another-host"}).encode())
        fcntl.flock(fd, fcntl.LOCK_EX)
        PREPARE("--train_files", texts(tmp), "--output_dir", "{tmp}/out")(tmp)
    finally:
        os.close(fd)


def prepare_after_a_source_changed(tmp):
    folder = prepared(tmp)
    with open(Path(tmp) / "texts" / "d1.txt", "a") as f:
        f.write("and a new line")
    PREPARE(
        "--train_files",
        texts(tmp),
        "--tokenizer_name",
        tokenizer(tmp),
        "--output_dir",
        str(folder),
        "--validation_fraction",
        "0",
    )(tmp)


def unreadable(run_in):
    """run(tmp) of `run_in(tmp, folder)` with `folder` a folder of mode 000, as a user without root's override."""

    def run(tmp):
        folder = Path(tmp) / "unreadable"
        folder.mkdir()
        (folder / "train.bin").write_bytes(np.zeros(100, np.uint16).tobytes())
        folder.chmod(0)
        try:
            with without_root_override():
                run_in(tmp, str(folder))
        finally:
            folder.chmod(0o755)

    return run


@contextlib.contextmanager
def environment(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def under_accelerate_cpu_launcher(tmp):
    """The environment `accelerate launch --cpu --num_processes 2` gives the one process it starts."""
    with environment(ACCELERATE_USE_CPU="True", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"):
        TRAIN("--output_dir", "{tmp}/run", "--max_steps", "1")(tmp)


def fprm_csv(content):
    def run(tmp):
        folder = Path(tmp) / "sudoku"
        folder.mkdir()
        (folder / "train.csv").write_bytes(content)
        (folder / "test.csv").write_bytes(f"source,question,answer,rating\ns,{PUZZLE},{ANSWER},1\n".encode())
        FPRM_PREPARE("--dataset", str(folder), "--output_dir", "{tmp}/out")(tmp)

    return run


CASES = [
    Case(
        "loopformer.prepare",
        "--train_files FOLDER holding a latin-1 .txt",
        lambda t: PREPARE("--train_files", texts(t, "café".encode("latin-1")), "--output_dir", "{tmp}/out")(t),
        ValueError,
        r"texts/bad\.txt is not UTF-8 text \(byte 3 does not decode: unexpected end of data\); convert it to UTF-8",
    ),
    Case(
        "loopformer.prepare",
        "--train_files FOLDER holding a binary file named .txt",
        lambda t: PREPARE("--train_files", texts(t, b"\x7fELF\x02\x01\x00\x00"), "--output_dir", "{tmp}/out")(t),
        ValueError,
        r"texts/bad\.txt holds a NUL byte at byte 6: a binary file, not UTF-8 text",
    ),
    Case(
        "loopformer.train",
        "--task text --train_files FOLDER holding a latin-1 .txt (prepared into datasets' cache first)",
        lambda t: TRAIN(
            "--task",
            "text",
            "--train_files",
            texts(t, b"caf\xe9 au lait"),
            "--output_dir",
            "{tmp}/run",
            "--max_steps",
            "1",
        )(t),
        ValueError,
        r"texts/bad\.txt is not UTF-8 text \(byte 3 does not decode: invalid continuation byte\)",
    ),
    Case(
        "loopformer.train",
        "--task text --train_files FOLDER --max_train_chars 1000 (it capped the in-memory path, now gone)",
        TRAIN("--task", "text", "--train_files", "{tmp}", "--max_train_chars", "1000", "--output_dir", "{tmp}/run"),
        ValueError,
        r"--max_train_chars capped the in-memory text path, which is gone: .*cap the run with --max_steps",
    ),
    Case(
        "loopformer.train",
        "--task text --train_files FOLDER --window_targets false (the in-memory path's T - 1 targets)",
        TRAIN("--task", "text", "--train_files", "{tmp}", "--window_targets", "false", "--output_dir", "{tmp}/run"),
        ValueError,
        r"--window_targets false gave the in-memory text path's rows T - 1 targets .* leave the flag out",
    ),
    Case(
        "loopformer.prepare",
        "--output_dir another prepare is writing into (its lock is held)",
        prepare_while_locked,
        ValueError,
        r"--output_dir '.*out' is being written by another prepare \(pid 4321 on another-host, lock .*\.prepare\.lock\)",
    ),
    Case(
        "loopformer.prepare",
        "the same flags after a source file changed (a finished folder)",
        prepare_after_a_source_changed,
        ValueError,
        r"holds a corpus prepared from source files that changed since \(1 differ in size, mtime or presence: "
        r".*d1\.txt\); give --overwrite_output_dir",
    ),
    Case(
        "loopformer.train",
        "--data_dir whose train.bin lost a bit after prepare (same size)",
        train_on_changed(flip_a_byte),
        ValueError,
        r"train\.bin in .* does not have the sha256 tokens\.json records .*: rerun prepare",
    ),
    Case(
        "loopformer.train",
        '--data_dir whose tokens.json has no "splits"',
        train_on_changed(drop_splits),
        ValueError,
        r"tokens\.json has no 'splits' with the token counts of \['train', 'val'\]",
    ),
    Case(
        "loopformer.train",
        "--data_dir a folder it may not read",
        unreadable(
            lambda t, folder: TRAIN(
                "--task", "text", "--data_dir", folder, "--output_dir", "{tmp}/run", "--max_steps", "1"
            )(t)
        ),
        ValueError,
        r"--data_dir '.*unreadable' cannot be read \(Permission denied\)",
    ),
    Case(
        "loopformer.prepare",
        "--train_files a folder it may not read",
        unreadable(lambda t, folder: PREPARE("--train_files", folder, "--output_dir", "{tmp}/out")(t)),
        ValueError,
        r"--train_files entry '.*unreadable' cannot be read \(Permission denied\)",
    ),
    Case(
        "loopformer.train",
        "--streaming on a corpus with no held-out document, --eval_strategy steps",
        lambda t: TRAIN(
            "--task",
            "text",
            "--streaming",
            "--train_files",
            texts(t),
            "--tokenizer_name",
            tokenizer(t),
            "--max_steps",
            "2",
            "--validation_fraction",
            "0.0001",
            "--eval_strategy",
            "steps",
            "--output_dir",
            "{tmp}/run",
        )(t),
        ValueError,
        r"--streaming: no window of 128 tokens is held out at --validation_fraction 0\.0001 .* give --eval_strategy no",
    ),
    Case(
        "loopformer.train",
        "run by `accelerate launch --cpu --num_processes 2` (one process started)",
        under_accelerate_cpu_launcher,
        ValueError,
        r"accelerate launch --cpu --num_processes N started one process, not N",
    ),
    Case(
        "fprm.prepare",
        "--dataset DIR whose train.csv has no header row",
        fprm_csv(f"s,{PUZZLE},{ANSWER},3\ns,{PUZZLE},{ANSWER},4\n".encode()),
        SystemExit,
        r"train\.csv has no header row: its first row is \[s, \.\.\.",
    ),
    Case(
        "fprm.prepare",
        "--dataset DIR whose train.csv is a binary file",
        fprm_csv(b"\x7fELF\x02\x01\x01\x00\x00binary"),
        SystemExit,
        r"train\.csv holds a NUL byte at byte 7: a binary file",
    ),
    Case(
        "fprm.prepare",
        "--dataset DIR whose train.csv holds the header and no row",
        fprm_csv(b"source,question,answer,rating\n"),
        SystemExit,
        r"train\.csv holds the header row and no puzzle: nothing to build",
    ),
    Case(
        "fprm.prepare",
        "--dataset DIR whose train.csv rates row 1 'hard'",
        fprm_csv(f"source,question,answer,rating\ns,{PUZZLE},{ANSWER},3\ns,{PUZZLE},{ANSWER},hard\n".encode()),
        SystemExit,
        r"\(train\): row 1 has the rating 'hard', not an integer",
    ),
]

HANDLED = [
    Handled(
        "loopformer.prepare",
        "a kill anywhere (between the moves of the finish included), then the same command",
        "the files of an uninterrupted run, byte for byte; never a file padded to a recorded size (was: killed after "
        "train.bin moved in, the rerun padded a recreated .partial with zeros and training accepted it)",
        CORPORA + "test_a_kill_at_every_phase_boundary_then_a_rerun_gives_the_bytes_of_an_uninterrupted_run",
    ),
    Handled(
        "loopformer.prepare",
        "a rerun after a kill that left .prepare/ beside a finished tokens.json",
        "the staging folder (and its tokens.arrow) is removed; a finished folder keeps nothing of it",
        CORPORA + "test_a_kill_at_every_phase_boundary_then_a_rerun_gives_the_bytes_of_an_uninterrupted_run",
    ),
    Handled(
        "loopformer.prepare",
        "source files changed under an unfinished prepare (same flags)",
        "the rerun starts over on the new files (their sizes and mtimes are part of the settings)",
        CORPORA + "test_changed_source_files_are_refused_in_a_finished_folder_and_started_over_in_an_unfinished_one",
    ),
    Handled(
        "loopformer.prepare",
        "a document that spells `<|endoftext|>`",
        "tokenized as text: the document stays one, with one EOS at its end, as tokens.json counts it",
        CORPORA + "test_a_literal_eos_in_a_document_is_text_and_the_document_stays_one",
    ),
    Handled(
        "loopformer.prepare / train",
        "`--dataset_name` a folder of .txt files",
        "one document a file, as `--train_files` reads it (datasets' own text builder makes one a line)",
        CORPORA + "test_dataset_name_on_a_folder_of_txt_reads_one_document_a_file",
    ),
    Handled(
        "loopformer.train",
        "`--train_files` (or `--dataset_name`) without `--data_dir`, run twice with the same flags",
        "prepared once into a token folder in datasets' cache, trained from by TokenWindows (the batches of prepare + "
        "--data_dir); the second run reuses the folder without tokenizing and prints which folder it uses (was: the "
        "text tokenized in memory at every run)",
        TEXT_CACHE + "test_the_text_is_prepared_once_then_reused_by_train_and_evaluate",
    ),
    Handled(
        "loopformer.train",
        "`--train_files` without `--data_dir` after a source file changed",
        "a new cache folder, prepared afresh: the key holds each source file's size and mtime",
        TEXT_CACHE + "test_a_changed_source_file_is_prepared_again_into_a_new_folder",
    ),
    Handled(
        "loopformer.prepare",
        "one document of 60 MB",
        "tokenized in pieces of ~256k characters cut before a space: the whole document's tokens, memory flat "
        "(benchmarks/README.md, corpus memory)",
        CORPORA + "test_a_long_document_tokenized_in_pieces_has_the_whole_documents_tokens",
    ),
    Handled(
        "loopformer.train",
        "`--streaming` evaluation",
        "the held-out windows are read once and kept; each evaluation reads the same windows, no stream again",
        CORPORA + "test_a_streamed_run_reads_its_evaluation_windows_once",
    ),
    Handled(
        "loopformer.train",
        "`--streaming` with no held-out document and `--eval_strategy no`",
        "trains without evaluation (was a bare StopIteration)",
        CORPORA + "test_a_stream_without_held_out_documents_is_refused_in_one_line_or_trains_without_evaluation",
    ),
    Handled(
        "loopformer.train",
        "`--data_dir` the authors' layout, no `--tokenizer_name`, and gpt2 does not load",
        "one line: the folder has no tokens.json, its ids are read as gpt2's, which does not load here; give "
        "--tokenizer_name (was: \"--tokenizer_name 'gpt2' does not load\" to a user who gave no such flag)",
        CORPORA + "test_the_authors_layout_without_a_tokenizer_names_the_missing_flag",
    ),
    Handled(
        "loopformer.train",
        "a relative `--data_dir`, then `evaluate` from another folder",
        "the run's record keeps the absolute path: evaluate finds the corpus from anywhere",
        CORPORA + "test_the_record_keeps_an_absolute_data_dir",
    ),
    Handled(
        "loopformer.train",
        "a run refused before it wrote anything",
        "the --output_dir it created is removed again (was: an empty folder left behind)",
        CORPORA + "test_a_refused_run_leaves_no_output_dir",
    ),
    Handled(
        "fprm.prepare",
        "a bad test.csv after a good train.csv; a kill anywhere, then the same command",
        "--output_dir as it was (the splits are built in .prepare/ and moved in whole); the rerun writes the bytes "
        "of an uninterrupted build (was: train/ half-built; zero rows under a matching dataset.json)",
        FPRM_FAULTS + "test_a_kill_at_every_phase_boundary_then_a_rerun_gives_the_bytes_of_an_uninterrupted_build",
    ),
    Handled(
        "benchmarks.bench_fprm_batching",
        "run without `--output`",
        "writes outputs/bench-fprm-batching/fprm_batching.json; the tracked results file changes only when named",
        "tests/lab/test_bench_fprm_batching.py::test_the_default_output_is_not_the_tracked_results_file",
    ),
]
