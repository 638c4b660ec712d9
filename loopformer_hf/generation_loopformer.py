"""LoopFormer's part of `generate`: the loop knobs (`loop_budget`, `step_schedule`, `halt_eps`) are model kwargs
that reach every forward, from the call or from `generation_config`; generate gets a cache with one layer per (loop
step, block); classifier-free guidance and assisted decoding run the call's loop; and with `halt_eps` each returned
position's loop count is gathered into the output (`LoopFormerGenerateDecoderOnlyOutput.loop_counts`).

Four private `GenerationMixin` methods are overridden, each because no public hook serves (the comment above each
names the transformers code that forces it); tests/loopformer/test_generation_modes.py fails when one of them changes
name or signature. Nothing here runs in a decode step.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

import functools
import json
import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticCache, StaticLayer
from transformers.generation import (
    GenerateBeamDecoderOnlyOutput,
    GenerateDecoderOnlyOutput,
    GenerationMixin,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from .halting_loopformer import check_halt_eps
from .trajectory_loopformer import resolve_call

# Loop knobs `generate` also reads from `generation_config` (call kwargs win), saved in generation_config.json.
GENERATION_LOOP_KNOBS = ("loop_budget", "step_schedule", "halt_eps")


@dataclass
class LoopFormerGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`generate(..., return_dict_in_generate=True)` output; `loop_counts` (batch, length - 1): with `halt_eps`, the
    loop steps spent on each input position (position i produced token i + 1)."""

    loop_counts: torch.LongTensor | None = None


@dataclass
class LoopFormerGenerateBeamDecoderOnlyOutput(GenerateBeamDecoderOnlyOutput):
    """Beam-search `generate(..., return_dict_in_generate=True)` output; `loop_counts` (returned sequences,
    length - 1): with `halt_eps`, the loop steps spent on each position of each returned sequence, taken from the
    beam that held the sequence when the position was processed (position i produced token i + 1); 0 after a
    sequence that finished early."""

    loop_counts: torch.LongTensor | None = None


def check_generation_knobs(config, knobs, source):
    """Raise `ValueError` (naming `source`) unless the loop knobs `knobs` ({name: value} of `GENERATION_LOOP_KNOBS`)
    are valid for a model of `config`, by the rules `forward` applies to them."""
    try:
        resolve_call(config, knobs.get("loop_budget"), knobs.get("step_schedule"))
        check_halt_eps(knobs.get("halt_eps"))
    except ValueError as e:
        raise ValueError(
            f"{source} sets a loop knob of `generate` that this model refuses: {e} Fix or remove it there."
        ) from None


def _schedule_as_numbers(schedule):
    """A `step_schedule` given as a 1-D tensor (or a per-row list holding some) as lists of floats, the values it
    resolves to: a plain value is resolved once per generate call (the model remembers it), a tensor at every step."""
    if isinstance(schedule, torch.Tensor):
        return schedule.tolist() if schedule.ndim == 1 and schedule.is_floating_point() else schedule
    if isinstance(schedule, list) and any(isinstance(s, torch.Tensor) for s in schedule):
        return [_schedule_as_numbers(s) if isinstance(s, torch.Tensor) else s for s in schedule]
    return schedule


# ---- the cache: transformers' own layers, one per (loop step, block) --------------------------------------------


class LoopFormerCache(DynamicCache):
    """A `DynamicCache` whose layers are added as they are first written (M·k for a trajectory of M steps, whatever
    `config` says), and which keeps the loop it was filled under (`loop_key`: the trajectory, or the per-row
    trajectories, and `halt_eps`). A cache serves only the loop that filled it; another raises `ValueError` instead
    of reading slots laid out for another trajectory. A plain `DynamicCache()` works too, checked by its layer count."""

    def __init__(self, *args, config=None, **kwargs):
        # `config` is accepted as `DynamicCache(config=...)` is, and not used: it would fix one layer per block
        super().__init__(*args, **kwargs)
        self.loop_key = None

    def reset(self):
        super().reset()
        self.loop_key = None


