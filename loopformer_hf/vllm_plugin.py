"""vLLM plugin: `pip install "looped-transformers-hf[vllm]"` installs the entry point `vllm.general_plugins` ->
`register`, which vLLM calls in every process it starts (the API server, the engine core, its workers) before it
reads a model's config. After it, `vllm serve CKPT` and `LLM(model=CKPT)` run a checkpoint this package saved.

Nothing here imports vLLM's model code: the model class is registered by its import path, so vLLM imports
`loopformer_hf.vllm_model` only when a LoopFormer checkpoint is loaded.
"""

# The `architectures` that this package's `save_pretrained` writes into config.json, and vLLM's model for each.
VLLM_ARCHITECTURES = {"LoopFormerForCausalLM": "loopformer_hf.vllm_model:LoopFormerForCausalLM"}

# Knobs of `LoopFormerForCausalLM.generate` that a LoopFormer server reads (--hf-overrides, generation_config.json).
SERVER_KNOBS = ("loop_budget", "step_schedule", "halt_eps")


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
    generation_config = generation_config or {}
    knobs = {}
    for name in SERVER_KNOBS:
        value = getattr(hf_config, name, None)
        knobs[name] = generation_config.get(name) if value is None else value
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
            f"'{{\"cache_sharing\": \"none\"}}' (exact: one cache per loop step and block)."
        )
    return hf_config.resolve_trajectory(knobs["loop_budget"], knobs["step_schedule"])


class LoopFormerServerConfig:
    """vLLM's per-architecture config hook (the `VerifyAndUpdateConfig` protocol of
    vllm.model_executor.models.config): vLLM calls it where the `ModelConfig` is built, in the user's own process
    (the API server, `LLM(...)`), so a bad `--hf-overrides` value is refused there with its message, not only in
    the engine core's log behind "Engine core initialization failed"."""

    @staticmethod
    def verify_and_update_config(vllm_config):
        return None

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
