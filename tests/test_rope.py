"""Both models' RoPE reads transformers' `rope_parameters` as Llama does: the default computes what the former
`rope_theta` field did, bit for bit; a config saved with `rope_theta` loads into it; a partial rotation rotates only
its share of each head; LoopFormer's scaled types (linear, dynamic, YaRN) decode with the cache as without it, and
FPRM's change what a sequence model computes as transformers' common tests expect (its grid models cannot take their
inputs). The frequencies of each type are checked by transformers' common tests (test_transformers_common*.py)."""

import json

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError

from fprm_hf import FPRMForReasoning
from fprm_hf.layers_fprm import FPRMRotaryEmbedding, apply_rotary_pos_emb
from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM
from loopformer_hf.modeling_loopformer import LoopFormerRotaryEmbedding, apply_rotary_pos_emb, rotate_half
from support.tiny_models import sequence_fprm_config, tiny_fprm, tiny_fprm_config, tiny_loopformer_config


def apply_rotary_k(x, cos, sin):  # RoPE on one tensor
    return apply_rotary_pos_emb(None, x, cos, sin)[1]


def rope_config(**overrides):
    return tiny_loopformer_config(position_embedding_type="rope", hidden_act="swiglu", **overrides)


@pytest.mark.parametrize("model", ["loopformer", "fprm"])
def test_the_default_is_the_former_rope_theta_formula_bit_for_bit(model):
    if model == "loopformer":
        config, rope = rope_config(rope_parameters={"rope_theta": 500.0}), LoopFormerRotaryEmbedding
    else:
        config, rope = tiny_fprm_config(rope_parameters={"rope_theta": 500.0}), FPRMRotaryEmbedding
    positions = torch.arange(37)[None]
    cos, sin = rope(config)(torch.zeros(1), positions)
    d = config.head_dim  # the former code: inv_freq of the head dimension, cos/sin of (freqs, freqs)
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    emb = torch.cat([positions[..., None].float() * inv_freq] * 2, dim=-1)
    assert torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())


def test_a_config_saved_with_rope_theta_loads_into_rope_parameters(tmp_path):
    torch.manual_seed(0)
    model = LoopFormerForCausalLM(rope_config(rope_parameters={"rope_theta": 500.0})).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}
    saved.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_theta": 500.0}))  # as earlier versions saved it
    old = LoopFormerForCausalLM.from_pretrained(tmp_path).eval()
    assert old.config.rope_parameters["rope_theta"] == 500.0
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        assert torch.equal(old(ids).logits, model(ids).logits)
        other = LoopFormerForCausalLM(rope_config()).eval()
        other.load_state_dict(model.state_dict())
        assert not torch.allclose(other(ids).logits, model(ids).logits)  # rope_theta 1e4 computes another function


def test_a_partial_rotation_rotates_only_its_share_of_each_head():
    config = rope_config(hidden_size=64, num_attention_heads=4, rope_parameters={"partial_rotary_factor": 0.5})
    assert config.rotary_dim == 8  # half of head_dim 16
    cos, sin = LoopFormerRotaryEmbedding(config)(torch.zeros(1), torch.arange(5)[None])
    x = torch.randn(1, 4, 5, 16)
    out = apply_rotary_k(x, cos[:, None], sin[:, None])
    first = x[..., :8]
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert torch.equal(out[..., :8], first * cos[:, None] + rotate_half(first) * sin[:, None])
    assert not torch.allclose(out[..., 1:, :8], first[..., 1:, :])  # position 0 is the identity; later ones rotate


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"partial_rotary_factor": 0.5},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    ],
    ids=["partial", "linear", "dynamic", "yarn"],
)
def test_scaled_and_partial_rope_decode_with_the_cache_as_without_it(rope_parameters):
    torch.manual_seed(0)
    model = LoopFormerForCausalLM(rope_config(hidden_size=64, rope_parameters=rope_parameters)).eval()
    ids = torch.randint(3, 97, (1, 9))
    kwargs = dict(max_new_tokens=12, do_sample=False, loop_budget=2)
    cached = model.generate(ids, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    with torch.no_grad():  # and the rotation matters: another RoPE gives other logits (dynamic: past the 128
        plain = LoopFormerForCausalLM(rope_config(hidden_size=64)).eval()  # positions of max_position_embeddings)
        plain.load_state_dict(model.state_dict())
        long_ids = torch.randint(3, 97, (1, 160))
        assert not torch.allclose(plain(long_ids).logits, model(long_ids).logits)


def test_rope_parameters_on_a_learned_position_model_are_refused():
    with pytest.raises(StrictDataclassError, match="apply to position_embedding_type='rope'"):
        LoopFormerConfig(num_loops=2, rope_parameters={"rope_type": "linear", "factor": 2.0})


# ---- FPRM ----------------------------------------------------------------------------------------------------------


def rope_fprm(**rope_parameters):
    """A sequence FPRM (any length) with RoPE, fixed seed, so that two calls differ only in `rope_parameters`."""
    config = sequence_fprm_config(
        position_embedding_type="rope", max_position_embeddings=16, rope_parameters=rope_parameters or None
    )
    return tiny_fprm(0, config=config)


def _state(model, ids):
    with torch.no_grad():
        return model(ids, halting=False, max_loops=3).logits


def test_an_fprm_config_with_rope_theta_loads_into_rope_parameters(tmp_path):
    model = tiny_fprm(0, config=tiny_fprm_config(rope_theta=500.0))  # the authors' converted configs pass it so
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_theta": 500.0}))  # as earlier versions saved it
    old = FPRMForReasoning.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 7, (2, 16))
    assert old.config.rope_parameters["rope_theta"] == 500.0 and torch.equal(_state(old, ids), _state(model, ids))


def test_fprm_rope_scaling_changes_what_a_sequence_model_computes_as_transformers_expects():
    short, long = torch.randint(0, 7, (1, 10)), torch.randint(0, 7, (1, 24))  # 24 > max_position_embeddings 16
    plain = rope_fprm()
    for kind in ("linear", "dynamic", "yarn"):
        scaled = rope_fprm(rope_type=kind, factor=4.0)
        # dynamic scaling starts past max_position_embeddings: a short input is computed as without it
        assert torch.equal(_state(scaled, short), _state(plain, short)) == (kind == "dynamic"), kind
        assert not torch.allclose(_state(scaled, long), _state(plain, long)), kind


def test_an_fprm_partial_rotation_rotates_only_its_share_of_each_head():
    model = rope_fprm(partial_rotary_factor=0.5)
    assert model.config.rotary_dim == model.config.head_dim // 2
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(6)[None])
    q, k = torch.randn(2, 1, 4, 6, model.config.head_dim).unbind(0)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos[:, None], sin[:, None])
    d = model.config.rotary_dim
    for x, out in ((q, q_out), (k, k_out)):
        assert torch.equal(out[..., d:], x[..., d:])
        assert torch.equal(out[..., :d], x[..., :d] * cos[:, None] + rotate_half(x[..., :d]) * sin[:, None])
    ids = torch.randint(0, 7, (1, 12))
    assert not torch.allclose(_state(model, ids), _state(rope_fprm(), ids))
