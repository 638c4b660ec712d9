"""The KV cache of a looped model: every (loop step i, block j) pair attends to its own keys and values, so the cache
holds one slot per pair, at `slot(i, j) = i * k + j`. A cache records the trajectory (and halting rule) that filled
it; reusing it under another is an error instead of silently wrong logits.

Two storages: [`LoopFormerCache`] (a `DynamicCache`, grows by concatenation) and [`LoopFormerStaticCache`] (a
`StaticCache`: every slot preallocated for `max_cache_len` tokens, for `torch.compile`). Both store keys and values
as transformers' caches do (`update(keys, values, layer_idx)`, `layer_idx = slot(i, j)`).

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

import numbers
import warnings

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from .halting_loopformer import LoopFormerHaltingState
from .plan_loopformer import LoopFormerPlan
from .trajectory_loopformer import LoopFormerRows


logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache field `past_key_values` -> `cache`; support both releases.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_argument(cache, past_key_values, owner):
    """`cache`, or its pre-5.24 name `past_key_values` (deprecated, as in transformers, where the field is `cache`)."""
    if past_key_values is None:
        return cache
    if CACHE_FIELD == "cache":
        warnings.warn(
            f"`past_key_values` is deprecated for `{owner}.forward`. Use `cache` instead.", FutureWarning, stacklevel=3
        )
    return cache if cache is not None else past_key_values


def _mismatch_message(was, now):
    """`was` and `now`: specs, or the `LoopFormerRows` of two per-row plans of one spec."""
    if isinstance(now, LoopFormerRows):
        was_text, now_text = (f"per-row trajectories {[list(t) for t in rows.trajectories]}" for rows in (was, now))
    elif was is None:
        was_text, now_text = "an unknown trajectory", now.describe()
    elif (was.trajectory, was.row_steps) == (now.trajectory, now.row_steps):
        was_text, now_text = (
            f"halt_eps={spec.halt_eps} (kv fill {spec.halt_kv_fill}"
            + ("" if spec.halting in (None, LoopFormerHaltingState) else f"; halting {spec.halting.__name__}")
            + ")"
            for spec in (was, now)
        )
    else:
        was_text, now_text = was.describe(), now.describe()
    return (
        f"This cache was filled under {was_text}, but this call runs {now_text}. Every (loop step, block) has its own "
        f"cache slot, so a cache only serves the loop_budget/step_schedule/halt_eps that built it: "
        f"start a new cache (or call without one)."
    )


def _offloading_of(cache):
    """The offloading arguments `cache` was built with, for the LoopFormer cache that replaces it."""
    return dict(offloading=cache.offloading, offload_only_non_sliding=getattr(cache, "only_non_sliding", False))


class LoopFormerDynamicLayer(DynamicLayer):
    """A `DynamicLayer` that also takes keys/values without returning the slot's whole history (`append`). Halting
    writes a halted token's skipped slots that way: nothing reads them in that forward, so the pieces wait and join the
    slot's next concatenation (one `cat` per slot and read instead of one per write). Reading `keys` or `values` (as
    every transformers cache method does) joins them first. A slot that is never read (its tokens always halt before
    its step) joins every `max_pending` pieces, so a long generation does not keep one small tensor per token."""

    _pending = ()  # (keys, values) appended since the last join
    max_pending = 64  # one join (a copy of the slot) per 64 appends: amortised, and bounds the number of tensors

    def _join(self, *new):
        """Concatenate the pending pieces, then `new` = (keys, values) if given, onto the slot."""
        keys, values = zip(*self._pending, *([new] if new else []))
        self._pending = ()
        self._keys = torch.cat([self._keys, *keys], dim=-2)
        self._values = torch.cat([self._values, *values], dim=-2)

    def _joined(stored):  # noqa: N805 (builds the `keys`/`values` properties below)
        def get(self):
            if self._pending:
                self._join()
            return getattr(self, stored)

        def set(self, value):
            if self._pending:
                self._join()
            setattr(self, stored, value)

        return property(get, set)

    keys = _joined("_keys")
    values = _joined("_values")
    del _joined

    def append(self, key_states, value_states):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self._pending:
            self._pending = []
        self._pending.append((key_states, value_states))
        if len(self._pending) >= self.max_pending:
            self._join()

    def update(self, key_states, value_states, *args, **kwargs):
        if not self._pending:
            return super().update(key_states, value_states, *args, **kwargs)
        self._join(key_states, value_states)
        return self._keys, self._values


class LoopFormerCacheMixin:
    """What every LoopFormer cache adds to a transformers `Cache`: the spec it was filled under and the slot of each
    (loop step, block)."""

    spec = None
    plan = None  # the `LoopFormerPlan` of the latest call that bound the cache (its spec is `spec`)
    # (key, per-block adaLN vectors of every loop step): they depend on the trajectory alone, so an inference run
    # computes them once and its later decode steps read them here (see `LoopFormerModel._loop_adaln`)
    adaln_memo = None

    def _init_binding(self, spec=None):
        """Give every attribute `bind` and `for_call` read an instance slot before the first call: a compiled
        forward guards on what it reads, and an attribute first set by a call would flip its guard from "absent" to
        "present" between the prefill and the decode steps (one extra graph per budget)."""
        self.spec, self.plan, self.adaln_memo = spec, None, None

    def slot(self, step, block):
        """The index `update` takes for loop step `step` (0-based) and block `block`."""
        return step * self.spec.num_blocks + block

    def bind(self, spec):
        """Record `spec` (a `LoopFormerCacheSpec`, or a `LoopFormerPlan` with its spec) on an empty cache; a filled
        cache only accepts the spec it was filled under."""
        plan = spec if isinstance(spec, LoopFormerPlan) else None
        spec = spec.spec if plan is not None else spec
        # Compared first, as plain values: a compiled forward guards on them instead of reading a (static) length.
        if self.spec != spec:
            if self.spec is not None and not self._is_empty():
                raise ValueError(_mismatch_message(self.spec, spec))
            self.spec, self.adaln_memo = spec, None
        elif (
            plan is not None
            and spec.row_steps is not None
            and plan is not self.plan
            and self.plan is not None
            and (
                not torch.compiler.is_compiling()
                and plan.rows.trajectories != self.plan.rows.trajectories
                and not self._is_empty()
            )
        ):
            # per-row trajectories live on the plan (the spec holds the largest budget only)
            raise ValueError(_mismatch_message(self.plan.rows, plan.rows))
        if plan is not None:
            self.plan = plan
        return self

    def _is_empty(self):
        return self.get_seq_length() == 0

    def check_batch_size(self, batch):
        """A filled cache serves only calls of the batch size it was filled with (else attention fails deep in
        torch, or a broadcast mixes rows): raise `ValueError` naming both."""
        layer = next((layer for layer in self.layers if layer.is_initialized), None)
        if layer is None or self._is_empty():
            return
        cached = layer.keys.shape[0]
        if cached != batch:
            raise ValueError(
                f"This cache holds {cached} sequences; this call gives {batch}: pass the cache of a call with "
                f"{batch} sequences, a new cache, or `cache.reset()` it first."
            )

    def write(self, key_states, value_states, layer_idx):
        """As `update`, for a caller that does not read the slot back (halting's skipped slots): a dynamic cache
        joins these keys/values to the slot at its next read instead of now."""
        if self.offloading or self.layer_class_to_replicate is not LoopFormerDynamicLayer:
            self.update(key_states, value_states, layer_idx)
            return
        while len(self.layers) <= layer_idx:
            self.layers.append(LoopFormerDynamicLayer())
        self.layers[layer_idx].append(key_states, value_states)

    def reset(self):
        super().reset()
        self._init_binding()

    @classmethod
    def for_call(cls, cache, spec):
        """The cache a forward call under `spec` (a spec or a `LoopFormerPlan`) uses: `cache` itself if it is a
        LoopFormer cache (checked against `spec`), a new `LoopFormerCache` for `None` or for an empty `DynamicCache`
        (e.g. one built with a config, whose `num_hidden_layers` slots never grow). Anything else raises
        `ValueError`."""
        if cache is None:
            return LoopFormerCache().bind(spec)
        if isinstance(cache, LoopFormerCacheMixin):
            return cache.bind(spec)
        if not isinstance(cache, Cache):
            raise ValueError(f"`cache` must be a transformers Cache instance, got {type(cache).__name__}.")
        plan, spec = (spec, spec.spec) if isinstance(spec, LoopFormerPlan) else (None, spec)
        if cache.get_seq_length() > 0:
            raise ValueError(_mismatch_message(None, spec))
        if type(cache) is not DynamicCache:
            raise ValueError(
                f"LoopFormer needs {spec.num_slots} cache slots ({spec.num_steps} loop steps x {spec.num_blocks} "
                f"blocks) in a LoopFormerCache; got an empty {type(cache).__name__}. "
                f"Pass `cache=LoopFormerCache()`, `cache=LoopFormerStaticCache(model.config, max_cache_len)` or no "
                f"cache."
            )
        logger.warning_once(
            "LoopFormer replaced the empty DynamicCache it was given by a LoopFormerCache (one slot per loop step "
            "and block): read the cache from the output, or pass `cache=LoopFormerCache()` to have it filled in place."
        )
        return LoopFormerCache(**_offloading_of(cache)).bind(spec if plan is None else plan)

    @staticmethod
    def replace_generate_default(model_kwargs, config, make_plan):
        """`generate` puts a plain `DynamicCache` (or, with `cache_implementation="static"`, a `StaticCache`) in
        `model_kwargs` (under `cache`, or `past_key_values` before transformers 5.24). Swap an empty one it built for
        the LoopFormer cache of the same kind, sized for and bound to `make_plan()` (this `generate` call's plan, made
        only when there is such a cache: a cache the user passed gets its plan from the first forward)."""
        for name in ("cache", "past_key_values"):
            cache = model_kwargs.get(name)
            if cache is None or getattr(cache, "_is_user_defined", False) or cache.get_seq_length() != 0:
                continue
            plan = make_plan()
            if type(cache) is DynamicCache:  # e.g. cache_implementation="offloaded": its offloading is kept
                model_kwargs[name] = LoopFormerCache(**_offloading_of(cache)).bind(plan)
            elif type(cache) is StaticCache:
                model_kwargs[name] = LoopFormerStaticCache(
                    config,
                    max_cache_len=cache.get_max_length(),
                    max_loop_budget=plan.spec.num_steps,
                    **_offloading_of(cache),
                ).bind(plan)


class LoopFormerCache(LoopFormerCacheMixin, DynamicCache):
    """A `DynamicCache` with one slot per (loop step, block), bound to the trajectory that fills it.

    Create it empty (`LoopFormerCache()`), pass it as `cache=` and it is filled in place; the first call binds it to
    its trajectory (`spec`), and a later call under another budget, schedule or `halt_eps` raises `ValueError`.
    Slots are added as they are first written, so one class serves every budget.
    """

    def __init__(self, spec=None, config=None, **kwargs):
        # `config` is accepted as `DynamicCache(config=...)` is, and not used: it would give one fixed layer per block,
        # where a looped model needs a slot per (loop step, block), added as each is first written.
        super().__init__(**kwargs)
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = LoopFormerDynamicLayer
        self._init_binding(spec)

    def mask_lengths(self, query_length):
        """(tokens already cached, key/value length attention sees) for a call adding `query_length` tokens."""
        past = self.get_seq_length()
        return past, past + query_length


class LoopFormerStaticCache(LoopFormerCacheMixin, StaticCache):
    """A `StaticCache` for a looped model: `max_loop_budget x k` slots, each holding `max_cache_len` tokens, allocated at its first write (or by
    `early_initialization`) and then written in place, so that `torch.compile` sees fixed shapes and addresses.

    `generate(..., cache_implementation="static")` builds one sized for the call's trajectory. Built by hand, it serves
    any trajectory of at most `max_loop_budget` steps (default: the config's default budget); like
    [`LoopFormerCache`], the first call binds it and a later call under another trajectory raises `ValueError`
    (`reset()` empties it for a new one).

    ```python
    cache = LoopFormerStaticCache(model.config, max_cache_len=64, max_loop_budget=4)
    out = model.generate(ids, cache=cache, loop_budget=4, max_new_tokens=32)
    ```
    """

    def __init__(
        self, config, max_cache_len, max_loop_budget=None, offloading=False, offload_only_non_sliding=True, **kwargs
    ):
        steps = max_loop_budget if max_loop_budget is not None else (config.default_loop_budget or config.num_loops)
        if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"`max_loop_budget` must be None or an integer >= 1, got {max_loop_budget!r}.")
        if not isinstance(max_cache_len, numbers.Integral) or isinstance(max_cache_len, bool) or max_cache_len < 1:
            raise ValueError(f"`max_cache_len` must be an integer >= 1, got {max_cache_len!r}.")
        layers = [StaticLayer(max_cache_len=max_cache_len) for _ in range(steps * config.num_hidden_layers)]
        # StaticCache's own __init__ makes one layer per block from the config; a looped model needs steps x blocks.
        Cache.__init__(self, layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
        self._init_binding()
        self.max_loop_budget = int(max_loop_budget) if max_loop_budget is not None else None

    def bind(self, spec):
        needed = spec.spec if isinstance(spec, LoopFormerPlan) else spec
        if needed.num_slots > len(self.layers):
            raise ValueError(
                f"This LoopFormerStaticCache holds {len(self.layers)} slots, but {needed.describe()} needs "
                f"{needed.num_slots} ({needed.num_steps} loop steps x {needed.num_blocks} blocks): build it with "
                f"`max_loop_budget={len(needed.trajectory)}` or more."
            )
        return super().bind(spec)

    def _is_empty(self):
        return not self.layers[0].is_initialized or int(self.get_seq_length()) == 0

    def mask_lengths(self, query_length):
        """(tokens already cached, key/value length attention sees): every slot returns all `max_cache_len` rows,
        the ones beyond the cached tokens still empty. The cached count is always a tensor (no recompile per token),
        copied because the cache advances it in place."""
        max_len = self.layers[0].max_cache_len
        past = self.get_seq_length()  # 0 before the first write
        past = past.clone() if isinstance(past, torch.Tensor) else torch.zeros((), dtype=torch.long)
        if not torch.compiler.is_compiling() and int(past) + query_length > max_len:
            raise ValueError(
                f"This LoopFormerStaticCache holds max_cache_len={max_len} tokens; it has {int(past)} and this call "
                f"adds {query_length}. Build it with a larger `max_cache_len`."
            )
        return past, max_len


__all__ = [
    "LoopFormerCache",
    "LoopFormerCacheMixin",
    "LoopFormerDynamicLayer",
    "LoopFormerStaticCache",
]
