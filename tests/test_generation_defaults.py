"""Issue 39: a trained folder decodes the same through `pipeline()` as through `generate` (greedy, written into its
generation_config.json)."""

import json

import pytest
import torch
from transformers import pipeline

import loopformer_hf  # noqa: F401  (registers the Auto classes)

TRAIN_TINY = ["--preset", "synthetic-tiny", "--hidden_size", "32", "--num_attention_heads", "2",
              "--num_train_problems", "64", "--num_eval_problems", "24", "--per_device_train_batch_size", "8",
              "--max_steps", "2", "--save_strategy", "no", "--disable_tqdm", "true"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A synthetic-task run of the training command (2 steps: near-uniform next-token distributions, which sampling
    would show at once): its folder and its record."""
    from looped_training.loopformer import train

    path = tmp_path_factory.mktemp("trained") / "run"
    train.main([*TRAIN_TINY, "--output_dir", str(path)])
    return path, json.loads((path / "loopformer_training.json").read_text())


def test_a_trained_folder_decodes_greedily_through_a_pipeline_with_no_argument(trained):
    # the same prompt gave 2, 0, 3, 9, 0: pipeline's default (sampling, T=0.7) applied
    path, record = trained
    assert json.loads((path / "generation_config.json").read_text())["do_sample"] is False
    pipe = pipeline("text-generation", model=str(path))
    outputs = []
    for seed in range(5):
        torch.manual_seed(seed)
        outputs.append(pipe(record["prompt"], return_tensors=True)[0]["generated_token_ids"])
    ids = pipe.tokenizer(record["prompt"], return_tensors="pt").input_ids
    greedy = pipe.model.generate(ids)[0].tolist()
    assert all(list(out) == greedy for out in outputs), outputs
