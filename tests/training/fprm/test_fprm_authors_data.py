"""The authors' data folders (issue 63, items 1 and 2): `python -m looped_training.fprm.prepare` writes what their
dataset/build_*_dataset.py writes, byte for byte; `python -m looped_training.fprm.train --data` trains on such a
folder with the batches their puzzle_dataset.py draws, and evaluates on its test split in order; `--model_name_or_path`
starts from an authors' model, whose evaluation before the first step is `looped_training.fprm.evaluate_authors`'s.

Their builders and loaders are re-implemented in tests/support/fprm_data_oracle.py; the source CSVs are written here
in the Hub datasets' columns, from puzzles generated in the test (the Hub cannot be reached)."""

import filecmp
import json
import os
import shutil

import numpy as np
import pytest
import torch

from looped_training.fprm import evaluate_authors, prepare
from looped_training.fprm import train as fprm_train
from looped_training.fprm.authors_data import AuthorsSplit
from looped_training.fprm.trainer import FPRMTrainer
from support import fprm_data_oracle as oracle
from support.fprm_reference_oracle import write_published_folder


def same_files(a, b):
    """The files of folder `a` (recursively) and whether each is byte-identical in `b`."""
    names = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, files in os.walk(a) for f in files)
    assert names == sorted(os.path.relpath(os.path.join(d, f), b) for d, _, files in os.walk(b) for f in files)
    return {n: filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    (root / "sudoku").mkdir()
    oracle.write_csv(root / "sudoku" / "train.csv", oracle.sudoku_rows(40, seed=1))
    oracle.write_csv(root / "sudoku" / "test.csv", oracle.sudoku_rows(12, seed=2))
    (root / "maze").mkdir()
    oracle.write_csv(root / "maze" / "train.csv", oracle.maze_rows(12, side=10, seed=1))
    oracle.write_csv(root / "maze" / "test.csv", oracle.maze_rows(5, side=10, seed=2))
    return root


@pytest.mark.parametrize(
    "flags, theirs",
    [
        (["--subsample_size", "25", "--num_aug", "3"], dict(subsample_size=25, num_aug=3)),  # int64: augmented
        (["--min_difficulty", "10"], dict(min_difficulty=10)),  # uint8 without augmentation
    ],
)
def test_prepare_writes_their_sudoku_folder_byte_for_byte(sources, tmp_path, flags, theirs):
    np.random.seed(7)  # their builder draws from the global generator, unseeded: the same calls from --seed 7
    oracle.build_sudoku(sources / "sudoku", tmp_path / "theirs", **theirs)

    def ours(out, seed):
        return prepare.main(["--dataset", str(sources / "sudoku"), "--output_dir", str(out), "--seed", seed, *flags])

    assert ours(tmp_path / "ours", "7") == 0
    same = same_files(tmp_path / "theirs", tmp_path / "ours")
    assert len(same) == 15 and all(same.values()), same  # 2 x (dataset.json, 6 arrays) + identifiers.json
    if "--num_aug" in flags:  # the augmentation draws from the seed: another seed writes other training puzzles
        assert ours(tmp_path / "other", "8") == 0
        assert not filecmp.cmp(
            tmp_path / "ours/train/all__inputs.npy", tmp_path / "other/train/all__inputs.npy", False
        )


def test_prepare_writes_their_maze_folder_byte_for_byte(sources, tmp_path):
    np.random.seed(3)
    oracle.build_maze(sources / "maze", tmp_path / "theirs", subsample_size=9, aug=True)
    argv = ["--dataset", str(sources / "maze"), "--output_dir", str(tmp_path / "ours"), "--seed", "3"]
    assert prepare.main([*argv, "--subsample_size", "9", "--aug"]) == 0
    same = same_files(tmp_path / "theirs", tmp_path / "ours")
    assert len(same) == 13 and all(same.values()), same
    assert np.load(tmp_path / "ours/train/all__inputs.npy").shape == (9 * 8, 100)  # 8 dihedral copies, one group


@pytest.fixture(scope="module")
def folder(sources, tmp_path_factory):
    """A Sudoku folder as their builder writes it (3 augmentations: groups of 4 puzzles), some labels ignored."""
    root = tmp_path_factory.mktemp("authors-folder")
    np.random.seed(0)
    oracle.build_sudoku(sources / "sudoku", root, num_aug=3)
    labels = np.load(root / "train/all__labels.npy")
    labels[::7, :5] = 0  # their ignore_label_id: -100 in the batches
    np.save(root / "train/all__labels.npy", labels)
    return root


MODEL = ["--hidden_size", "32", "--intermediate_size", "64", "--num_attention_heads", "4", "--num_prefix_tokens", "2"]
RUN = [
    "--eval_max_loops", "6", "--eval_batch_size", "4", "--compare_cap", "false", "--disable_tqdm", "true",
    "--torch_threads", "1", "--report_to", "none",
]  # fmt: skip
TINY = MODEL + RUN


def test_training_draws_their_batches_and_evaluates_their_test_split_in_order(folder, tmp_path, monkeypatch):
    seen = []
    original = FPRMTrainer.compute_loss

    def spy(self, model, inputs, *args, **kwargs):
        if model.training:
            seen.append({k: v.clone() for k, v in inputs.items()})
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(FPRMTrainer, "compute_loss", spy)
    # 40 groups x 2 epochs per iteration = 80 draws: 6 batches of 12 per Trainer epoch; 8 steps cross into the second
    argv = ["--data", str(folder), "--output_dir", str(tmp_path / "run"), "--max_steps", "8", "--seed", "5"]
    results = fprm_train.main([*argv, *TINY, "--per_device_train_batch_size", "12", "--epochs_per_iter", "2"])
    theirs = oracle.train_batches(folder, seed=5, global_batch_size=12, epochs_per_iter=2, iters=2)
    assert len(theirs) == 12 and len(seen) == 8
    for ours, their in zip(seen, theirs):
        assert torch.equal(ours["input_ids"], torch.from_numpy(their["inputs"]).long())
        assert torch.equal(ours["labels"], torch.from_numpy(their["labels"]).long())
        assert torch.equal(ours["puzzle_identifiers"], torch.from_numpy(their["puzzle_identifiers"]).long())
    assert any((b["labels"] == -100).any() for b in seen)  # the ignored labels reached a batch, mapped
    assert results["train_steps"] == 8 and np.isfinite(results["log_history"][-1]["train_loss"])
    # the test split, in their order
    test = AuthorsSplit(str(folder), "test")
    their_test = oracle.test_examples(folder)
    assert np.array_equal(test["input_ids"], their_test["inputs"]) and np.array_equal(
        test[:]["labels"], their_test["labels"]
    )
    assert results["halting"]["cell_accuracy"] >= 0 and len(results["iterations_vs_rating"]) > 1


def test_a_maze_folder_trains_and_another_task_is_named(sources, tmp_path):
    assert prepare.main(["--dataset", str(sources / "maze"), "--output_dir", str(tmp_path / "maze")]) == 0
    argv = ["--data", str(tmp_path / "maze"), "--max_steps", "2", "--per_device_train_batch_size", "4", *TINY]
    with pytest.raises(
        ValueError, match=r"holds 100 tokens per example over vocab_size 6 \(maze\); --task is 'sudoku'"
    ):
        fprm_train.main([*argv, "--output_dir", str(tmp_path / "refused")])
    results = fprm_train.main([*argv, "--task", "maze", "--output_dir", str(tmp_path / "run")])
    assert results["train_steps"] == 2 and "iterations_vs_path_length" in results
    # continued at its own size (10x10, not the published 30x30), reported first as `published` reports it
    again = ["--model_name_or_path", str(tmp_path / "run" / "model"), "--eval_before_training", "true"]
    argv = ["--data", str(tmp_path / "maze"), "--max_steps", "1", "--per_device_train_batch_size", "4", *RUN]
    continued = fprm_train.main([*argv, *again, "--task", "maze", "--output_dir", str(tmp_path / "more")])
    before = continued["authors_protocol"]["before_training"]
    assert before["task"] == "maze" and before["puzzles"] == 5 and 0 <= before["cell_accuracy"] <= 1


@pytest.fixture(scope="module")
def published_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fprm-published")
    write_published_folder(root / "sudoku", "sudoku", steps=(10, 20), hidden_size=64, num_heads=4, puzzle_emb_ndim=64)
    return root


def test_fine_tuning_a_published_step_evaluates_first_as_published_does(published_root, folder, tmp_path):
    def published_report(step, seed):
        out = tmp_path / f"published-{step}-{seed}.json"
        argv = [str(published_root), "--subfolder", "sudoku", "--step", str(step), "--data", str(folder)]
        solver = ["--max_loops", "6", "--batch_size", "4", "--halt_eps", "0.5", "--device", "cpu"]
        assert evaluate_authors.main([*argv, *solver, "--seed", str(seed), "--output", str(out)]) == 0
        return {
            k: v for k, v in json.loads(out.read_text()).items() if k not in ("seconds", "model", "subfolder", "step")
        }

    argv = [
        "--model_name_or_path",
        str(published_root),
        "--subfolder",
        "sudoku",
        "--step",
        "10",
        "--data",
        str(folder),
    ]
    flags = ["--eval_before_training", "true", "--eval_halt_eps", "0.5", "--num_test", "12", "--seed", "3"]
    results = fprm_train.main(
        [
            *argv,
            *flags,
            *RUN,
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "8",
            "--output_dir",
            str(tmp_path / "ft"),
        ]
    )
    before = {k: v for k, v in results["authors_protocol"]["before_training"].items() if k != "seconds"}
    assert before == published_report(10, seed=3)
    # what it is sensitive to: the step's weights and the seed of the z0 draws
    assert published_report(20, seed=3)["cell_accuracy"] != before["cell_accuracy"]
    assert published_report(10, seed=4)["cell_accuracy"] != before["cell_accuracy"]
    after = results["authors_protocol"]["after_training"]
    assert results["train_steps"] == 2 and after["puzzles"] == 12 and after["cell_accuracy"] != before["cell_accuracy"]


def test_a_resumed_run_draws_the_batches_of_the_uninterrupted_one(folder, tmp_path, monkeypatch):
    seen = []
    original = FPRMTrainer.compute_loss

    def spy(self, model, inputs, *args, **kwargs):
        if model.training:
            seen.append((self.state.global_step, inputs["input_ids"].clone()))
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(FPRMTrainer, "compute_loss", spy)
    argv = ["--data", str(folder), "--max_steps", "7", "--per_device_train_batch_size", "16", *TINY, "--num_test", "2"]
    fprm_train.main([*argv, "--output_dir", str(tmp_path / "whole")])
    whole = dict(seen)
    seen.clear()
    run = ["--output_dir", str(tmp_path / "cut"), "--save_strategy", "steps", "--save_steps", "4"]
    fprm_train.main([*argv, *run])
    for name in ("results.json", "model", "trainer_state.json", "fprm_run.json"):  # as a run killed after step 4
        path = tmp_path / "cut" / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    seen.clear()
    fprm_train.main([*argv, *run, "--resume_from_checkpoint", str(tmp_path / "cut" / "checkpoint-4")])
    resumed = dict(seen)
    # 40 groups give 2 batches of 16 per iteration: steps 4..6 (0-based) are their iterations 3 and 4
    assert sorted(resumed) == [4, 5, 6] and all(torch.equal(resumed[s], whole[s]) for s in resumed)
