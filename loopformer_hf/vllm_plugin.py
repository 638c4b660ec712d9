"""vLLM plugin: `pip install ".[vllm]"` (from a checkout) installs the entry point `vllm.general_plugins` ->
`register`, which vLLM calls in every process it starts (the API server, the engine core, its workers) before it
reads a model's config. After it, `vllm serve CKPT` and `LLM(model=CKPT)` run a checkpoint this package saved.

Nothing here imports vLLM's model code: the model class is registered by its import path, so vLLM imports
`loopformer_hf.vllm_model` only when a LoopFormer checkpoint is loaded.
"""

import copyreg
import importlib
import logging
from abc import ABCMeta
from types import MappingProxyType
from typing import NamedTuple

logger = logging.getLogger(__name__)

# The `architectures` that this package's `save_pretrained` writes into config.json, and vLLM's model for each.
VLLM_ARCHITECTURES = MappingProxyType({"LoopFormerForCausalLM": "loopformer_hf.vllm_model:LoopFormerForCausalLM"})

# Knobs of `LoopFormerForCausalLM.generate` that a LoopFormer server reads (--hf-overrides, generation_config.json).
SERVER_KNOBS = ("loop_budget", "step_schedule", "halt_eps")
# What a request may set in `SamplingParams.extra_args` (the OpenAI server's `vllm_xargs`).
REQUEST_KNOBS = ("loop_budget", "step_schedule")
# --hf-overrides only: the largest budget a request may ask for (the server holds this many loop steps of KV cache).
MAX_REQUEST_BUDGET_KNOB = "max_request_loop_budget"
# The custom logits processor that carries each request's trajectory to the model (vLLM's V1 model runner), and the
# one that refuses per-request knobs where the model cannot honour them (Model Runner V2's interface). The config
# hook installs a subclass of one of them bound to the engine's `LoopFormerServing` (`served_processor`).
REQUESTS_LOGITS_PROCESSOR = "loopformer_hf.vllm_requests:LoopFormerRequestTrajectories"
REFUSING_LOGITS_PROCESSOR = "loopformer_hf.vllm_requests:LoopFormerRequestRefusal"


