"""The shared loop cache, a research approximation kept in the lab: loop step i of a block is stored in the slot of
step i mod n (Huginn's shared recurrent cache, "latest-m{n}"), so a cache holds min(M, n) x k slots whatever the
budget M instead of M x k.

Steps run in order, so from step n on a slot already holds this call's tokens (of step i - n): they are replaced,
and what earlier tokens left there (their latest step of that residue) stays. Exact within one call; a later token
at step i reads earlier tokens' step max{s < M: s = i mod n} instead of their step i.

    from benchmarks.cache_sharing import ModuloSharedCache, ModuloSharedStaticCache

    model.generate(ids, cache=ModuloSharedCache(share_n=2), loop_budget=8, max_new_tokens=32)
    model.generate(ids, cache=ModuloSharedStaticCache(model.config, max_cache_len=64, share_n=2), loop_budget=8)

Memory and quality: `python -m benchmarks.bench_cache_sharing` (docs/compile.md).
"""

import numbers

from transformers.cache_utils import StaticLayer

from loopformer_hf.cache_loopformer import LoopFormerCache, LoopFormerCacheMixin, LoopFormerStaticCache
from loopformer_hf.plan_loopformer import LoopFormerPlan


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
    """What the shared caches add to a LoopFormer cache: step i's slot is step (i mod n)'s."""

    share_n = None

    def shared_slot(self, layer_idx, tokens):
        """Where slot `layer_idx` = slot(i, j) is stored, for a write of `tokens` tokens: slot(i mod n, j)."""
        step, block = divmod(layer_idx, self.spec.num_blocks)
        if step < self.share_n:
            return layer_idx
        layer_idx = self.slot(step % self.share_n, block)
        _rewind(self.layers[layer_idx], tokens)  # this call's tokens of step i - n: replaced
        return layer_idx

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer_idx = self.shared_slot(layer_idx, key_states.shape[-2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def write(self, key_states, value_states, layer_idx):
        # a shared slot's own index maps to itself in `update`, should `write` hand it on
        super().write(key_states, value_states, self.shared_slot(layer_idx, key_states.shape[-2]))

    def check_plan(self, plan):
        """Per-row trajectories and a rule's extra steps need a slot of their own per (loop step, block)."""
        spec = plan.spec if isinstance(plan, LoopFormerPlan) else plan
        if spec.row_steps is not None:
            raise ValueError(
                f"Per-row loop budgets or schedules need a slot per (loop step, block): a row whose budget ends "
                f"early would overwrite its own shared slots ({type(self).__name__}, share_n={self.share_n}). Use a "
                f"LoopFormerCache, or one budget for the batch."
            )
        if spec.halting is not None and spec.halting.extra_slots:
            raise ValueError(
                f"{spec.halting.__name__} keeps its extra step in cache slots of its own, which "
                f"{type(self).__name__} does not have: use a LoopFormerCache."
            )


class ModuloSharedCache(ModuloSharing, LoopFormerCache):
    """A `LoopFormerCache` holding n = `share_n` loop-step slots per block."""

    def __init__(self, share_n, **kwargs):
        super().__init__(**kwargs)
        self.share_n = check_share_n(share_n)

    def bind(self, spec):
        self.check_plan(spec)
        return super().bind(spec)


class ModuloSharedStaticCache(ModuloSharing, LoopFormerStaticCache):
    """A `LoopFormerStaticCache` with min(`max_loop_budget`, n) x k preallocated slots."""

    def __init__(self, config, max_cache_len, share_n, max_loop_budget=None, **kwargs):
        share_n = check_share_n(share_n)
        steps = max_loop_budget if max_loop_budget is not None else (config.default_loop_budget or config.num_loops)
        super().__init__(config, max_cache_len, max_loop_budget=min(steps, share_n), **kwargs)
        self.share_n, self.max_loop_budget = share_n, max_loop_budget

    def bind(self, spec):
        self.check_plan(spec)
        needed = spec.spec if isinstance(spec, LoopFormerPlan) else spec
        slots = min(needed.num_steps, self.share_n) * needed.num_blocks
        if slots > len(self.layers):
            raise ValueError(
                f"This ModuloSharedStaticCache holds {len(self.layers)} slots, but {needed.describe()} needs "
                f"{slots}: build it with a larger `max_loop_budget`."
            )
        return LoopFormerCacheMixin.bind(self, spec)  # the shared slot count, not the static cache's M x k check


__all__ = ["ModuloSharedCache", "ModuloSharedStaticCache", "ModuloSharing"]
