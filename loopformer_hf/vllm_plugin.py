"""vLLM plugin: `pip install ".[vllm]"` (from a checkout) installs the entry point `vllm.general_plugins` ->
`register`, which vLLM calls in every process it starts (the API server, the engine core, its workers) before it
reads a model's config. After it, `vllm serve CKPT` and `LLM(model=CKPT)` run a checkpoint this package saved.

Nothing here imports vLLM's model code: the model class is registered by its import path, so vLLM imports
`loopformer_hf.vllm_model` only when a LoopFormer checkpoint is loaded.
"""

import logging

logger = logging.getLogger(__name__)

# The `architectures` that this package's `save_pretrained` writes into config.json, and vLLM's model for each.
VLLM_ARCHITECTURES = {"LoopFormerForCausalLM": "loopformer_hf.vllm_model:LoopFormerForCausalLM"}

# Knobs of `LoopFormerForCausalLM.generate` that a LoopFormer server reads (--hf-overrides, generation_config.json).
SERVER_KNOBS = ("loop_budget", "step_schedule", "halt_eps")
# What a request may set in `SamplingParams.extra_args` (the OpenAI server's `vllm_xargs`).
REQUEST_KNOBS = ("loop_budget", "step_schedule")
# --hf-overrides only: the largest budget a request may ask for (the server holds this many loop steps of KV cache).
MAX_REQUEST_BUDGET_KNOB = "max_request_loop_budget"
# The custom logits processor that carries each request's trajectory to the model (vLLM's V1 model runner), and the
# one that refuses per-request knobs where the model cannot honour them (Model Runner V2's interface).
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
      tokens through one fixed stack of cache layers;
    - `cache_sharing="modulo"`: the shared slots are overwritten across decode steps in `generate`'s order, which
      paged attention does not reproduce.
    """
    knobs = server_knobs(hf_config, generation_config)
    if knobs["halt_eps"] is not None:
        raise ValueError(
            f"halt_eps={knobs['halt_eps']!r} (per-token halting) is not supported by the vLLM LoopFormer model: vLLM "
            f"runs every token through one fixed stack of (loop step, block) cache layers. Serve a fixed budget "
            f"(remove halt_eps from the checkpoint's generation_config.json), or use "
            f"`model.generate(..., halt_eps=...)`."
        )
    if getattr(hf_config, "cache_sharing", "none") != "none":
        raise ValueError(
            f"cache_sharing={hf_config.cache_sharing!r} is not supported by the vLLM LoopFormer model (its slots are "
            f"shared across decode steps in generate's order); serve with --hf-overrides "
            f'\'{{"cache_sharing": "none"}}\' (exact: one cache per loop step and block).'
        )
    return hf_config.resolve_trajectory(knobs["loop_budget"], knobs["step_schedule"])


def max_request_loop_budget(hf_config, generation_config=None):
    """The largest loop budget a request may ask for: `--hf-overrides '{"max_request_loop_budget": N}'`, else the
    larger of `num_loops` and the server's own budget. The model holds that many loop steps of paged KV cache."""
    default = len(server_trajectory(hf_config, generation_config))
    limit = getattr(hf_config, MAX_REQUEST_BUDGET_KNOB, None)
    if limit is None:
        return max(hf_config.num_loops, default)
    limit = hf_config._check_budget(limit, MAX_REQUEST_BUDGET_KNOB)
    if limit < default:
        raise ValueError(f"`{MAX_REQUEST_BUDGET_KNOB}`={limit} is below the server's own loop budget {default}.")
    return limit


def request_trajectory(hf_config, generation_config, extra_args):
    """The step sizes one request runs with, from its `SamplingParams.extra_args` (`loop_budget`, `step_schedule`),
    or None when it asks for neither (the server's trajectory).

    A knob the request leaves out comes from the server's knobs, as `generate` takes the generation config's, where
    they fit: a schedule list sets its own budget, and a budget takes the server's schedule when that is a preset
    name (else the config's default). Raises `ValueError` naming the bad value (checked as `generate` checks it), a budget above
    `max_request_loop_budget`, and `halt_eps` (per-token halting is not served)."""
    extra_args = extra_args or {}
    if "halt_eps" in extra_args:
        raise ValueError(
            f"halt_eps={extra_args['halt_eps']!r} (per-token halting) is not supported by the vLLM "
            f"LoopFormer model; ask for a fixed `loop_budget`."
        )
    if not any(name in extra_args for name in REQUEST_KNOBS):
        return None
    knobs = server_knobs(hf_config, generation_config)
    server_schedule = knobs["step_schedule"] if isinstance(knobs["step_schedule"], str) else None
    schedule = extra_args.get("step_schedule", server_schedule)
    budget = extra_args.get("loop_budget", knobs["loop_budget"] if isinstance(schedule, str) else None)
    steps = hf_config.resolve_trajectory(budget, schedule)
    limit = max_request_loop_budget(hf_config, generation_config)
    if len(steps) > limit:
        raise ValueError(
            f"`loop_budget`={len(steps)} exceeds this server's largest per-request loop budget, {limit} (its KV "
            f"cache holds {limit} loop steps; start it with --hf-overrides "
            f"'{{\"{MAX_REQUEST_BUDGET_KNOB}\": {len(steps)}}}' to serve more)."
        )
    return steps


# (model config, `per_request_refusal`) of the server this process built last (the API server's, `LLM(...)`'s): the
# front-end's admission check (`validate_params`) is a classmethod and gets no config of its own.
SERVED_MODEL_CONFIGS = []


class LoopFormerServerConfig:
    """vLLM's per-architecture config hook (the `VerifyAndUpdateConfig` protocol of
    vllm.model_executor.models.config): vLLM calls it where the `ModelConfig` is built, in the user's own process
    (the API server, `LLM(...)`), so a bad `--hf-overrides` value is refused there with its message, not only in
    the engine core's log behind "Engine core initialization failed"."""

    @staticmethod
    def verify_and_update_config(vllm_config):
        """Per-request trajectories: the logits processor that carries them to the model (and checks them at
        admission, in this process), and no prefix cache, since its blocks are keyed by token ids alone."""
        model_config = vllm_config.model_config
        max_request_loop_budget(model_config.hf_config, model_config.try_get_generation_config())
        refusal = per_request_refusal(vllm_config)
        SERVED_MODEL_CONFIGS[:] = [(model_config, refusal)]  # the latest server of this process
        if vllm_config.speculative_config is not None:
            # vLLM refuses every custom logits processor with speculative decoding: the server runs its own
            # trajectory, and per-request knobs are not read (docs/serving.md)
            logger.warning("LoopFormer: speculative decoding: per-request loop_budget/step_schedule are ignored.")
            return
        processor = REQUESTS_LOGITS_PROCESSOR if refusal is None else REFUSING_LOGITS_PROCESSOR
        processors = list(model_config.logits_processors or ())
        if processor not in processors:
            model_config.logits_processors = [*processors, processor]
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

    # `import loopformer_hf` registers LoopFormerConfig (model_type "loopformer") with AutoConfig, so vLLM reads a
    # checkpoint's config.json without `trust_remote_code`.
    import loopformer_hf  # noqa: F401

    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    supported = set(ModelRegistry.get_supported_archs())
    for architecture, model_path in VLLM_ARCHITECTURES.items():
        if architecture not in supported:
            ModelRegistry.register_model(architecture, model_path)
        MODELS_CONFIG_MAP.setdefault(architecture, LoopFormerServerConfig)
