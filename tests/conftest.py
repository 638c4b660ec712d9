import os

import pytest
import torch

# Deterministic, quiet, and small enough for two cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import loopformer_hf  # noqa: E402  (registers the Auto classes)


def tiny_loopformer_config(**overrides):
    kwargs = dict(
        vocab_size=97, hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
        num_loops=4, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2,
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


@pytest.fixture
def tiny_config():
    return tiny_loopformer_config()


@pytest.fixture
def tiny_model(tiny_config):
    torch.manual_seed(0)
    return randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_config)).eval()


def cache_of(output):
    """The returned KV cache: transformers 5.24 names the field `cache`, earlier 5.x releases `past_key_values`."""
    from loopformer_hf.modeling_loopformer import CACHE_FIELD

    return getattr(output, CACHE_FIELD)