def per_request_refusal(vllm_config):
    """Why this server cannot run per-request trajectories, or None when it can."""
    from vllm.platforms import current_platform

    if vllm_config.use_v2_model_runner:
        return (
            "this server runs vLLM's Model Runner V2, and the LoopFormer model reads per-request trajectories "
            "through the V1 runner's logits processors; start it with VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if current_platform.is_cuda_alike() and not vllm_config.model_config.enforce_eager:
        return (
            "CUDA graphs replay the batch plan they captured, while each batch's loop steps follow its "
            "requests' budgets; start the server with --enforce-eager"
        )
    return None


def server_knobs(hf_config, generation_config=None):
    """The server's knobs: each from an attribute of `hf_config` set by `--hf-overrides`, else the checkpoint's
    generation_config.json (`generation_config`, a dict), else None (the config's own default)."""
    generation_config = generation_config or {}
    knobs = {}
    for name in SERVER_KNOBS:
        value = getattr(hf_config, name, None)
        knobs[name] = generation_config.get(name) if value is None else value
    return knobs


def server_trajectory(hf_config, generation_config=None):
    """The step sizes (Δ_1, ..., Δ_M) this server runs every request with.

    Each knob comes from the first of: an attribute of `hf_config` set by vLLM's `--hf-overrides`
    (`loop_budget`, `step_schedule`), the checkpoint's generation_config.json (`generation_config`, a dict), the
    config's own defaults. Validated by `LoopFormerConfig.resolve_trajectory` (the checks `generate` makes).
    Raises `ValueError` for what a vLLM server cannot run exactly:
    - `halt_eps` (per-token halting): a token's depth would depend on its values, while vLLM batches every request's
      tokens through one fixed stack of cache layers.
    """
    knobs = server_knobs(hf_config, generation_config)
    if knobs["halt_eps"] is not None:
        raise ValueError(
            f"halt_eps={knobs['halt_eps']!r} (per-token halting) is not supported by the vLLM LoopFormer model: vLLM "
            f"runs every token through one fixed stack of (loop step, block) cache layers. Serve a fixed budget "
            f"(remove halt_eps from the checkpoint's generation_config.json), or use "
            f"`model.generate(..., halt_eps=...)`."
        )
    return hf_config.resolve_trajectory(knobs["loop_budget"], knobs["step_schedule"])


def max_request_loop_budget(hf_config, generation_config=None):
    """The largest loop budget a request may ask for: `--hf-overrides '{"max_request_loop_budget": N}'`, else the
    larger of `num_loops` and the server's own budget. The model holds that many loop steps of paged KV cache."""
    return _request_budget_limit(hf_config, len(server_trajectory(hf_config, generation_config)))


def _request_budget_limit(hf_config, default):
    limit = getattr(hf_config, MAX_REQUEST_BUDGET_KNOB, None)
    if limit is None:
        return max(hf_config.num_loops, default)
    limit = hf_config._check_budget(limit, MAX_REQUEST_BUDGET_KNOB)
    if limit < default:
        raise ValueError(f"`{MAX_REQUEST_BUDGET_KNOB}`={limit} is below the server's own loop budget {default}.")
    return limit


class RequestLoop(NamedTuple):
    """What one vLLM request runs, resolved once from its knobs and its server's (`LoopFormerServing.request_loop`)
    and never changed: its trajectory (Δ_1..Δ_M) and loop budget M, hence its cache layout: the loop steps 0..M-1
    of the server's stack of (loop step, block) cache layers (`model.layers.{i*k + j}.self_attn.attn`, i < M). No
    halting: per-token halting (`halt_eps`) is refused for the server and for each request."""

    trajectory: tuple
    budget: int

    @classmethod
    def of(cls, trajectory):
        trajectory = tuple(trajectory)
        return cls(trajectory, len(trajectory))


class LoopFormerServing(NamedTuple):
    """What one LoopFormer server runs, resolved once per engine from its model config and never changed: the
    server's own `RequestLoop`, the knobs a request's own ones fall back to, the largest budget a request may ask
    for (the cache layers the model holds), and why per-request knobs are refused here (None: they are served).

    The plugin's config hook builds it where vLLM builds the engine's config and binds it to the engine's logits
    processor class (`served_processor`), which both the front-end's admission check and the worker
    read; the model takes it from there too (`serving_of`)."""

    hf_config: object
    loop: RequestLoop  # the server's own trajectory: every request that asks for none runs it
    budget_knob: object  # the server's `loop_budget` knob as given (None: the config's default)
    schedule_preset: str | None  # the server's `step_schedule` when it is a preset name
    max_budget: int
    refusal: str | None = None

    @classmethod
    def build(cls, hf_config, generation_config=None, refusal=None):
        loop = RequestLoop.of(server_trajectory(hf_config, generation_config))
        knobs = server_knobs(hf_config, generation_config)
        preset = knobs["step_schedule"] if isinstance(knobs["step_schedule"], str) else None
        return cls(
            hf_config, loop, knobs["loop_budget"], preset, _request_budget_limit(hf_config, loop.budget), refusal
        )

    @classmethod
    def of_config(cls, vllm_config):
        """The serving of an engine (`VllmConfig`), with its `per_request_refusal`."""
        model_config = vllm_config.model_config
        return cls.build(
            model_config.hf_config, model_config.try_get_generation_config(), per_request_refusal(vllm_config)
        )

    def request_loop(self, extra_args):
        """The `RequestLoop` of a request with these `SamplingParams.extra_args` (`loop_budget`, `step_schedule`), or
        None when it asks for neither (it runs the server's `loop`).

        A knob the request leaves out comes from the server's knobs, as `generate` takes the generation config's,
        where they fit: a schedule list sets its own budget, and a budget takes the server's schedule when that is a
        preset name (else the config's default). Raises `ValueError` naming the bad value (checked as `generate`
        checks it), a budget above `max_budget`, and `halt_eps` (per-token halting is not served)."""
        extra_args = extra_args or {}
        if "halt_eps" in extra_args:
            raise ValueError(
                f"halt_eps={extra_args['halt_eps']!r} (per-token halting) is not supported by the vLLM "
                f"LoopFormer model; ask for a fixed `loop_budget`."
            )
        if not any(name in extra_args for name in REQUEST_KNOBS):
            return None
        schedule = extra_args.get("step_schedule", self.schedule_preset)
        budget = extra_args.get("loop_budget", self.budget_knob if isinstance(schedule, str) else None)
        loop = RequestLoop.of(self.hf_config.resolve_trajectory(budget, schedule))
        if loop.budget > self.max_budget:
            raise ValueError(
                f"`loop_budget`={loop.budget} exceeds this server's largest per-request loop budget, "
                f"{self.max_budget} (its KV cache holds {self.max_budget} loop steps; start it with --hf-overrides "
                f"'{{\"{MAX_REQUEST_BUDGET_KNOB}\": {loop.budget}}}' to serve more)."
            )
        return loop


def request_trajectory(hf_config, generation_config, extra_args):
    """The step sizes one request runs with (`LoopFormerServing.request_loop` of a server with this config), or None
    when it asks for none (the server's trajectory)."""
    loop = LoopFormerServing.build(hf_config, generation_config).request_loop(extra_args)
    return None if loop is None else loop.trajectory


def serving_of(vllm_config):
    """The `LoopFormerServing` an engine runs: the one the config hook bound to its logits processor class, else
    (no such processor, as with speculative decoding) built here from its config."""
    for processor in vllm_config.model_config.logits_processors or ():
        serving = getattr(processor, "serving", None)
        if isinstance(serving, LoopFormerServing):
            return serving
    return LoopFormerServing.of_config(vllm_config)


# How a server reaches the front-end's admission check, which gets no config: vLLM's `ModelConfig.logits_processors`
# takes classes as well as names (vllm/config/model.py:403-405; loaded as given in
# vllm/v1/sample/logits_processor/__init__.py:117-124 and vllm/v1/worker/gpu/sample/logits_processor/loader.py:87-95),
# and the front-end's `InputProcessor` calls `validate_params` on each class of its own engine's model config
# (vllm/v1/engine/input_processor.py:93-113, 177), a classmethod (vllm/v1/sample/logits_processor/interface.py:61-62):
# a class bound to its server is what it can read. The worker's runner builds the processor from the same list
# (vllm/v1/worker/gpu_model_runner.py:697-731), so the worker gets the server resolved here, not resolved again.
class ServedProcessor(ABCMeta):
    """The metaclass of a logits processor class bound to one server (`served_processor`). Such a class pickles as
    (its base, its `LoopFormerServing`), so that a `VllmConfig` holding it reaches a spawned engine core or worker
    (copyreg's table below holds that rule for the type, no data)."""


def served_processor(base, serving):
    """A subclass of the logits processor class `base` bound to `serving` (its `validate_params`, a classmethod,
    reads it there)."""
    name = f"{base.__name__}Served"
    return ServedProcessor(name, (base,), {"serving": serving, "__module__": base.__module__, "__qualname__": name})


copyreg.pickle(ServedProcessor, lambda cls: (served_processor, (cls.__bases__[0], cls.serving)))


def bind_processor(processors, serving):
    """`model_config.logits_processors` with this package's processor bound to `serving`, in place of any unbound or
    earlier one: `LoopFormerRequestTrajectories`, or where per-request knobs are refused the refusing one. The class
    is loaded by its name, as vLLM loads a logits processor it is given by name."""
    ours = (REQUESTS_LOGITS_PROCESSOR, REFUSING_LOGITS_PROCESSOR)
    kept = [
        p for p in processors or () if (f"{p.__module__}:{p.__qualname__}" if isinstance(p, type) else p) not in ours
    ]
    kept = [p for p in kept if not isinstance(p, ServedProcessor)]
    module, name = ours[serving.refusal is not None].split(":")
    return [*kept, served_processor(getattr(importlib.import_module(module), name), serving)]


def write_draft_checkpoint(checkpoint, path, loop_budget, step_schedule="uniform"):
    """Write `path`, a checkpoint folder that vLLM serves as `checkpoint` at `loop_budget` (and `step_schedule`): the
    draft of vLLM's speculative decoding, `speculative_config={"method": "draft_model", "model": path}`. vLLM builds
    a draft as a second model from its own folder and reads no `--hf-overrides` for it, so the budget goes in the
    folder's generation_config.json; the other files are links to the checkpoint's (copies where links fail). The
    trajectory is checked as `generate` checks it; `path` must be new or empty. Returns `path`."""
    import os
    import shutil

    from transformers import AutoConfig, GenerationConfig

    import loopformer_hf  # noqa: F401  (registers the config with AutoConfig)

    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ValueError(f"{checkpoint!r} is not a checkpoint folder (no config.json).")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ValueError(f"The draft folder {path!r} exists and is not empty: give a new folder.")
    config = AutoConfig.from_pretrained(checkpoint)
    config.resolve_trajectory(loop_budget, step_schedule)  # a bad budget or schedule is refused here, named
    try:
        generation = GenerationConfig.from_pretrained(checkpoint)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    generation.loop_budget, generation.step_schedule = loop_budget, step_schedule
    # a generation_config.json that says `"_from_model_config": true` loses every other field when it is read
    # (transformers' GenerationConfig.__init__); transformers < 5.24 keeps the flag on save
    generation._from_model_config = False
    os.makedirs(path, exist_ok=True)
    for name in sorted(os.listdir(checkpoint)):
        source = os.path.abspath(os.path.join(checkpoint, name))
        if name == "generation_config.json" or not os.path.isfile(source):
            continue
        try:
            os.symlink(source, os.path.join(path, name))
        except OSError:
            shutil.copy2(source, os.path.join(path, name))
    generation.save_pretrained(path)
    return path


class LoopFormerServerConfig:
    """vLLM's per-architecture config hook (the `VerifyAndUpdateConfig` protocol of
    vllm.model_executor.models.config): vLLM calls it where the `ModelConfig` is built, in the user's own process
    (the API server, `LLM(...)`), so a bad `--hf-overrides` value is refused there with its message, not only in
    the engine core's log behind "Engine core initialization failed"."""

    @staticmethod
    def verify_and_update_config(vllm_config):
        """The server resolved once (`LoopFormerServing`: a bad `--hf-overrides` value is refused here) and bound to
        the logits processor class that checks each request at admission (in this process) and carries it to the
        model (in the worker); no prefix cache, since its blocks are keyed by token ids alone."""
        serving = LoopFormerServing.of_config(vllm_config)
        if vllm_config.speculative_config is not None:
            # vLLM refuses every custom logits processor with speculative decoding: the server runs its own
            # trajectory, and per-request knobs are not read (docs/serving.md)
            logger.warning("LoopFormer: speculative decoding: per-request loop_budget/step_schedule are ignored.")
            return
        model_config = vllm_config.model_config
        model_config.logits_processors = bind_processor(model_config.logits_processors, serving)
        refusal = serving.refusal
        if refusal is None and vllm_config.cache_config.enable_prefix_caching:
            # KV computed under one trajectory is wrong under another, and vLLM 0.32 lets no model key its cached
            # blocks by a request's sampling params (a request's `cache_salt` comes from the prompt, before any
            # model hook sees the request); a cache hit would serve another trajectory's prompt KV.
            logger.info(
                "LoopFormer: prefix caching disabled (its blocks are keyed by token ids alone, and each "
                "request may run its own loop budget and schedule)."
            )
            vllm_config.cache_config.enable_prefix_caching = False

    @staticmethod
    def verify_and_update_model_config(model_config):
        server_trajectory(model_config.hf_config, model_config.try_get_generation_config())


def register():
    """Register LoopFormer with vLLM (idempotent: vLLM may call it more than once per process)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    # `import loopformer_hf` registers LoopFormerConfig (model_type "loopformer") with AutoConfig, so vLLM reads a
    # checkpoint's config.json without `trust_remote_code`.
    import loopformer_hf  # noqa: F401

    supported = set(ModelRegistry.get_supported_archs())
    for architecture, model_path in VLLM_ARCHITECTURES.items():
        if architecture not in supported:
            ModelRegistry.register_model(architecture, model_path)
        MODELS_CONFIG_MAP.setdefault(architecture, LoopFormerServerConfig)