class LoopFormerStaticCache(StaticCache):
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
        self.loop_key = None
        self.max_loop_budget = steps

    def reset(self):
        super().reset()
        self.loop_key = None


_UNSET = object()


class LoopCountsRecord:
    """The loop counts of one `generate` call with `halt_eps`, recorded by hooks on the model for its duration: for
    each forward of the calling thread on generate's cache, the first position it computed (the cache's length
    before it) and its (batch, q_len) `loop_counts`. Other forwards (classifier-free guidance's unconditional one,
    a draft's on its own cache, another thread's call) are not recorded."""

    def __init__(self, model):
        self.entries, self.thread, self.cache, self.pending = [], threading.get_ident(), _UNSET, False
        self.hooks = (
            model.register_forward_pre_hook(self.before, with_kwargs=True),
            model.register_forward_hook(self.after, with_kwargs=True),
        )

    def before(self, model, args, kwargs):
        if threading.get_ident() != self.thread:
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if self.cache is _UNSET:
            self.cache = cache  # the prefill's: generate's cache (None without one)
        self.pending = cache is self.cache
        if self.pending:
            self.entries.append({"first": 0 if cache is None else int(cache.get_seq_length())})

    def after(self, model, args, kwargs, output):
        if threading.get_ident() == self.thread and self.pending:
            self.entries[-1]["counts"] = output.loop_counts
            self.pending = False

    def remove(self):
        for hook in self.hooks:
            hook.remove()

    def gather(self, out):
        """(rows, length - 1) loop counts of the returned sequences: for each position, the counts of the last
        forward that computed it (assisted decoding recomputes rejected drafts); beam search follows the beams.
        Positions a cache passed to `generate` held count 0: this call ran no loop step for them."""
        log = [entry for entry in self.entries if entry.get("counts") is not None]
        if not log:
            return None
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        beam_indices = None if isinstance(out, torch.Tensor) else out.get("beam_indices")
        if beam_indices is not None:
            # the forward of step s ran on the beams as reordered after step s - 1; the token of step s of a returned
            # sequence came from beam row beam_indices[:, s] (-1 after the sequence finished)
            rows = beam_indices.long()
            columns = [log[0]["counts"][rows[:, 0].clamp(min=0)]]
            for step in range(1, rows.shape[1]):
                counts = log[step]["counts"][rows[:, step].clamp(min=0), -1]
                columns.append(torch.where(rows[:, step] >= 0, counts, torch.zeros_like(counts))[:, None])
            counts = torch.cat(columns, dim=1)
            return torch.cat([counts.new_zeros(counts.shape[0], log[0]["first"]), counts], dim=1)
        length = sequences.shape[1] - 1
        first = log[0]["counts"]
        counts = first.new_zeros(first.shape[0], max(length, max(e["first"] + e["counts"].shape[1] for e in log)))
        for entry in log:  # later forwards overwrite the positions they recomputed
            counts[:, entry["first"] : entry["first"] + entry["counts"].shape[1]] = entry["counts"]
        return counts[:, :length]


