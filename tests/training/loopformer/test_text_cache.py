"""One text path (issue 70): `--train_files` / `--dataset_name` without `--data_dir` are prepared once, by prepare's
code, into a token folder in datasets' cache (the key: prepare's settings and the source files' sizes and mtimes),
and trained from through `TokenWindows`, as `prepare` then `--data_dir` would be."""

import os

import datasets
import pytest
import torch

from looped_training.loopformer import evaluate as evaluate_elastic
from looped_training.loopformer import prepare as prepare_cli
from looped_training.loopformer import train as train_loopformer
from looped_training.loopformer.arguments import DataArguments
from looped_training.loopformer.data import TokenWindows, text_cache
from loopformer_hf import LoopFormerForCausalLM
from support.hub_helpers import make_tokenizer

TINY = [
    "--task", "text", "--hidden_size", "32", "--num_attention_heads", "2", "--num_loops", "2", "--block_size", "16",
    "--per_device_train_batch_size", "4", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
    "--seed", "0", "--save_strategy", "no", "--max_steps", "1",
]  # fmt: skip


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """datasets' cache in tmp_path: the folders the text is prepared into."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
    return tmp_path / "hf_datasets" / text_cache.CACHE_FOLDER


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(300).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def prepares(monkeypatch):
    """The output folders of every prepare run from here on."""
    calls, original = [], prepare_cli.prepare
    monkeypatch.setattr(prepare_cli, "prepare", lambda args, *a: calls.append(args.output_dir) or original(args, *a))
    return calls


def texts(folder, n=8):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"doc{i}.txt").write_text(" ".join(f"the cat {i} sat on the mat and the dog ran" for _ in range(12)))
    return str(folder)


def train(out, *flags):
    return train_loopformer.main(["--output_dir", str(out), *TINY, *flags])


def test_the_text_is_prepared_once_then_reused_by_train_and_evaluate(tmp_path, cache, prepares, capsys):
    src = texts(tmp_path / "src")
    flags = ["--train_files", src, "--tokenizer_vocab_size", "300", "--validation_fraction", "0.3"]  # the BPE
    trainer = train(tmp_path / "run", *flags)
    (folder,) = cache.iterdir()
    assert prepares == [str(folder)]
    assert isinstance(trainer.train_dataset, TokenWindows) and trainer.train_dataset.path == str(folder / "train.bin")
    assert f"preparing token files (once for this source and these settings) in {folder}" in capsys.readouterr().out
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    train(tmp_path / "run2", *flags)  # the same source and settings: no prepare, the same folder
    assert prepares == [str(folder)] and list(cache.iterdir()) == [folder]
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert f"the token files prepared before from the same source and settings, in {folder}" in capsys.readouterr().out

    evaluate_elastic.main([str(tmp_path / "run"), "--output_dir", str(tmp_path / "eval"), "--max_rows", "4",
                           "--repr_rows", "2", "--schedules", "uniform"])  # fmt: skip
    assert prepares == [str(folder)] and list(cache.iterdir()) == [folder]  # evaluate reads the run's folder


def test_a_changed_source_file_is_prepared_again_into_a_new_folder(tmp_path, cache, prepares, tokenizer_dir):
    src = tmp_path / "src"
    flags = ["--train_files", texts(src), "--tokenizer_name", tokenizer_dir]
    train(tmp_path / "run", *flags)
    (first,) = cache.iterdir()
    with open(src / "doc0.txt", "a") as f:
        f.write(" and then the queen came in")
    train(tmp_path / "run2", *flags)
    assert len(prepares) == 2 and prepares[0] == str(first)
    second = prepares[1]
    assert second != str(first) and sorted(os.listdir(cache)) == sorted([first.name, os.path.basename(second)])
    assert os.path.getsize(os.path.join(second, "train.bin")) > os.path.getsize(first / "train.bin")


def first_batch(monkeypatch, out, *flags):
    """The first training batch the model received, as tensors (Base-Loop: one forward a step, no callback)."""
    seen, original = [], LoopFormerForCausalLM.forward

    def forward(self, *args, **kwargs):
        if not seen:
            seen.append({k: v.clone() for k, v in kwargs.items() if torch.is_tensor(v)})
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(LoopFormerForCausalLM, "forward", forward)
        train(out, "--variant", "base_loop", *flags)
    return seen[0]


def test_the_first_batch_of_train_files_is_that_of_prepare_then_data_dir(tmp_path, cache, tokenizer_dir, monkeypatch):
    src = texts(tmp_path / "src", 20)
    direct = first_batch(monkeypatch, tmp_path / "run", "--train_files", src, "--tokenizer_name", tokenizer_dir)
    prepare_cli.main(["--train_files", src, "--tokenizer_name", tokenizer_dir, "--output_dir", str(tmp_path / "data")])
    prepared = first_batch(monkeypatch, tmp_path / "run2", "--data_dir", str(tmp_path / "data"))
    assert direct.keys() == prepared.keys() >= {"input_ids", "labels", "shift_labels"}
    for key in direct:
        assert torch.equal(direct[key], prepared[key]), key
    (folder,) = cache.iterdir()
    for name in ("train.bin", "val.bin"):  # the same bytes: whole documents held out the same way
        assert (folder / name).read_bytes() == (tmp_path / "data" / name).read_bytes()


def test_dataset_name_on_a_folder_of_txt_reads_one_document_a_file_as_train_files(tmp_path, tokenizer_dir):
    src = texts(tmp_path / "src")
    folders = [
        text_cache.prepared_folder(DataArguments(task="text", tokenizer_name=tokenizer_dir, **source))
        for source in ({"train_files": [src]}, {"dataset_name": src})
    ]
    assert folders[0] != folders[1]  # other settings, other keys; the same tokens
    for name in ("train.bin", "tokens.json"):
        assert os.path.exists(os.path.join(folders[1], name))
    metas = [prepare_cli.read_meta(f) for f in folders]
    assert [m["splits"] for m in metas][0] == [m["splits"] for m in metas][1]
    assert sum(s["documents"] for s in metas[1]["splits"].values()) == 8
