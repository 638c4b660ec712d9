"""loopformer_hf/authors/weights.py: the authors' weight names onto this package's (their wrapper prefixes stripped, the blocks and
embedders renamed, the fused c_attn split into q, k, v), the one table every loader maps with."""

import pytest
import torch

from loopformer_hf.authors.weights import (
    is_reference_weight_name,
    map_names,
    mapped_reference_state_dict,
    strip_wrapper_prefixes,
    wrapper_prefix,
)


def test_wrapper_prefixes_are_stripped_repeatedly_and_must_be_one():
    assert strip_wrapper_prefixes({"gpt.model.transformer.wte.weight": 1, "lm_head.weight": 2}) == {
        "transformer.wte.weight": 1,
        "lm_head.weight": 2,
    }
    with pytest.raises(ValueError, match="two tensors"):
        strip_wrapper_prefixes({"gpt.a": 1, "module.a": 2})
    assert wrapper_prefix(["gpt.model.transformer.wte.weight", "gpt.model.dt_embedder.mlp.0.weight"]) == "gpt.model."
    assert wrapper_prefix(["transformer.wte.weight"]) == ""
    with pytest.raises(ValueError, match="several wrapper prefixes"):
        wrapper_prefix(["gpt.transformer.wte.weight", "module.transformer.wpe.weight"])


def test_their_names_are_told_from_ours():
    assert is_reference_weight_name("module.transformer.h.blocks.0.attn.c_attn.weight")
    assert is_reference_weight_name("dt_embedder.mlp.0.weight")
    assert not is_reference_weight_name("model.layers.0.self_attn.q_proj.weight")
    assert not is_reference_weight_name("lm_head.weight")


def test_every_tensor_gets_our_name_and_the_fused_qkv_splits_in_three():
    d = 4
    qkv = torch.arange(3 * d * d, dtype=torch.float32).view(3 * d, d)
    theirs = {
        "gpt.transformer.wte.weight": torch.zeros(10, d),
        "gpt.transformer.wpe.weight": torch.zeros(8, d),
        "gpt.transformer.norm_f.weight": torch.zeros(d),
        "gpt.transformer.h.blocks.1.attn.c_attn.weight": qkv,
        "gpt.transformer.h.blocks.1.attn.c_proj.weight": torch.zeros(d, d),
        "gpt.transformer.h.blocks.1.mlp.c_fc.weight": torch.zeros(2 * d, d),
        "gpt.transformer.h.blocks.1.mlp.c_proj.weight": torch.zeros(d, 2 * d),
        "gpt.transformer.h.blocks.1.norm_1.weight": torch.zeros(d),
        "gpt.transformer.h.blocks.1.norm_2.weight": torch.zeros(d),
        "gpt.time_embedder.mlp.0.weight": torch.zeros(d, 6),
        "gpt.dt_embedder.mlp.2.bias": torch.zeros(d),
        "gpt.lm_head.weight": torch.zeros(10, d),
    }
    ours = mapped_reference_state_dict(theirs)
    assert set(ours) == {
        "model.embed_tokens.weight",
        "model.embed_positions.weight",
        "model.norm.weight",
        *(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"),
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.loop_conditioning.time_embedder.mlp.0.weight",
        "model.loop_conditioning.dt_embedder.mlp.2.bias",
    }  # the tied head is the embedding
    for i, part in enumerate("qkv"):
        torch.testing.assert_close(ours[f"model.layers.1.self_attn.{part}_proj.weight"], qkv[i * d : (i + 1) * d])


def test_base_blocks_in_a_plain_list_and_a_head_stored_alone():
    rows = list(map_names({"transformer.h.3.mlp.c_fc.weight": torch.zeros(1), "lm_head.weight": torch.zeros(1)}))
    assert [ours for _, ours, _ in rows] == ["model.layers.3.mlp.up_proj.weight", "model.embed_tokens.weight"]
