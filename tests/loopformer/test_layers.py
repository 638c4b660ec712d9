"""layers_loopformer.py: each layer against a few lines of plain PyTorch written here from its definition (RMSNorm,
RoPE, the MLP, the sinusoidal embedder, the loop conditioning c_i = TimeEmb(t_{i-1}) + StepEmb(Δ_i), the adaLN
block)."""

import math

import pytest
import torch
import torch.nn.functional as F
from support.tiny_models import randomize_parameters, tiny_loopformer_config

from loopformer_hf.modeling_loopformer import (
    LoopFormerBlock,
    LoopFormerLoopConditioning,
    LoopFormerMLP,
    LoopFormerRMSNorm,
    LoopFormerRotaryEmbedding,
    LoopFormerTimestepEmbedder,
    apply_rotary_pos_emb,
)

D = 64


def apply_rotary_k(x, cos, sin):  # RoPE on one tensor
    return apply_rotary_pos_emb(None, x, cos, sin)[1]


def _config(**overrides):
    config = tiny_loopformer_config(**{"rms_norm_eps": 1e-6, **overrides})
    config._attn_implementation = "eager"
    return config


def _hidden(output):  # a block's output: its hidden states first
    return output if isinstance(output, torch.Tensor) else output[0]


def _randomize(module):
    return randomize_parameters(module, std=0.2)


def _rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_rms_norm_with_its_weight_with_none_and_with_a_modulated_one():
    torch.manual_seed(0)
    x, scale = torch.randn(2, 3, D), torch.randn(D)
    norm = _randomize(LoopFormerRMSNorm(D, eps=1e-5))
    torch.testing.assert_close(norm(x), _rms(x, norm.weight, 1e-5))
    torch.testing.assert_close(norm(x, norm.modulated_weight(scale)), _rms(x, norm.weight * (1 + scale), 1e-5))
    bare = LoopFormerRMSNorm(D, eps=1e-5, weight=False)
    assert bare.weight is None and not list(bare.parameters())
    torch.testing.assert_close(bare(x, bare.modulated_weight(scale)), _rms(x, 1 + scale, 1e-5))


