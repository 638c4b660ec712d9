"""layers_fprm.py: FPRM's layers against plain PyTorch written here from their definitions (SwiGLU, the depthwise
convs, attention with its temperature, the sub-layer h ← α1·h + β1·F(RMSNorm(h))), the tied residual coefficients
against the identities they are tied by, and the truncated normal that draws z0 and the weights."""

import math

import pytest
import torch
import torch.nn.functional as F
from support.tiny_models import randomize_parameters, sequence_fprm_config, tiny_fprm_config

from fprm_hf.layers_fprm import (
    BETA1_EPS,
    FPRMMLP,
    FPRMAttention,
    FPRMBlock,
    FPRMDepthwiseConv,
    FPRMResidualScaling,
    sample_truncated_normal,
    truncated_normal_std,
)

D = 32


def _randomize(module):
    return randomize_parameters(module, std=0.3)


def _eager(config):
    config._attn_implementation = "eager"
    return config


def test_the_truncated_normal_has_the_std_it_is_given_and_stays_within_two_of_its_own():
    std = 0.5
    scale = truncated_normal_std(std)
    assert scale > std  # cutting the tails narrows a normal: the untruncated one is wider
    g = torch.Generator().manual_seed(0)
    draws = sample_truncated_normal((200_000,), std, generator=g)
    assert abs(draws.std().item() - std) < 0.005 and abs(draws.mean().item()) < 0.005
    assert draws.abs().max() <= 2 * scale + 1e-6
    again = sample_truncated_normal((200_000,), std, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)  # one generator decides every value


def test_the_mlp_is_swiglu_with_a_fused_gate_and_up():
    mlp = _randomize(FPRMMLP(tiny_fprm_config()))
    x = torch.randn(2, 5, D)
    gate, up = mlp.gate_up_proj(x).chunk(2, -1)
    torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(gate) * up))


def test_the_causal_conv_sums_the_last_k_tokens_of_each_channel():
    config = sequence_fprm_config(conv_bias=True)
    conv = _randomize(FPRMDepthwiseConv(config))
    k = config.conv_kernel_size
    y = torch.randn(1, 6, D)
    out = conv(y)
    w, b = conv.weight[:, 0], conv.bias  # (D, k)
    for i in range(6):
        expected = b + sum(w[:, j] * y[0, i - (k - 1) + j] for j in range(k) if i - (k - 1) + j >= 0)
        torch.testing.assert_close(out[0, i], expected)


def test_the_grid_conv_is_a_same_padded_kernel_over_the_grid_and_skips_the_prefix():
    config = tiny_fprm_config()  # 4x4 grid, two prefix rows, k = 3
    conv = _randomize(FPRMDepthwiseConv(config))
    y = torch.randn(1, 2 + 16, D)
    out = conv(y)
    assert out.shape == (1, 16, D)
    grid, w = y[0, 2:].view(4, 4, D), conv.weight[:, 0]  # (D, 3, 3)
    for r in range(4):
        for c in range(4):
            expected = sum(
                w[:, a, b] * grid[r + a - 1, c + b - 1]
                for a in range(3)
                for b in range(3)
                if 0 <= r + a - 1 < 4 and 0 <= c + b - 1 < 4
            )
            torch.testing.assert_close(out[0, 4 * r + c], expected)


def _attention(attn, h, causal):
    b, s, _ = h.shape
    q, k, v = (t.view(b, s, -1, attn.head_dim).transpose(1, 2) for t in attn.qkv_proj(h).chunk(3, -1))
    scores = q @ k.transpose(-1, -2) / (math.sqrt(attn.head_dim) * attn.config.softmax_temperature)
    if causal:
        scores = scores.masked_fill(~torch.tril(torch.ones(s, s, dtype=torch.bool)), float("-inf"))
    return attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_is_bidirectional_for_grids_causal_for_sequences_with_its_temperature(causal):
    config = _eager(sequence_fprm_config(softmax_temperature=2.0) if causal else tiny_fprm_config())
    attn = _randomize(FPRMAttention(config))
    h = torch.randn(2, 5, D)
    torch.testing.assert_close(attn(h), _attention(attn, h, causal))


def test_tied_betas_keep_a_state_of_ones_at_ones_through_the_loop_step():
    # the docstring's step with y' = 1, x = 0 and every sub-layer giving 1: h = α2·y' + β2·x, then h ← α1·h + β1·1 for
    # 2N sub-layers; the tying makes the weights on y' and on the sub-layers' outputs sum to 1 (up to its 1e-5)
    config = tiny_fprm_config(residual_scaling="fixed", alpha1=0.3, alpha2=0.8)
    alpha1, beta1, alpha2, beta2 = FPRMResidualScaling(config)(torch.zeros(1, 1, D))
    assert alpha1.item() == pytest.approx(0.3) and alpha2.item() == pytest.approx(0.8)
    h = alpha2 * 1.0 + beta2 * 0.0
    for _ in range(2 * config.num_hidden_layers):
        h = alpha1 * h + beta1 * 1.0
    assert h.item() == pytest.approx(1.0, abs=2 * BETA1_EPS)
    torch.testing.assert_close(alpha2 * alpha1 ** (2 * config.num_hidden_layers) + beta2, torch.tensor(1.0))


def test_outer_only_learned_and_no_scaling():
    y = torch.randn(1, 3, D)
    outer = _randomize(FPRMResidualScaling(tiny_fprm_config(outer_only=True)))
    a1, b1, a2, b2 = outer(y)
    assert (a1, b1) == (1.0, 1.0) and outer.alpha1_logit is None
    torch.testing.assert_close(a2, torch.sigmoid(outer.alpha2_logit))
    torch.testing.assert_close(b2, 1 - a2)
    per_token = _randomize(FPRMResidualScaling(tiny_fprm_config(residual_scaling="input_dependent")))
    assert per_token(y)[0].shape == (1, 3, D)
    torch.testing.assert_close(per_token(y)[0], torch.sigmoid(per_token.alpha1_proj(y)))
    assert FPRMResidualScaling(tiny_fprm_config(residual_scaling="none"))(y) == (1.0, 1.0, 1.0, 1.0)


def _rms(x, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("norm_type", ["pre", "peri", "post"])
def test_a_block_is_two_scaled_sub_layers_with_the_norm_where_norm_type_puts_it(norm_type):
    config = _eager(tiny_fprm_config(norm_type=norm_type))
    block = _randomize(FPRMBlock(config))
    h, a1, b1, eps = torch.randn(2, 5, D), 0.7, 0.4, config.rms_norm_eps

    def sublayer(h, f):
        if norm_type == "post":
            return _rms(a1 * h + b1 * f(h), eps)
        out = f(_rms(h, eps))
        return a1 * h + b1 * (_rms(out, eps) if norm_type == "peri" else out)

    expected = sublayer(sublayer(h, lambda x: _attention(block.self_attn, x, False)), block.mlp)
    torch.testing.assert_close(block(h, a1, b1), expected)
