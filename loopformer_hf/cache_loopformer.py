"""LoopFormer's KV cache: transformers' own layers (`DynamicLayer`, `StaticLayer`), one per (loop step i, block j), at
`layer_idx + step_offset = j + i·k` (modeling_loopformer.py). A cache keeps one thing besides keys and values: the
loop that filled it (`loop_key`), so that a call under another trajectory is refused instead of reading layers laid
out for another.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer


class LoopKeyMixin:
    """The loop a cache was filled under (`loop_key`, None while empty), and the beam reordering of layers that hold
    fewer rows than the batch (per-row budgets sorted largest first: a loop step's layers hold the rows still looping,
    a prefix of the batch, and the beams of one input share its budget)."""

    loop_key = None

    def reset(self):
        super().reset()
        self.loop_key = None

    def reorder_cache(self, beam_idx):
        for layer in self.layers:
            if layer.is_initialized:
                layer.reorder_cache(beam_idx[: layer.keys.shape[0]])


class LoopFormerCache(LoopKeyMixin, DynamicCache):
    """A `DynamicCache` whose layers are added as they are first written (M·k for a trajectory of M steps, whatever
    `config` says), and which keeps the loop it was filled under (`loop_key`: the trajectory, or the per-row
    trajectories, and `halt_eps`). A cache serves only the loop that filled it; another raises `ValueError` instead
    of reading slots laid out for another trajectory. A plain `DynamicCache()` works too, checked by its layer count."""

    def __init__(self, *args, config=None, **kwargs):
        # `config` is accepted as `DynamicCache(config=...)` is, and not used: it would fix one layer per block
        super().__init__(*args, **kwargs)


class LoopFormerStaticCache(LoopKeyMixin, StaticCache):
    """A `StaticCache` for a looped model: `max_loop_budget x k` layers, each holding `max_cache_len` tokens, written
    in place, so that `torch.compile` sees fixed shapes. `generate(..., cache_implementation="static")` builds one
    for the call's trajectory; built by hand it serves any trajectory of at most `max_loop_budget` steps (default:
    the config's default budget). Like [`LoopFormerCache`], the first call binds it to its loop (`reset()` empties it
    for another).

    ```python
    cache = LoopFormerStaticCache(model.config, max_cache_len=64, max_loop_budget=4)
    out = model.generate(ids, cache=cache, loop_budget=4, max_new_tokens=32)
    ```
    """

    def __init__(
        self, config, max_cache_len, max_loop_budget=None, offloading=False, offload_only_non_sliding=True, **kwargs
    ):
        steps = max_loop_budget if max_loop_budget is not None else (config.default_loop_budget or config.num_loops)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"`max_loop_budget` must be None or an integer >= 1, got {max_loop_budget!r}.")
        if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len < 1:
            raise ValueError(f"`max_cache_len` must be an integer >= 1, got {max_cache_len!r}.")
        layers = [StaticLayer(max_cache_len=max_cache_len) for _ in range(steps * config.num_hidden_layers)]
        # StaticCache's own __init__ makes one layer per block from the config
        Cache.__init__(self, layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
        self.max_loop_budget = steps


def describe_loop(key):
    """A cache's `loop_key` in words."""
    if key is None:
        return "an unknown trajectory"
    trajectories, halt_eps, *rule = key
    if trajectories and isinstance(trajectories[0], float):
        loop = f"trajectory {list(trajectories)} (loop budget {len(trajectories)})"
    else:
        loop = f"per-row trajectories {[list(t) for t in trajectories]}"
    loop = loop if halt_eps is None else f"{loop}, halt_eps={halt_eps}"
    return loop if not rule else f"{loop}, halting {rule[0]}"


def bind_cache(cache, key, num_steps, num_blocks, batch_size):
    """Check that `cache` can serve the loop `key` ((trajectory or per-row trajectories, halt_eps)) of `num_steps`
    steps over `num_blocks` blocks for `batch_size` rows, and record the key on an empty cache; run when the cache's
    recorded loop is not this call's (its first call, or a mistake). A `DynamicCache` built with a config (one layer
    per block, never grown) gets the layers it lacks."""
    if not isinstance(cache, Cache):
        raise ValueError(f"`cache` must be a transformers Cache instance, got {type(cache).__name__}.")
    num_slots = num_steps * num_blocks
    filled = int(cache.get_seq_length()) > 0
    recorded = getattr(cache, "loop_key", None)
    if filled and (recorded != key if recorded is not None else len(cache.layers) != num_slots):
        raise ValueError(
            f"This cache was filled under {describe_loop(recorded)}, but this call runs {describe_loop(key)}. Every "
            f"(loop step, block) has its own cache slot, so a cache only serves the loop_budget/step_schedule/"
            f"halt_eps that filled it: start a new cache (or call without one)."
        )
    if filled:
        held = cache.layers[0].keys.shape[0]
        if held != batch_size:
            raise ValueError(
                f"This cache holds {held} sequences; this call gives {batch_size}: pass the cache of a call with "
                f"{batch_size} sequences, a new cache, or `cache.reset()` it first."
            )
    if (
        isinstance(cache, StaticCache)
        and getattr(cache, "max_loop_budget", len(cache.layers) // num_blocks) < num_steps
    ):
        raise ValueError(
            f"This {type(cache).__name__} holds {len(cache.layers)} layers, but {describe_loop(key)} needs "
            f"{num_slots} ({num_steps} loop steps x {num_blocks} blocks): build it with "
            f"`LoopFormerStaticCache(config, max_cache_len, max_loop_budget={num_steps})` or more."
        )
    if not isinstance(cache, StaticCache) and getattr(cache, "layer_class_to_replicate", DynamicLayer) is None:
        while len(cache.layers) < num_slots:
            cache.layers.append(DynamicLayer())
    if hasattr(cache, "loop_key"):
        cache.loop_key = key


__all__ = ["LoopFormerCache", "LoopFormerStaticCache", "bind_cache"]