def test_rotary_frequencies_are_theta_to_the_minus_2i_over_d_and_rotate_pairs():
    config = _config(position_embedding_type="rope")
    rope = LoopFormerRotaryEmbedding(config)
    dim, theta = config.rotary_dim, config.rope_parameters["rope_theta"]
    torch.testing.assert_close(rope.inv_freq, torch.tensor([theta ** (-2 * i / dim) for i in range(dim // 2)]))
    x = torch.randn(1, 4, 5, dim)
    cos, sin = rope(x, torch.arange(5)[None])
    assert cos.shape == (1, 5, dim)
    rotated = apply_rotary_k(x, cos[:, None], sin[:, None])
    # channel i and i + dim/2 rotate together by position·inv_freq[i]: each pair's length is kept
    pairs = lambda t: t[..., : dim // 2] ** 2 + t[..., dim // 2 :] ** 2
    torch.testing.assert_close(pairs(rotated), pairs(x))
    torch.testing.assert_close(rotated[..., 0, :], x[..., 0, :])  # position 0: no rotation


def test_rotary_scores_depend_on_the_distance_between_positions_alone():
    rope = LoopFormerRotaryEmbedding(_config(position_embedding_type="rope"))
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        cos, sin = rope(q, torch.tensor([[i, j]]))
        cos, sin = cos[:, None], sin[:, None]
        return (
            apply_rotary_k(q, cos[..., :1, :], sin[..., :1, :]) * apply_rotary_k(k, cos[..., 1:, :], sin[..., 1:, :])
        ).sum()

    torch.testing.assert_close(score(3, 1), score(12, 10), atol=1e-5, rtol=1e-5)


def test_partial_rotary_leaves_the_channels_past_cos_unchanged():
    x = torch.randn(1, 2, 3, 8)
    cos, sin = torch.full((1, 1, 3, 4), 0.6), torch.full((1, 1, 3, 4), 0.8)
    out = apply_rotary_k(x, cos, sin)
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    torch.testing.assert_close(out[..., :2], x[..., :2] * 0.6 - x[..., 2:4] * 0.8)


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_mlp_is_down_of_act_of_up_or_the_gated_form(act):
    config = _config(hidden_act=act)
    mlp = _randomize(LoopFormerMLP(config))
    x = torch.randn(2, 3, D)
    if act == "gelu":
        expected = mlp.down_proj(F.gelu(mlp.up_proj(x)))
    else:
        expected = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected)


def test_timestep_embedder_is_an_mlp_of_cos_then_sin_features():
    config = _config()
    embedder = _randomize(LoopFormerTimestepEmbedder(config))
    t = torch.tensor([0.0, 0.25, 0.75])
    half = config.frequency_embedding_size // 2
    freqs = [math.exp(-math.log(config.max_period) * i / half) for i in range(half)]
    features = torch.tensor([[math.cos(v * f) for f in freqs] + [math.sin(v * f) for f in freqs] for v in t.tolist()])
    torch.testing.assert_close(embedder(t, torch.float32), embedder.mlp(features))


def test_shortcut_conditioning_is_time_so_far_plus_step_size():
    cond = _randomize(LoopFormerLoopConditioning(_config()))
    trajectory = (0.5, 0.25, 0.25)
    c = cond(trajectory, "cpu", torch.float32)
    time = cond.time_embedder(torch.tensor([0.0, 0.5, 0.75]), torch.float32)
    step = cond.dt_embedder(torch.tensor(trajectory), torch.float32)
    torch.testing.assert_close(c, time + step)
    # per-row trajectories: each row's vectors are those of its trajectory alone
    rows = cond(torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]), "cpu", torch.float32)
    assert rows.shape == (2, 3, D)
    torch.testing.assert_close(rows[0], c)
    torch.testing.assert_close(rows[1, 0], cond((1.0,), "cpu", torch.float32)[0])


def test_timestep_conditioning_is_the_loop_index_and_none_is_none():
    cond = _randomize(LoopFormerLoopConditioning(_config(loop_conditioning="timestep")))
    assert not hasattr(cond, "dt_embedder")
    torch.testing.assert_close(
        cond((0.5, 0.5), "cpu", torch.float32), cond.time_embedder(torch.tensor([0.0, 1.0]), torch.float32)
    )
    none = LoopFormerLoopConditioning(_config(loop_conditioning="none"))
    assert none((1.0,), "cpu", torch.float32) is None and not list(none.parameters())


def _causal_additive(seq):
    return torch.triu(torch.full((seq, seq), torch.finfo(torch.float32).min), 1)[None, None]


def _attention(attn, x):  # plain causal multi-head attention, no RoPE
    b, s, _ = x.shape
    heads = lambda t: t.view(b, s, -1, attn.head_dim).transpose(1, 2)
    q, k, v = heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x))
    scores = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim) + _causal_additive(s)
    return attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))


def test_a_block_without_conditioning_is_a_plain_pre_norm_block():
    config = _config(loop_conditioning="none", block_norm_weight=True)
    block = _randomize(LoopFormerBlock(config, 0)).eval()
    assert not hasattr(block, "adaLN_modulation")
    x = torch.randn(2, 5, D)
    h = x + _attention(block.self_attn, _rms(x, block.input_layernorm.weight, config.rms_norm_eps))
    expected = h + block.mlp(_rms(h, block.post_attention_layernorm.weight, config.rms_norm_eps))
    torch.testing.assert_close(_hidden(block(x, None, _causal_additive(5))), expected)


def test_a_block_applies_adaln_gates_and_scales_from_its_conditioning():
    config = _config()
    block = _randomize(LoopFormerBlock(config, 0)).eval()
    x, c = torch.randn(2, 5, D), torch.randn(D)
    gate_attn, gate_mlp, scale_attn, scale_mlp = block.adaLN_modulation(c[None])[0].chunk(4)
    eps = config.rms_norm_eps
    h = x + gate_attn * _attention(block.self_attn, _rms(x, 1 + scale_attn, eps))
    expected = h + gate_mlp * block.mlp(_rms(h, 1 + scale_mlp, eps))
    torch.testing.assert_close(_hidden(block(x, c, _causal_additive(5))), expected, atol=1e-5, rtol=1e-5)
    # zero gates (adaLN's zero init): the block is the identity
    with torch.no_grad():
        block.adaLN_modulation[1].weight.zero_(), block.adaLN_modulation[1].bias.zero_()
    torch.testing.assert_close(_hidden(block(x, c, _causal_additive(5))), x)
