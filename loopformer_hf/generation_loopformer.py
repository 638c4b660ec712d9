"""LoopFormer's part of `generate`: the loop knobs (`loop_budget`, `step_schedule`, `halt_eps`) are model kwargs
that reach every forward, from the call or from `generation_config`; generate gets a cache with one layer per (loop
step, block); classifier-free guidance and assisted decoding run the call's loop; and with `halt_eps` each returned
position's loop count is gathered into the output (`LoopFormerGenerateDecoderOnlyOutput.loop_counts`).

Four private `GenerationMixin` methods are overridden, each because no public hook serves (the comment above each
names the transformers code that forces it); tests/loopformer/test_generation_modes.py fails when one of them changes
name or signature. Nothing here runs in a decode step.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

import contextvars
import functools
import json
import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.generation import (
    AssistedCandidateGenerator,
    GenerateBeamDecoderOnlyOutput,
    GenerateDecoderOnlyOutput,
    GenerationMixin,
    MinNewTokensLengthLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from .cache_loopformer import LoopFormerCache, LoopFormerStaticCache
from .trajectory_loopformer import check_halt_eps, resolve_call

# Loop knobs `generate` also reads from `generation_config` (call kwargs win), saved in generation_config.json.
GENERATION_LOOP_KNOBS = ("loop_budget", "step_schedule", "halt_eps")


@dataclass
class LoopFormerGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`generate(..., return_dict_in_generate=True)` output; `loop_counts` (batch, length - 1): with `halt_eps`, the
    loop steps spent on each input position (position i produced token i + 1)."""

    loop_counts: torch.LongTensor | None = None
    # with `assistant_loop_budget`: the tokens the shallow trajectory drafted, and how many of them the call's
    # trajectory accepted
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None


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
        """Assisted decoding's drafter: this model at `assistant_loop_budget` (self-speculation, see `generate`), or
        an assistant model without this model's loop knobs in its kwargs: the assistant runs under its own
        `generation_config` (e.g. a LoopFormer draft with `generation_config.loop_budget = 1`)."""
        draft = _LOOP_DRAFT.get()
        if draft is not None and kwargs.get("assistant_model") is None:
            return LoopDraftCandidateGenerator(
                kwargs["input_ids"],
                self,
                kwargs["generation_config"],
                kwargs["model_kwargs"],
                kwargs.get("inputs_tensor"),
                kwargs.get("logits_processor"),
                draft,
            )
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

        def knob(name):  # a call kwarg, else the call's generation config's, else the model's
            if name in kwargs:
                return kwargs[name]
            value = getattr(given, name, None)
            return getattr(self.generation_config, name, None) if value is None else value

        halt_eps = knob("halt_eps")
        draft_budget = kwargs.pop("assistant_loop_budget", None)
        draft_schedule = kwargs.pop("assistant_step_schedule", None)
        draft_budget = draft_budget if draft_budget is not None else knob("assistant_loop_budget")
        draft_schedule = draft_schedule if draft_schedule is not None else knob("assistant_step_schedule")
        if (draft_budget is not None or draft_schedule is not None) and _LOOP_DRAFT.get() is None:
            draft = _check_draft(self.config, draft_budget, draft_schedule, knob, args, kwargs)
            record = {"drafted": 0, "accepted": 0}
            token = _LOOP_DRAFT.set((draft, record))
            try:  # transformers' switch to assisted decoding by the model itself (LayerSkip's), here at budget d
                out = self.generate(*args, **kwargs, assistant_early_exit=len(draft))
            finally:
                _LOOP_DRAFT.reset(token)
            if isinstance(out, GenerateDecoderOnlyOutput):
                fields = {name: value for name, value in out.items()}
                fields.update(drafted_tokens=record["drafted"], accepted_tokens=record["accepted"])
                out = LoopFormerGenerateDecoderOnlyOutput(**fields)
            return out
        sorted_call = _sorted_by_budget(self.config, given, args, kwargs)
        if sorted_call is not None:  # per-row budgets: rows sorted once, largest budget first, and back after
            args, kwargs, order = sorted_call
            return _unsorted(self.generate(*args, **kwargs), order)
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


