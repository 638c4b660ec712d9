"""Weight names are an API: a checkpoint saved by an earlier version (tests/fixtures/loopformer_13b849a, saved by
this package at commit 13b849a, with the logits and greedy tokens that version computed) loads unchanged and computes
the same."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import loopformer_hf

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "loopformer_13b849a"


@pytest.mark.parametrize("loader", [loopformer_hf.LoopFormerForCausalLM, AutoModelForCausalLM])
def test_a_checkpoint_of_13b849a_loads_and_computes_what_it_computed(loader):
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    model, info = loader.from_pretrained(FIXTURE, output_loading_info=True)
    assert isinstance(model, loopformer_hf.LoopFormerForCausalLM)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    model.eval()
    ids = expected["input_ids"]
    with torch.no_grad():
        for M in (1, 2, 3):
            torch.testing.assert_close(model(ids, loop_budget=M).logits, expected[f"logits_M{M}"], rtol=0, atol=1e-6)
        generated = model.generate(ids, max_new_tokens=5, do_sample=False, loop_budget=3)
    assert torch.equal(generated, expected["generate_M3"])