class LoopFormerGenerationMixin(GenerationMixin):
    """`GenerationMixin` for a looped model (see the module's docstring); `LoopFormerForCausalLM` mixes it in."""

    # the model kwargs that are loop knobs: passed to every forward (a subclass may add its own)
    generation_loop_knobs = GENERATION_LOOP_KNOBS

    def adjust_generation_fn(
        self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, *args, **kwargs
    ):
        """transformers' hook that loads generation_config.json in `from_pretrained`. A file marked
        `"_from_model_config": true` (as the trainer and `save_pretrained` write one without loop knobs) loses every
        custom key on load: read the loop knobs from the file itself, so that a value written there by hand is used
        by `generate`, and refuse an invalid one here, naming the file, rather than at the first `generate`."""
        super().adjust_generation_fn(
            generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, *args, **kwargs
        )
        if generation_config is not None or pretrained_model_name_or_path is None or not self.can_generate():
            return
        names = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
        options = {**dict(zip(names, args)), **{name: kwargs[name] for name in names if name in kwargs}}
        try:
            from transformers.utils import cached_file

            file = cached_file(
                pretrained_model_name_or_path,
                "generation_config.json",
                **options,
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
            )
            with open(file, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, TypeError, ValueError):  # no such file (or not JSON): transformers has said so, or not
            return
        knobs = {name: saved[name] for name in GENERATION_LOOP_KNOBS if name in saved}
        check_generation_knobs(self.config, knobs, file)
        for name, value in knobs.items():
            setattr(self.generation_config, name, value)

    # Private hook, kept: `GenerationMixin._prepare_cache_for_generation` builds generate's default cache inline
    # (`DynamicCache(config=...)` with `num_hidden_layers` layers that never grow, or a `StaticCache` of as many for
    # `cache_implementation="static"`), and no public argument chooses another. A looped model needs one layer per
    # (loop step, block), M·k, and a static cache must be sized for this call's M before the prefill.
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate's default cache, with a layer per (loop step, block): an empty `LoopFormerCache` (layers added as
        written) for its `DynamicCache`, a `LoopFormerStaticCache` of the call's M·k layers for its `StaticCache`."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        for name in ("cache", "past_key_values"):
            cache = model_kwargs.get(name)
            if cache is None or getattr(cache, "_is_user_defined", False) or cache.get_seq_length() != 0:
                continue
            offloading = dict(
                offloading=cache.offloading, offload_only_non_sliding=getattr(cache, "only_non_sliding", False)
            )
            if type(cache) is DynamicCache:  # e.g. cache_implementation="offloaded": its offloading is kept
                model_kwargs[name] = LoopFormerCache(**offloading)
            elif type(cache) is StaticCache:
                trajectory, rows = resolve_call(
                    self.config, model_kwargs.get("loop_budget"), model_kwargs.get("step_schedule")
                )
                steps = len(trajectory) if rows is None else rows.num_steps
                model_kwargs[name] = LoopFormerStaticCache(
                    self.config, max_cache_len=cache.get_max_length(), max_loop_budget=steps, **offloading
                )

    def init_continuous_batching(self, *args, **kwargs):
        """Continuous batching (`generate_batch`, `init_continuous_batching`) is not supported: its paged cache has
        one slot per layer, where a looped model needs one per (loop step, block)."""
        raise NotImplementedError(
            "LoopFormer does not support continuous batching (generate_batch / init_continuous_batching): its paged "
            "cache has no slot per (loop step, block). Use `generate` with a padded batch (and "
            '`cache_implementation="static"` for compiled decoding).'
        )

    # Private hook, kept: `GenerationMixin._get_logits_processor` builds classifier-free guidance's processor
    # (`UnbatchedClassifierFreeGuidanceLogitsProcessor`) with the model itself as the unconditional forward. A processor
    # passed as `logits_processor=` would have to be built before `generate` repeats per-row budgets for beams and
    # num_return_sequences, and transformers warns when a passed processor replaces one it builds.
    def _get_logits_processor(self, *args, **kwargs):
        """The logits processors; classifier-free guidance's unconditional forward gets this call's loop knobs, so
        that both forwards run the same loop budget, schedule and halting."""
        processors = super()._get_logits_processor(*args, **kwargs)
        knobs = {
            name: value
            for name, value in (kwargs.get("model_kwargs") or {}).items()
            if name in self.generation_loop_knobs
        }
        for processor in processors:
            if isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor) and processor.model is self:
                processor.model = functools.partial(self, **knobs)
        return processors

    # Private hook, kept: `GenerationMixin._get_candidate_generator` builds assisted decoding's drafter, which copies
    # every model kwarg into each `assistant_model.generate` call; no public hook filters them. The loop knobs belong to
    # this model, and an assistant of another class would reject them as unused model kwargs.
    def _get_candidate_generator(self, *args, **kwargs):
        """Assisted decoding's drafter, without this model's loop knobs in the assistant's kwargs: the assistant runs
        under its own `generation_config` (e.g. a LoopFormer draft with `generation_config.loop_budget = 1`)."""
        assistant = kwargs.get("assistant_model")
        if assistant is not None and assistant is not self and kwargs.get("model_kwargs") is not None:
            kwargs["model_kwargs"] = {
                name: value for name, value in kwargs["model_kwargs"].items() if name not in self.generation_loop_knobs
            }
        return super()._get_candidate_generator(*args, **kwargs)

    # Private hook, kept: `GenerationMixin._prepare_generation_config` merges the call's kwargs into the generation
    # config, and `GenerationConfig.update` absorbs a kwarg the config also holds (a loop knob saved in
    # generation_config.json), so its value would never reach `model_kwargs`. Only here are the merged config and the
    # model kwargs seen together, before the cache, the logits processors and the beam expansion read them.
    def _prepare_generation_config(self, generation_config, *args, **kwargs):
        """The merged generation config and model kwargs; a loop knob set on the config reaches `forward` as a model
        kwarg (a call kwarg of the same name wins)."""
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, *args, **kwargs)
        for name in self.generation_loop_knobs:
            value = getattr(generation_config, name, None)
            if name not in model_kwargs and value is not None:
                model_kwargs[name] = value
        if "step_schedule" in model_kwargs:
            model_kwargs["step_schedule"] = _schedule_as_numbers(model_kwargs["step_schedule"])
        return generation_config, model_kwargs

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, plus the kwargs `loop_budget` and `step_schedule` (one for the batch, or one
        per row) and `halt_eps`. The same fields set on `generation_config` (or on `model.generation_config`, which
        `save_pretrained` writes to generation_config.json) are used when the call does not give them.

        With `halt_eps` and `return_dict_in_generate=True`, the output (a [`LoopFormerGenerateDecoderOnlyOutput`], or
        [`LoopFormerGenerateBeamDecoderOnlyOutput`] for beam search) carries `loop_counts`, a (returned sequences,
        length - 1) tensor: the loop steps spent on each position of each returned sequence (position i produced
        token i + 1). Greedy decoding, sampling, beam search (the counts follow the beams' reordering), assisted and
        prompt-lookup decoding (the counts of accepted tokens only); chunked prefill raises `ValueError` with
        `halt_eps`.
        """
        given = kwargs.get("generation_config") or self.generation_config
        halt_eps = kwargs["halt_eps"] if "halt_eps" in kwargs else getattr(given, "halt_eps", None)
        if halt_eps is None and kwargs.get("generation_config") is not None:
            halt_eps = getattr(self.generation_config, "halt_eps", None)
        if halt_eps is None:
            return super().generate(*args, **kwargs)
        chunked = kwargs["prefill_chunk_size"] if "prefill_chunk_size" in kwargs else None
        if chunked is None:
            chunked = getattr(given, "prefill_chunk_size", None)
        if chunked is not None:
            raise ValueError(
                "`halt_eps` with chunked prefill (prefill_chunk_size) is not supported: the loop counts of each "
                "position are gathered for whole-prompt prefills only. Drop `prefill_chunk_size`, or drop `halt_eps`."
            )
        record = LoopCountsRecord(self)  # local to this call: concurrent generate calls each keep their own counts
        try:
            out = super().generate(*args, **kwargs)
        finally:
            record.remove()
        counts = record.gather(out)
        if counts is None or isinstance(out, torch.Tensor):
            return out
        if isinstance(out, GenerateBeamDecoderOnlyOutput):
            return LoopFormerGenerateBeamDecoderOnlyOutput(**out, loop_counts=counts)
        return LoopFormerGenerateDecoderOnlyOutput(**out, loop_counts=counts)


__all__ = [
    "LoopFormerCache",
    "LoopFormerStaticCache",
    "LoopFormerGenerationMixin",
    "LoopFormerGenerateDecoderOnlyOutput",
    "LoopFormerGenerateBeamDecoderOnlyOutput",
]