def _sorted_by_budget(config, given, args, kwargs):
    """(args, kwargs, order) of a `generate` call with per-row budgets whose rows are not sorted by budget, largest
    first: its rows sorted so (inputs, mask, per-row knobs), `order` the rows' original indices in the sorted batch.
    Sorted, the rows still looping at a loop step are a prefix of the batch, and the step computes them alone (see
    `LoopFormerModel.forward`). None where there is nothing to sort, or the call keeps its rows in order (beams,
    a streamer)."""
    knobs = {}
    for name in ("loop_budget", "step_schedule"):
        knobs[name] = kwargs[name] if name in kwargs else getattr(given, name, None)
    if _row_count(knobs) is None or kwargs.get("streamer") is not None:
        return None
    if (kwargs["num_beams"] if "num_beams" in kwargs else getattr(given, "num_beams", 1) or 1) > 1:
        return None
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids", kwargs.get("inputs_embeds")))
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2 or inputs.shape[0] < 2:
        return None
    batch = inputs.shape[0]
    try:
        trajectory, rows = resolve_call(config, knobs["loop_budget"], knobs["step_schedule"], batch)
    except ValueError:
        return None  # the call itself refuses it, as without sorting
    if rows is None or rows.live_counts is not None:
        return None
    lengths = [len(t) for t in rows.trajectories]
    order = sorted(range(batch), key=lambda b: -lengths[b])  # stable: equal budgets keep their order
    index = torch.tensor(order, device=inputs.device)

    def rows_of(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch:
            return value[index.to(value.device)]
        if isinstance(value, (list, tuple)) and len(value) == batch:
            return [value[b] for b in order]
        return value

    args = (rows_of(args[0]), *args[1:]) if args else args
    kwargs = dict(kwargs)
    for name in ("inputs", "input_ids", "inputs_embeds", "attention_mask", "position_ids", "token_type_ids"):
        if name in kwargs:
            kwargs[name] = rows_of(kwargs[name])
    for name, value in knobs.items():
        if value is not None and _row_count({name: value}) is not None:
            kwargs[name] = rows_of(value)
    return args, kwargs, order


def _row_count(knobs):
    """The number of rows a per-row `loop_budget` or `step_schedule` gives, or None for one value for the batch."""
    budget, schedule = knobs.get("loop_budget"), knobs.get("step_schedule")
    if isinstance(budget, (list, tuple)) or (isinstance(budget, torch.Tensor) and budget.dim() == 1):
        return len(budget)
    if isinstance(schedule, (list, tuple)) and schedule and not isinstance(schedule[0], (int, float)):
        return len(schedule)
    return None


def _unsorted(out, order):
    """`generate`'s output `out` of a batch sorted by `_sorted_by_budget`, its rows back in the caller's order
    (each input's `num_return_sequences` rows stay together). The returned cache keeps the sorted order."""
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    per_input = sequences.shape[0] // len(order)
    rows = (inverse[:, None] * per_input + torch.arange(per_input)).flatten()

    def back(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == len(rows):
            return value[rows.to(value.device)]
        if isinstance(value, tuple):
            return tuple(back(v) for v in value)
        return value

    if isinstance(out, torch.Tensor):
        return back(out)
    for name, value in out.items():
        if name not in ("cache", "past_key_values"):
            out[name] = back(value)
    return out


# The draft of the running `generate` call with `assistant_loop_budget`: (its trajectory, its record of drafted and
# accepted tokens), read by `_get_candidate_generator` (a context variable: concurrent calls each see their own).
_LOOP_DRAFT = contextvars.ContextVar("loopformer_loop_draft", default=None)


def _check_draft(config, budget, schedule, knob, args, kwargs):
    """The draft trajectory of `assistant_loop_budget` / `assistant_step_schedule`, or a `ValueError` in one line for
    what cannot draft exactly: a draft at least as deep as the call's trajectory, per-row budgets, `halt_eps`, a
    batch of more than one sequence, beams, another assistant."""
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ValueError(f"`assistant_loop_budget` must be an integer >= 1, got {budget!r}.")
    try:
        draft = config.resolve_trajectory(budget, schedule)
    except ValueError as error:
        raise ValueError(f"assistant_loop_budget / assistant_step_schedule: {error}") from None
    target, rows = resolve_call(config, knob("loop_budget"), knob("step_schedule"))
    if rows is not None:
        raise ValueError("`assistant_loop_budget` drafts for one trajectory; per-row loop budgets are not supported.")
    if len(draft) >= len(target):
        raise ValueError(
            f"`assistant_loop_budget`={len(draft)} must be below the call's loop budget {len(target)}: the shallow "
            f"trajectory drafts for the deeper one."
        )
    if knob("halt_eps") is not None:
        raise ValueError("`assistant_loop_budget` with `halt_eps` is not supported: drop one of them.")
    if kwargs.get("assistant_model") is not None or knob("prompt_lookup_num_tokens") is not None:
        raise ValueError(
            "`assistant_loop_budget` drafts with the model itself: drop `assistant_model` / prompt lookup."
        )
    if (knob("num_beams") or 1) > 1:
        raise ValueError("`assistant_loop_budget` with beam search is not supported (nor is assisted decoding).")
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids", kwargs.get("inputs_embeds")))
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and inputs.shape[0] != 1:
        raise ValueError(
            f"`assistant_loop_budget` drafts for one sequence at a time (batch 1, as transformers' assisted decoding); "
            f"got a batch of {inputs.shape[0]}."
        )
    return draft


class LoopDraftCandidateGenerator(AssistedCandidateGenerator):
    """Self-speculative decoding: the model drafts for itself along a shallow trajectory (`assistant_loop_budget`
    = d steps), in its own cache (the draft's trajectory fills other cache layers than the call's), and the call's
    trajectory verifies. The same weights: `assistant_model` is the model itself, as in transformers'
    `EarlyExitCandidateGenerator`. `num_assistant_tokens`, its schedule and `assistant_confidence_threshold` are the
    call's (transformers reads them from the assistant's own generation_config)."""

    def __init__(self, input_ids, model, generation_config, model_kwargs, inputs_tensor, logits_processor, draft):
        trajectory, self.record = draft
        super().__init__(
            input_ids=input_ids,
            assistant_model=model,
            generation_config=generation_config,
            model_kwargs=model_kwargs,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
        )
        self.num_assistant_tokens = generation_config.num_assistant_tokens
        for name in ("num_assistant_tokens_schedule", "assistant_confidence_threshold"):
            setattr(self.assistant_generation_config, name, getattr(generation_config, name))
        self.generation_config.assistant_confidence_threshold = generation_config.assistant_confidence_threshold
        self.generation_config.assistant_early_exit = None  # the draft's own generate is not assisted
        self.assistant_kwargs.update(loop_budget=len(trajectory), step_schedule=list(trajectory))

    def _generate_candidates(self, generation_args):
        """The draft: this model at the draft's trajectory, one forward per token in the draft's own cache. It decides
        what `assistant_model.generate` would (the call's logits processors, greedy or sampled as the call is; EOS
        and `assistant_confidence_threshold` end a draft) without a nested `generate` per round, whose set-up costs
        more than the draft's own forwards on a small model. Exactness does not rest on it: verification keeps
        greedy output and the sampled distribution the call's whatever is drafted, given each sampled draft token
        is drawn from the returned scores."""
        ids, config = generation_args["input_ids"], self.generation_config
        kwargs = self.assistant_kwargs
        cache = kwargs.get("cache")
        if cache is None:
            cache = kwargs["cache"] = LoopFormerCache()
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(ids)
        positions = kwargs.get("position_ids")
        if positions is None or positions.shape[-1] != ids.shape[-1]:  # as `prepare_inputs_for_generation` makes them
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        eos = config._eos_token_tensor
        processors = list(self.logits_processor)  # the call's, less MinLength (the parent's __init__)
        if generation_args["min_new_tokens"] and eos is not None:
            processors.insert(
                0, MinNewTokensLengthLogitsProcessor(ids.shape[-1], generation_args["min_new_tokens"], eos)
            )
        knobs = {name: kwargs[name] for name in ("loop_budget", "step_schedule")}
        # without padding the draft needs no mask (a draft forward then skips building one: a d=1 step is short)
        padded = not bool(mask.all())
        threshold = config.assistant_confidence_threshold
        scores = []
        for _ in range(generation_args["max_new_tokens"]):
            seen = cache.get_seq_length()
            step_scores = (
                self.assistant_model(
                    input_ids=ids[:, seen:],
                    attention_mask=mask if padded else None,
                    position_ids=positions[:, seen:],
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                    **knobs,
                )
                .logits[:, -1]
                .to(torch.float32)
            )
            for processor in processors:  # as LogitsProcessorList, without its signature lookup at every call
                step_scores = processor(ids, step_scores)
            if config.do_sample or threshold:
                probs = step_scores.softmax(-1)
            token = torch.multinomial(probs, 1) if config.do_sample else step_scores.argmax(-1, keepdim=True)
            scores.append(step_scores)
            ids = torch.cat((ids, token), dim=-1)
            mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=-1)
            positions = torch.cat((positions, positions[:, -1:] + 1), dim=-1)
            if eos is not None and bool(torch.isin(token, eos.to(token.device)).any()):
                break
            if threshold and probs.gather(-1, token).item() < threshold:  # transformers' ConfidenceCriteria
                break
        kwargs.update(attention_mask=mask, position_ids=positions)
        return ids, torch.stack(scores, dim=1)

    def get_candidates(self, input_ids, **kwargs):
        candidates, logits = super().get_candidates(input_ids, **kwargs)
        self.record["drafted"] += candidates.shape[-1] - input_ids.shape[-1]
        return candidates, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.record["accepted"] += int(num_matches)
        return super().update_candidate_strategy(input_ids, scores, num_matches)


__all__ = [
    "LoopFormerGenerationMixin",
    "LoopFormerGenerateDecoderOnlyOutput",
    "LoopFormerGenerateBeamDecoderOnlyOutput",
]
