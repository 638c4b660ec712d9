"""The shared loop cache, a research approximation kept in the lab: loop step i of a block is stored in the slot of
step i mod n (Huginn's shared recurrent cache, "latest-m{n}"), so a cache holds min(M, n) x k slots whatever the
budget M instead of M x k.

Steps run in order, so from step n on a slot already holds this call's tokens (of step i - n): they are replaced,
and what earlier tokens left there (their latest step of that residue) stays. Exact within one call; a later token
at step i reads earlier tokens' step max{s < M: s = i mod n} instead of their step i.

    from benchmarks.cache_sharing import ModuloSharedCache, ModuloSharedStaticCache

    model.generate(ids, cache=ModuloSharedCache(model.config, share_n=2), loop_budget=8, max_new_tokens=32)
    model.generate(ids, cache=ModuloSharedStaticCache(model.config, max_cache_len=64, share_n=2), loop_budget=8)

Memory and quality: `python -m benchmarks.bench_cache_sharing` (docs/compile.md).
"""

import numbers

from transformers.cache_utils import StaticLayer

from loopformer_hf import LoopFormerCache, LoopFormerStaticCache


def _rewind(layer, tokens):
    """Drop the last `tokens` tokens of a cache layer so the next update overwrites them. A static layer only moves
    its write position back, in place (its tensors keep their addresses); transformers < 5.24 has no
    `StaticLayer.crop`, so this does what 5.24's does."""
    if isinstance(layer, StaticLayer):
        layer.cumulative_length.sub_(tokens)
    else:
        layer.crop(-tokens)


def check_share_n(share_n):
    if not isinstance(share_n, numbers.Integral) or isinstance(share_n, bool) or share_n < 1:
        raise ValueError(f"`share_n` must be an integer >= 1, got {share_n!r}.")
    return int(share_n)


class ModuloSharing:
    """What the shared caches add to a LoopFormer cache: the layer of step i is step (i mod n)'s."""

    share_n = None
    num_blocks = None
    _loop_key = None

    def shared_slot(self, layer_idx, tokens):
        """Where layer `layer_idx` = j + i·k is stored, for a write of `tokens` tokens: j + (i mod n)·k."""
        step, block = divmod(layer_idx, self.num_blocks)
        if step < self.share_n:
            return layer_idx
        layer_idx = block + (step % self.share_n) * self.num_blocks
        _rewind(self.layers[layer_idx], tokens)  # this call's tokens of step i - n: replaced
        return layer_idx

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer_idx = self.shared_slot(layer_idx, key_states.shape[-2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def loop_key(self):
        return self._loop_key

    @loop_key.setter
    def loop_key(self, key):
        """Per-row trajectories need a layer of their own per (loop step, block)."""
        if key is not None and key[0] and not isinstance(key[0][0], float):
            raise ValueError(
                f"Per-row loop budgets or schedules need a slot per (loop step, block): a row whose budget ends "
                f"early would overwrite its own shared slots ({type(self).__name__}, share_n={self.share_n}). Use a "
                f"LoopFormerCache, or one budget for the batch."
            )
        self._loop_key = key


class ModuloSharedCache(ModuloSharing, LoopFormerCache):
    """A `LoopFormerCache` holding n = `share_n` loop-step layers per block."""

    def __init__(self, config, share_n, **kwargs):
        super().__init__(**kwargs)
        self.share_n, self.num_blocks = check_share_n(share_n), config.num_hidden_layers


class ModuloSharedStaticCache(ModuloSharing, LoopFormerStaticCache):
    """A `LoopFormerStaticCache` with min(`max_loop_budget`, n) x k preallocated layers."""

    def __init__(self, config, max_cache_len, share_n, max_loop_budget=None, **kwargs):
        share_n = check_share_n(share_n)
        steps = max_loop_budget if max_loop_budget is not None else (config.default_loop_budget or config.num_loops)
        super().__init__(config, max_cache_len, max_loop_budget=min(steps, share_n), **kwargs)
        # the largest budget served (the model's check), in min(steps, n) x k layers
        self.share_n, self.max_loop_budget, self.num_blocks = share_n, steps, config.num_hidden_layers


__all__ = ["ModuloSharedCache", "ModuloSharedStaticCache", "ModuloSharing"]
