"""Every tiny configuration and model the tests build, for both models: one factory per layout, and a test passes
what it needs to differ as keyword overrides (so its sizes are read where it builds the model)."""

import torch

import loopformer_hf
from fprm_hf import FPRMConfig, FPRMForReasoning

# ---- LoopFormer ----------------------------------------------------------------------------------------------------


def tiny_loopformer_config(**overrides):
    """k=2 blocks looped L=4 times, d=64, 4 heads, a 97-token vocabulary, 128 positions."""
    kwargs = dict(
        vocab_size=97,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        num_hidden_layers=2,
        num_loops=4,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return loopformer_hf.LoopFormerConfig(**kwargs)


def randomize_modulation(model, std=0.05, seed=0):
    """adaLN starts at zero (zero_adaln) or small (reference init): give it large random weights so that loops and Δ
    matter clearly in tests."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std + (0.5 if name.endswith("bias") else 0.0))
    return model


def cache_of(output):
    """The returned KV cache: transformers 5.24 names the field `cache`, earlier 5.x releases `past_key_values`."""
    from loopformer_hf.modeling_loopformer import CACHE_FIELD

    return getattr(output, CACHE_FIELD)


# ---- FPRM ----------------------------------------------------------------------------------------------------------


def tiny_fprm_config(**overrides):
    """A 4x4 grid FPRM (2-D conv, two prefix tokens), d=32, two layers, cap 30."""
    kwargs = dict(
        vocab_size=7,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=2,
        grid_size=4,
        conv_type="2d",
        num_prefix_tokens=2,
        max_loops=30,
    )
    kwargs.update(overrides)
    return FPRMConfig(**kwargs)


def sequence_fprm_config(**overrides):
    """The state-tracking layout: causal, 1-D causal conv, no positions, no prefix tokens."""
    kwargs = dict(
        grid_size=None, conv_type="causal_1d", causal=True, position_embedding_type="none", num_prefix_tokens=0
    )
    kwargs.update(overrides)
    return tiny_fprm_config(**kwargs)


def tiny_fprm(seed=0, config=None, **overrides):
    """A tiny FPRM in eval mode, weights drawn after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    return FPRMForReasoning(config if config is not None else tiny_fprm_config(**overrides)).eval()


def grid_inputs(batch=3, seed=1, vocab=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, 16), generator=g)


# ---- either model ----------------------------------------------------------------------------------------------------


def randomize_parameters(module, std, seed=0):
    """Every parameter of `module` drawn from N(0, std²) (one generator): a layer tested against a re-implementation
    computes something that depends on each of its weights, not on an initialisation that zeroes some of them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module
