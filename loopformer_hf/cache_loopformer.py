"""The KV cache of a looped model: every (loop step i, block j) pair attends to its own keys and values, so the cache
holds one slot per pair, at `slot(i, j) = i * k + j`. A cache records the trajectory (and halting rule) that filled
it; reusing it under another is an error instead of silently wrong logits.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

from typing import NamedTuple

from transformers.cache_utils import Cache, DynamicCache
from transformers.utils import logging


logger = logging.get_logger(__name__)


class LoopFormerCacheSpec(NamedTuple):
    """What a cache was filled under. A tuple of constants (no tensors, no custom `__eq__`), so that a compiled
    forward can guard on it and a static cache can be sized from it (`num_slots`)."""

    trajectory: tuple  # step sizes Δ_1..Δ_M
    num_blocks: int  # k
    halt_eps: float | None = None
    halt_kv_fill: str | None = None  # only recorded with halt_eps: it changes what the skipped slots hold

    @property
    def num_slots(self):
        return len(self.trajectory) * self.num_blocks

    def describe(self):
        return f"trajectory {list(self.trajectory)} (loop budget {len(self.trajectory)})"


def _mismatch_message(was, now):
    if was is None:
        was_text, now_text = "an unknown trajectory", now.describe()
    elif was.trajectory == now.trajectory:
        was_text = f"halt_eps={was.halt_eps} (kv fill {was.halt_kv_fill})"
        now_text = f"halt_eps={now.halt_eps} (kv fill {now.halt_kv_fill})"
    else:
        was_text, now_text = f"trajectory {list(was.trajectory)}", now.describe()
    return (
        f"This cache was filled under {was_text}, but this call runs {now_text}. Every (loop step, block) has its own "
        f"cache slot, so a cache only serves the loop_budget/step_schedule/halt_eps that built it: start a new cache "
        f"(or call without one)."
    )


class LoopFormerCacheMixin:
    """What every LoopFormer cache adds to a transformers `Cache`: the spec it was filled under and the slot of each
    (loop step, block). A preallocated variant (a `StaticCache` sized by `spec.num_slots`) mixes in the same."""

    spec = None

    def slot(self, step, block):
        """Index of the slot of loop step `step` (0-based) and block `block`."""
        return step * self.spec.num_blocks + block

    def bind(self, spec):
        """Record `spec` on an empty cache; a filled cache only accepts the spec it was filled under."""
        if self.get_seq_length() == 0:
            self.spec = spec
        elif self.spec != spec:
            raise ValueError(_mismatch_message(self.spec, spec))
        return self


class LoopFormerCache(LoopFormerCacheMixin, DynamicCache):
    """A `DynamicCache` with one slot per (loop step, block), bound to the trajectory that fills it.

    Create it empty (`LoopFormerCache()`), pass it as `cache=` and it is filled in place; the first call binds it to
    its trajectory (`spec`), and a later call under another budget, schedule or `halt_eps` raises `ValueError`.
    Slots are added as they are first written, so one class serves every budget.
    """

    def __init__(self, spec=None, **kwargs):
        super().__init__(**kwargs)
        self.spec = spec

    @classmethod
    def for_call(cls, cache, spec):
        """The cache a forward call under `spec` uses: `cache` itself if it is a `LoopFormerCache` (checked against
        `spec`), a new one for `None` or for an empty `DynamicCache` (e.g. the one transformers' `generate` builds,
        whose `num_hidden_layers` slots never grow). Anything else raises `ValueError`."""
        if cache is None:
            return cls(spec)
        if isinstance(cache, LoopFormerCacheMixin):
            return cache.bind(spec)
        if not isinstance(cache, Cache):
            raise ValueError(f"`cache` must be a transformers Cache instance, got {type(cache).__name__}.")
        if cache.get_seq_length() > 0:
            raise ValueError(_mismatch_message(None, spec))
        if type(cache) is not DynamicCache:
            raise ValueError(
                f"LoopFormer needs {spec.num_slots} cache slots (loop budget {len(spec.trajectory)} x "
                f"{spec.num_blocks} blocks) in a LoopFormerCache; got an empty {type(cache).__name__}. Pass "
                f"`cache=LoopFormerCache()` or no cache."
            )
        logger.warning_once(
            "LoopFormer replaced the empty DynamicCache it was given by a LoopFormerCache (one slot per loop step "
            "and block): read the cache from the output, or pass `cache=LoopFormerCache()` to have it filled in place."
        )
        return cls(spec)

    @classmethod
    def replace_generate_default(cls, model_kwargs):
        """`generate` puts a plain `DynamicCache` in `model_kwargs` (under `cache`, or `past_key_values` before
        transformers 5.24); swap an empty one for an empty `LoopFormerCache`, which the first forward binds."""
        for name in ("cache", "past_key_values"):
            cache = model_kwargs.get(name)
            built_by_generate = not getattr(cache, "_is_user_defined", False)
            if type(cache) is DynamicCache and built_by_generate and cache.get_seq_length() == 0:
                model_kwargs[name] = cls()


__all__ = ["LoopFormerCache", "LoopFormerCacheMixin", "LoopFormerCacheSpec"]
