"""Real text: the same scripts train and evaluate on the Shakespeare plays in ../shared/data/shakespeare."""

import json
import math
import os

import pytest

from looped_training.loopformer import evaluate as evaluate_elastic
from looped_training.loopformer import train as train_loopformer
from looped_training.loopformer.data import corpus
from support import REPO_ROOT

REPO = str(REPO_ROOT)
SHAKESPEARE = os.path.join(REPO, "..", "shared", "data", "shakespeare")
pytestmark = pytest.mark.skipif(
    not os.path.isdir(SHAKESPEARE),
    reason=f"the Shakespeare corpus is not at {os.path.normpath(SHAKESPEARE)} (it lives beside the repository, "
    f"in ../shared/data/shakespeare, and is not part of it)",
)


def test_the_plays_are_read_as_documents():
    docs = corpus.load_documents(train_files=[SHAKESPEARE])["text"]
    assert len(docs) == 39
    assert sum(len(d) for d in docs) > 4_000_000  # the whole 4.6 MB corpus, one document per file


def test_train_and_evaluate_on_shakespeare(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")  # the prepared plays
    out = tmp_path / "run"
    plays = sorted(os.path.join(SHAKESPEARE, n) for n in os.listdir(SHAKESPEARE))[:8]
    trainer = train_loopformer.main(
        [
            "--output_dir",
            str(out),
            "--variant",
            "loopformer",
            "--task",
            "text",
            "--train_files",
            *plays,
            "--validation_fraction",
            "0.25",
            "--block_size",
            "32",
            "--tokenizer_vocab_size",
            "400",
            "--hidden_size",
            "32",
            "--num_attention_heads",
            "2",
            "--num_loops",
            "3",
            "--per_device_train_batch_size",
            "8",
            "--max_steps",
            "4",
            "--learning_rate",
            "3e-3",
            "--use_cpu",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--seed",
            "0",
        ]
    )
    losses = [h["ce_full"] for h in trainer.state.log_history if "ce_full" in h]
    assert len(losses) == 4 and losses[-1] < losses[0]
    meta = json.loads((out / train_loopformer.TRAINING_META_FILE).read_text())
    assert meta["data"]["task"] == "text"
    records = evaluate_elastic.main(
        [
            str(out),
            "--output_dir",
            str(tmp_path / "eval"),
            "--max_rows",
            "16",
            "--repr_rows",
            "4",
            "--schedules",
            "uniform",
        ]
    )
    ppl = [r["ppl"] for r in records[0]["results"]]
    assert len(ppl) == 3 and all(math.isfinite(p) and 1 < p < 400 for p in ppl)
    assert records[0]["results"][0]["em"] is None  # exact match is for the reasoning task only
