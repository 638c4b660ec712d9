"""A torch dynamic-int8 LoopFormer runs with gradients on (it once raised RuntimeError "dimension of input tensor
should be larger than or equal to 2": the step's 1-D conditioning reached a quantised Linear), as a Llama does."""

import torch

from support.bad_input_table import IDS, loopformer_config


def test_a_dynamic_int8_loopformer_runs_with_gradients_on_as_with_them_off():
    from loopformer_hf import LoopFormerForCausalLM

    torch.manual_seed(0)
    model = LoopFormerForCausalLM(loopformer_config()).eval()
    quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    with torch.no_grad():
        expected = quantized(IDS).logits
    got = quantized(IDS).logits  # gradients on: each block computes its adaLN vectors itself
    torch.testing.assert_close(got.detach(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(IDS).logits.detach(), expected, rtol=0.1, atol=0.1)  # int8: close, not equal
