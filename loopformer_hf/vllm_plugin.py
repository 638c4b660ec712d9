"""vLLM plugin: `pip install "looped-transformers-hf[vllm]"` installs the entry point `vllm.general_plugins` ->
`register`, which vLLM calls in every process it starts (the API server, the engine core, its workers) before it
reads a model's config. After it, `vllm serve CKPT` and `LLM(model=CKPT)` run a checkpoint this package saved.

Nothing here imports vLLM's model code: the model class is registered by its import path, so vLLM imports
`loopformer_hf.vllm_model` only when a LoopFormer checkpoint is loaded.
"""

# The `architectures` that this package's `save_pretrained` writes into config.json, and vLLM's model for each.
VLLM_ARCHITECTURES = {"LoopFormerForCausalLM": "loopformer_hf.vllm_model:LoopFormerForCausalLM"}


def register():
    """Register LoopFormer with vLLM (idempotent: vLLM may call it more than once per process)."""
    from vllm import ModelRegistry

    # `import loopformer_hf` registers LoopFormerConfig (model_type "loopformer") with AutoConfig, so vLLM reads a
    # checkpoint's config.json without `trust_remote_code`.
    import loopformer_hf  # noqa: F401

    supported = set(ModelRegistry.get_supported_archs())
    for architecture, model_path in VLLM_ARCHITECTURES.items():
        if architecture not in supported:
            ModelRegistry.register_model(architecture, model_path)
