"""LoopFormer's part of `generate`: [`LoopFormerGenerationMixin`] overrides transformers' generation hooks so that a
looped model gets its own cache (one slot per (loop step, block)), the loop knobs (`loop_budget`, `step_schedule`,
`halt_eps`) reach every forward (from the call or from `generation_config`), classifier-free
guidance and assisted decoding run the right loop, and with `halt_eps` each returned position's loop count is
gathered into the output (`LoopFormerGenerateDecoderOnlyOutput.loop_counts`).

Six of its hooks are private `GenerationMixin` methods; the comment above each says why no public hook
(`prepare_inputs_for_generation`, `generate`, the cache argument, `generation_config`, `logits_processor`) serves.
Their names and the arguments they read by name are the same in transformers 5.17 to 5.24, and
tests/loopformer/test_generation_modes.py checks that the installed transformers still has them.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

import functools
import json
from dataclasses import dataclass

import torch
from transformers.generation import (
    GenerateBeamDecoderOnlyOutput,
    GenerateDecoderOnlyOutput,
    GenerationMixin,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from .cache_loopformer import CACHE_FIELD, LoopFormerCache
from .plan_loopformer import LoopFormerPlan


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
        LoopFormerPlan.for_call(config, None, **{name: knobs.get(name) for name in GENERATION_LOOP_KNOBS})
    except ValueError as e:
        raise ValueError(
            f"{source} sets a loop knob of `generate` that this model refuses: {e} Fix or remove it there."
        ) from None


def _loop_counts_unsupported(kwargs, generation_config):
    """The decoding mode under which per-position loop counts cannot be gathered, or None."""
    config = kwargs.get("generation_config") or generation_config

    def get(name):
        return kwargs[name] if name in kwargs else getattr(config, name, None)

    if get("prefill_chunk_size") is not None:
        return "chunked prefill (prefill_chunk_size)"
    return None


def _schedule_as_numbers(schedule):
    """A `step_schedule` given as a 1-D tensor (or a per-row list holding some) as lists of floats, the values the
    plan resolves it to (`check_schedule`): a plan made of plain values is recognised by the call's later forwards,
    where a tensor would have each of them resolve it again."""
    if isinstance(schedule, torch.Tensor):
        return schedule.tolist() if schedule.ndim == 1 and schedule.is_floating_point() else schedule
    if isinstance(schedule, list) and any(isinstance(s, torch.Tensor) for s in schedule):
        return [_schedule_as_numbers(s) if isinstance(s, torch.Tensor) else s for s in schedule]
    return schedule


def _mark_lengths_dynamic(model_inputs):
    """With a dynamic `LoopFormerCache`, mark the sequence lengths of a forward's inputs and of the cached keys and
    values dynamic (a hint to Dynamo). A compiled `forward` then traces one prefill graph for any prompt length and
    one decode graph for every cached length from its first call on, instead of a graph for the first length seen and
    another once it changes (a third graph per budget: four budgets would pass Dynamo's `recompile_limit` of 8)."""
    cache = model_inputs.get("cache", model_inputs.get("past_key_values"))
    if type(cache) is not LoopFormerCache:  # a static cache has fixed shapes already
        return
    for name in ("input_ids", "inputs_embeds", "attention_mask", "position_ids"):
        tensor = model_inputs.get(name)
        if isinstance(tensor, torch.Tensor) and tensor.ndim >= 2 and tensor.shape[1] > 1:  # 0 and 1 specialise
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
    for layer in cache.layers:
        for tensor in (getattr(layer, "_keys", None), getattr(layer, "_values", None)):
            if isinstance(tensor, torch.Tensor) and tensor.ndim == 4 and tensor.shape[-2] > 1:
                torch._dynamo.maybe_mark_dynamic(tensor, 2)


class LoopFormerGenerationMixin(GenerationMixin):
    """`GenerationMixin` for a looped model (see the module's docstring); `LoopFormerForCausalLM` mixes it in."""

    # the model kwargs that are loop knobs: passed to every forward, and to `model._plan` for the cache generate makes
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

    # Private hook, kept: `generate` builds its default cache inline (`DynamicCache(config=...)`, or `StaticCache` for
    # `cache_implementation="static"`) with `num_hidden_layers` slots, and has no public way to choose another cache
    # class. The slot count depends on this call's loop knobs, and the static cache's length on generate's max_length.
    # Swapping the cache in `prepare_inputs_for_generation` would leave generate's own cache in its kwargs until the
    # first forward returns ours, so behaviour would depend on what generate does with that cache before then
    # (auto-compile criteria, prefill slicing, assisted decoding's past recording). That is private behaviour too, and
    # the swap would need a check at every step.
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' hook for a model's own cache: `generate` builds a `DynamicCache` (or, with
        `cache_implementation="static"`, a `StaticCache`) with `num_hidden_layers` slots; a looped model needs one per
        (loop step, block), so it gets an empty `LoopFormerCache` (or `LoopFormerStaticCache`) instead."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        # the batch the forwards will see: generate has repeated the rows for beams and num_return_sequences
        batch_size = kwargs.get("batch_size", args[1] if len(args) > 1 else None)
        if batch_size is not None:
            batch_size *= max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        knobs = {name: model_kwargs.get(name) for name in self.generation_loop_knobs}
        LoopFormerCache.replace_generate_default(  # the plan: once per generate call
            model_kwargs, self.config, lambda: self.model._plan(None, batch_size, **knobs)
        )

    def init_continuous_batching(self, *args, **kwargs):
        """Continuous batching (`generate_batch`, `init_continuous_batching`) is not supported: its paged cache has
        one slot per layer, where a looped model needs one per (loop step, block)."""
        raise NotImplementedError(
            "LoopFormer does not support continuous batching (generate_batch / init_continuous_batching): its paged "
            "cache has no slot per (loop step, block). Use `generate` with a padded batch (and "
            '`cache_implementation="static"` for compiled decoding).'
        )

    # Private hook, kept: classifier-free guidance's processor is built inside `generate` with the model as its
    # unconditional forward. A processor passed as `logits_processor=` would replace it in place, but it would have to
    # be built before `generate` repeats a tensor of per-row budgets for beams and num_return_sequences, and
    # transformers warns when a passed processor replaces one it builds.
    def _get_logits_processor(self, *args, **kwargs):
        """transformers' hook that builds the logits processors. Classifier-free guidance (`guidance_scale`) runs a
        second, unconditional forward by calling the model with the ids alone: bind this call's loop knobs to it, so
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

    # Private hook, kept: assisted decoding's drafter copies every model kwarg into each `assistant_model.generate`
    # call, and no public hook filters them. The assistant's own `generate` cannot tell whether knobs came from the
    # main call or from the user, and an assistant of another class rejects them as unused model kwargs.
    def _get_candidate_generator(self, *args, **kwargs):
        """transformers' hook that builds assisted decoding's drafter, which copies the call's model kwargs for an
        assistant model. The loop knobs (and this call's loop-count record) belong to this model: the assistant runs
        under its own `generation_config` (e.g. a LoopFormer draft with `generation_config.loop_budget = 1`)."""
        assistant = kwargs.get("assistant_model")
        if assistant is not None and assistant is not self and kwargs.get("model_kwargs") is not None:
            kwargs["model_kwargs"] = {
                name: value
                for name, value in kwargs["model_kwargs"].items()
                if name not in self.generation_loop_knobs and name != "loop_counts_log"
            }
        return super()._get_candidate_generator(*args, **kwargs)

    # Private hook, kept: `GenerationConfig.update` absorbs a call kwarg that the config also holds (a loop knob in
    # generation_config.json is carried over as a custom entry), so the merged value never reaches `model_kwargs`.
    # Passing the knobs in from `generate` would be absorbed the same way. This is the only place that sees the merged
    # config and the model kwargs before the cache, the logits processors and the beam / num_return_sequences
    # expansion read them.
    def _prepare_generation_config(self, generation_config, *args, **kwargs):
        """transformers' hook that merges `generation_config` (the call's, then `self.generation_config`) with the call
        kwargs. A loop knob set on a `GenerationConfig` is stored there but is no model kwarg, so it would not reach
        `forward`; a call kwarg of the same name is absorbed into the config. Hand the merged value on to `forward`."""
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, *args, **kwargs)
        for name in self.generation_loop_knobs:
            value = getattr(generation_config, name, None)
            if name not in model_kwargs and value is not None:
                model_kwargs[name] = value
        if "step_schedule" in model_kwargs:  # as plain numbers: the prefill then finds the plan made for the cache
            model_kwargs["step_schedule"] = _schedule_as_numbers(model_kwargs["step_schedule"])
        return generation_config, model_kwargs

    def _forward_replaced(self):
        """Whether `forward` was replaced on the instance (e.g. `model.forward = torch.compile(model.forward)`)."""
        return getattr(self.forward, "__func__", None) is not type(self).forward

    # Private hook, kept: the prefill calls `self(**model_inputs)` directly. The eager stance must wrap that one call,
    # and neither `prepare_inputs_for_generation` (it returns before the call) nor `forward` (inside the compiled
    # frame) can wrap it.
    def _prefill(self, *args, **kwargs):
        """As transformers' own compiled generation (`compile_config`), the prefill runs eager and only the decode
        steps run a compiled `forward`: one graph per trajectory, not a prefill graph beside each decode graph
        (Dynamo's recompile limit of 8 then holds 8 budgets, not 4)."""
        if not self._forward_replaced():
            return super()._prefill(*args, **kwargs)
        with torch.compiler.set_stance("force_eager"):
            return super()._prefill(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, loop_counts_log=None, **kwargs):
        """As `GenerationMixin`'s; `loop_counts_log` is this `generate` call's record of loop counts, not a model
        input: each forward adds an entry with the length of the sequence it is asked about (drafted tokens included)
        and, in `_update_model_kwargs_for_generation`, its loop counts and how many tokens were accepted."""
        if loop_counts_log is not None:
            loop_counts_log.append({"length": input_ids.shape[1]})
        model_inputs = super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)
        if self._forward_replaced():
            _mark_lengths_dynamic(model_inputs)
        return model_inputs

    if CACHE_FIELD == "past_key_values":  # transformers before 5.24
        _prepare_inputs_for_generation = prepare_inputs_for_generation

        def prepare_inputs_for_generation(
            self, input_ids, inputs_embeds=None, loop_counts_log=None, past_key_values=None, **kwargs
        ):
            """As above. Before transformers 5.24 `generate`'s cache argument is `past_key_values`, which `forward`
            takes only under `**kwargs`, and `generate` refuses a model kwarg that neither `forward` nor this method
            names: named here, so that a cache passed to `generate` (an assistant's too, from its second draft on)
            is accepted."""
            return self._prepare_inputs_for_generation(
                input_ids, inputs_embeds, loop_counts_log, past_key_values=past_key_values, **kwargs
            )

    # Private hook, kept: only this step sees a forward's outputs (`loop_counts`) and how many tokens assisted
    # decoding accepted (`num_new_tokens`), for this call only. A forward hook would be shared by concurrent calls and
    # would also see classifier-free guidance's unconditional forward.
    # It is also where the plan reaches the decode steps: after this call's first forward (which resolved its loop
    # knobs and bound the plan to the cache, or found it there from `_prepare_cache_for_generation`), the cache's plan
    # is this call's, and every later forward takes it as the model input `loop_plan`: nothing is resolved, compared
    # or checked per step.
    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, num_new_tokens=1, **kwargs):
        log = model_kwargs.get("loop_counts_log")
        if log and getattr(outputs, "loop_counts", None) is not None:
            log[-1].update(counts=outputs.loop_counts, new_tokens=num_new_tokens)
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, *args, num_new_tokens=num_new_tokens, **kwargs
        )
        plan = getattr(model_kwargs.get(CACHE_FIELD), "plan", None)
        if plan is not None:
            model_kwargs["loop_plan"] = plan
        return model_kwargs

    @staticmethod
    def _gather_loop_counts(log, out, assisted):
        """(rows, length - 1) loop counts of the returned sequences from the per-forward records of `log`. Positions
        that a cache passed to `generate` already held count 0: this call ran no loop step for them."""
        log = [entry for entry in log if "counts" in entry]
        if not log:
            return None
        # positions before the first forward's first column (none for a prompt given as inputs_embeds: no ids)
        held = max(log[0]["length"] - log[0]["counts"].shape[1], 0)
        counts = LoopFormerGenerationMixin._gathered_counts(log, out, assisted, held)
        return torch.cat([counts.new_zeros(counts.shape[0], held), counts], dim=1) if held else counts

    @staticmethod
    def _gathered_counts(log, out, assisted, held):
        """`_gather_loop_counts` from the first forward's first column on."""
        beam_indices = out.get("beam_indices") if not isinstance(out, torch.Tensor) else None
        if beam_indices is not None:
            # Beam search: the forward of step s ran on the beams as reordered after step s - 1; the token of step s
            # of a returned sequence came from beam row beam_indices[:, s] (-1 after the sequence finished).
            rows = beam_indices.long()
            columns = [log[0]["counts"][rows[:, 0].clamp(min=0)]]
            for step in range(1, rows.shape[1]):
                counts = log[step]["counts"][rows[:, step].clamp(min=0), -1]
                columns.append(torch.where(rows[:, step] >= 0, counts, torch.zeros_like(counts))[:, None])
            return torch.cat(columns, dim=1)
        if not assisted:
            # The first forward sees the prompt; every later one adds one position (the last column, cached or not).
            return torch.cat([log[0]["counts"]] + [entry["counts"][:, -1:] for entry in log[1:]], dim=1)
        # Assisted / prompt-lookup decoding: a forward scores the drafted tokens too; keep the columns of the
        # positions whose next token was accepted (the cache is cropped to the same positions).
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        length = sequences.shape[1] - sum(entry["new_tokens"] for entry in log)  # the prompt
        done, columns = held, []
        for entry in log:
            first = entry["length"] - entry["counts"].shape[1]  # position of the forward's first column
            last = length + entry["new_tokens"] - 2  # last position whose next token is now in the sequence
            columns.append(entry["counts"][:, done - first : last - first + 1])
            done, length = last + 1, length + entry["new_tokens"]
        return torch.cat(columns, dim=1)

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, plus the kwargs `loop_budget` and `step_schedule` (one for the batch, or a list
        of one per row) and `halt_eps`. The same fields set on `generation_config` (or on
        `model.generation_config`, which `save_pretrained` writes to generation_config.json) are used when the call
        does not give them.

        With `halt_eps` and `return_dict_in_generate=True`, the output (a [`LoopFormerGenerateDecoderOnlyOutput`], or
        [`LoopFormerGenerateBeamDecoderOnlyOutput`] for beam search) carries `loop_counts`, a (returned sequences,
        length - 1) tensor: the loop steps spent on each position of each returned sequence (position i produced
        token i + 1). Greedy decoding, sampling, beam search (the counts follow the beams' reordering), assisted and
        prompt-lookup decoding (the counts of accepted tokens only); chunked prefill raises `ValueError` with
        `halt_eps`.
        """
        log = None
        given = kwargs.get("generation_config") or self.generation_config
        halt_eps = kwargs["halt_eps"] if "halt_eps" in kwargs else getattr(given, "halt_eps", None)
        if halt_eps is None and kwargs.get("generation_config") is not None:
            halt_eps = getattr(self.generation_config, "halt_eps", None)
        if halt_eps is not None:
            unsupported = _loop_counts_unsupported(kwargs, self.generation_config)
            if unsupported is not None:
                raise ValueError(
                    f"`halt_eps` with {unsupported} is not supported: the loop counts of each position are gathered "
                    f"for whole-prompt prefills only. Drop `prefill_chunk_size`, or drop `halt_eps`."
                )
            log = []  # local to this call: concurrent generate calls on one model each keep their own counts
        out = super().generate(*args, loop_counts_log=log, **kwargs)
        assisted = (
            kwargs.get("assistant_model") is not None
            or (
                kwargs["prompt_lookup_num_tokens"]
                if "prompt_lookup_num_tokens" in kwargs
                else getattr(given, "prompt_lookup_num_tokens", None)
            )
            is not None
        )
        counts = self._gather_loop_counts(log, out, assisted) if log else None
        if counts is None or isinstance(out, torch.Tensor):
            return out
        if isinstance(out, GenerateBeamDecoderOnlyOutput):
            return LoopFormerGenerateBeamDecoderOnlyOutput(**out, loop_counts=counts)
        return LoopFormerGenerateDecoderOnlyOutput(**out, loop_counts=counts)


__all__ = [
    "LoopFormerGenerationMixin",
    "LoopFormerGenerateDecoderOnlyOutput",
    "LoopFormerGenerateBeamDecoderOnlyOutput",
]
