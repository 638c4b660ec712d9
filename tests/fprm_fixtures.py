"""FPRM test fixtures, one place for every FPRM test file (LoopFormer's are in conftest.py): tiny grid and sequence
configurations, a seeded tiny model, grid inputs, and the one-thread fixture."""

import pytest
import torch

from fprm_hf import FPRMConfig, FPRMForReasoning


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine run several times faster on one thread than on two. Autouse in every
    module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_fprm_config(**overrides):
    """A 4x4 grid FPRM (2-D conv, two prefix tokens), d=32, two layers, cap 30."""
    kwargs = dict(
        vocab_size=7, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
        grid_size=4, conv_type="2d", num_prefix_tokens=2, max_loops=30,
    )
    kwargs.update(overrides)
    return FPRMConfig(**kwargs)


def sequence_fprm_config(**overrides):
    """The state-tracking layout: causal, 1-D causal conv, no positions, no prefix tokens."""
    kwargs = dict(grid_size=None, conv_type="causal_1d", causal=True, position_embedding_type="none",
                  num_prefix_tokens=0)
    kwargs.update(overrides)
    return tiny_fprm_config(**kwargs)


def tiny_fprm(seed=0, config=None, **overrides):
    """A tiny FPRM in eval mode, weights drawn after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    return FPRMForReasoning(config if config is not None else tiny_fprm_config(**overrides)).eval()


def grid_inputs(batch=3, seed=1, vocab=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, 16), generator=g)
