"""The oracle for checkpoints in the authors' layout: random weights under their reference code's names, and an
independent, minimal re-implementation of their forward written from the spec (learned positions, GELU, torch-default
RMSNorm eps, adaLN without shift, separate sinusoidal t/Δ embedders), never the package's own modules. One forward per
reference file: models/loopformer.py (t, Δ), models/tmlt.py (integer loop index), models/base_loop.py (no
conditioning, block RMSNorms with a weight) and models/base.py (the same blocks in a plain list, one pass). Biases
(their `bias=True`) are drawn and applied when `bias=True`.
"""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

N_LAYER, N_LOOPS, N_EMBD, N_HEAD, VOCAB, BLOCK = 2, 4, 64, 4, 97, 64
# the architecture each published model type holds (the early-exit variants are trained differently only)
ARCHITECTURE = {"loopformer": "loopformer", "tmlt": "tmlt", "base_loop": "base_loop", "base_loop_ee": "base_loop"}


# ---- a random checkpoint in the reference layout ---------------------------------------------------------------------


def reference_state_dict(
    seed=0,
    d=N_EMBD,
    n_layer=N_LAYER,
    vocab=VOCAB,
    block=BLOCK,
    mlp=None,
    freq=256,
    model_type="loopformer",
    bias=False,
):
    g = torch.Generator().manual_seed(seed)
    mlp = 4 * d if mlp is None else mlp
    embedders = {"loopformer": ("time_embedder", "dt_embedder"), "tmlt": ("time_embedder",)}.get(model_type, ())

    def lin(out_f, in_f, gain=1.0):
        return torch.randn(out_f, in_f, generator=g) * gain / math.sqrt(in_f)

    def vec(n, std):
        return torch.randn(n, generator=g) * std

    sd = {
        "transformer.wte.weight": torch.randn(vocab, d, generator=g),
        "transformer.wpe.weight": torch.randn(block, d, generator=g) * 0.5,
    }
    for j in range(n_layer):
        p = f"transformer.h.{j}." if model_type == "base" else f"transformer.h.blocks.{j}."
        sd[p + "attn.c_attn.weight"] = lin(3 * d, d)
        sd[p + "attn.c_proj.weight"] = lin(d, d)
        sd[p + "mlp.c_fc.weight"] = lin(mlp, d)
        sd[p + "mlp.c_proj.weight"] = lin(d, mlp)
        if bias:
            for name, width in (("attn.c_attn", 3 * d), ("attn.c_proj", d), ("mlp.c_fc", mlp), ("mlp.c_proj", d)):
                sd[f"{p}{name}.bias"] = vec(width, 0.1)
        if embedders:
            # random (not zero-init) modulation, so that gates, scales and the trajectory all change the logits
            sd[p + "adaLN_modulation.1.weight"] = lin(4 * d, d, gain=0.5)
            sd[p + "adaLN_modulation.1.bias"] = vec(4 * d, 0.3)
        else:  # Base-Loop / Base: plain pre-norm blocks whose RMSNorms have a (here non-trivial) weight
            sd[p + "norm_1.weight"] = 1 + vec(d, 0.3)
            sd[p + "norm_2.weight"] = 1 + vec(d, 0.3)
    sd["transformer.norm_f.weight"] = 1 + vec(d, 0.1)
    for name in embedders:
        sd[f"{name}.mlp.0.weight"] = lin(d, freq)
        sd[f"{name}.mlp.0.bias"] = vec(d, 0.1)
        sd[f"{name}.mlp.2.weight"] = lin(d, d)
        sd[f"{name}.mlp.2.bias"] = vec(d, 0.1)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied, as in the reference (same storage)
    return sd


# ---- an independent minimal reference forward (from the spec) --------------------------------------------------------


def _sinusoid(t, dim=256, max_period=10000.0):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = torch.tensor([float(t)])[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # order [cos, sin]


def _embedder(sd, name, t):
    h = F.linear(_sinusoid(t), sd[f"{name}.mlp.0.weight"], sd[f"{name}.mlp.0.bias"])
    return F.linear(F.silu(h), sd[f"{name}.mlp.2.weight"], sd[f"{name}.mlp.2.bias"])


def _reference_block(sd, p, x, c, n_head):
    """One block. With c (LoopFormer, TMLT): x = x + g_a·Attn(RMSNorm(x)(1+s_a)); x = x + g_m·MLP(RMSNorm(x)(1+s_m)),
    weightless norms. Without (Base-Loop, Base): x = x + Attn(RMSNorm_1(x)); x = x + MLP(RMSNorm_2(x)), with weights."""
    B, T, d = x.shape
    hs = d // n_head
    if c is not None:
        mod = F.linear(F.silu(c), sd[p + "adaLN_modulation.1.weight"], sd[p + "adaLN_modulation.1.bias"])
        gate_attn, gate_mlp, scale_attn, scale_mlp = mod[:, None, :].chunk(4, dim=-1)
        h = F.rms_norm(x, (d,)) * (1 + scale_attn)  # eps=None: torch default
    else:
        gate_attn = gate_mlp = 1.0
        h = F.rms_norm(x, (d,), sd[p + "norm_1.weight"])
    q, k, v = F.linear(h, sd[p + "attn.c_attn.weight"], sd.get(p + "attn.c_attn.bias")).split(d, dim=2)
    q, k, v = (z.view(B, T, n_head, hs).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, d)
    x = x + gate_attn * F.linear(y, sd[p + "attn.c_proj.weight"], sd.get(p + "attn.c_proj.bias"))
    h = F.rms_norm(x, (d,)) * (1 + scale_mlp) if c is not None else F.rms_norm(x, (d,), sd[p + "norm_2.weight"])
    return x + gate_mlp * F.linear(
        F.gelu(F.linear(h, sd[p + "mlp.c_fc.weight"], sd.get(p + "mlp.c_fc.bias"))),
        sd[p + "mlp.c_proj.weight"],
        sd.get(p + "mlp.c_proj.bias"),
    )


def reference_forward(sd, idx, trajectory, n_head=N_HEAD, model_type="loopformer"):
    """Logits of the reference model. `trajectory`: the step sizes Δ (LoopFormer; the other types use its length
    as their integer loop count); ignored by Base, which makes one pass over its list of blocks."""
    T = idx.shape[1]
    d = sd["transformer.wte.weight"].shape[1]
    prefix = "transformer.h." if model_type == "base" else "transformer.h.blocks."
    n_layer = len({k[len(prefix) :].split(".")[0] for k in sd if k.startswith(prefix)})
    blocks = [f"{prefix}{j}." for j in range(n_layer)]
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T][None]
    if model_type == "base":
        trajectory = [None]
    t = 0.0
    for i, dt in enumerate(trajectory):
        if model_type == "loopformer":
            c = _embedder(sd, "time_embedder", t) + _embedder(sd, "dt_embedder", dt)  # (1, d)
        elif model_type == "tmlt":
            c = _embedder(sd, "time_embedder", i)  # the raw integer loop index 0..M-1
        else:
            c = None
        for p in blocks:
            x = _reference_block(sd, p, x, c, n_head)
        t += dt or 0.0
    x = F.rms_norm(x, (d,), sd["transformer.norm_f.weight"])
    return F.linear(x, sd["lm_head.weight"])


# ---- a repo in the authors' Hub layout ------------------------------------------------------------------------------


# what the published config.json (296 bytes) holds besides the sizes it leaves to its configuration class
PUBLISHED_KEYS = ("architectures", "auto_map", "dtype", "model_type", "transformers_version")
# a configuration class as their repos' custom code would define it; its module raises when imported, so a load that
# passes proves the source was parsed, never executed
CODE_TEMPLATE = """raise RuntimeError("the repo's own code was executed")
from transformers import PretrainedConfig


class LoopFormerGPTBaseConfig(PretrainedConfig):
    model_type = {model_type!r}
    bias: bool = False


class LoopFormerGPTConfig(LoopFormerGPTBaseConfig):
    def __init__(self, {defaults}, **kwargs):
        super().__init__(**kwargs)
"""


def write_authors_repo(
    folder,
    model_type="loopformer",
    prefix="gpt.",
    dtype=torch.float32,
    aliases=False,
    bias=False,
    steps=None,
    tokenizer=None,
    seed=0,
    extra=None,
    drop=(),
    d=N_EMBD,
    n_head=N_HEAD,
    n_layer=N_LAYER,
    block=BLOCK,
    loops=N_LOOPS,
    stated=None,
    code=None,
    vocab=None,
):
    """A repo in the authors' Hub layout, as their GitHub `GPT.from_pretrained` reads it: config.json with their model
    type and nanoGPT keys (or the GPT-2 aliases their loader also accepts) and `steps`, weights named as their `GPT`'s
    state dict under a wrapper `prefix`, the tied head stored once as `transformer.wte.weight`, their
    generation_config.json and, if given, a tokenizer. Returns the oracle's state dict (tensors at `dtype`).

    As published: `stated` keeps only those config.json keys besides `PUBLISHED_KEYS` (() keeps none: the 296-byte
    config), and `code` ({name: default source text}) writes configuration_loopformer.py with their configuration
    class `LoopFormerGPTConfig` carrying those defaults, named by `auto_map`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = vocab or (len(tokenizer) if tokenizer is not None else VOCAB)
    sd = reference_state_dict(
        seed=seed, model_type=ARCHITECTURE[model_type], vocab=vocab, bias=bias, d=d, n_layer=n_layer, block=block
    )
    sd = {k: v.to(dtype) for k, v in sd.items()}
    stored = {prefix + k: v.clone() for k, v in sd.items() if k != "lm_head.weight" and k not in drop}
    stored.update(extra or {})
    save_file(stored, str(folder / "model.safetensors"))
    if steps is None:
        steps = [1 / loops] * loops if model_type == "loopformer" else loops
    keys = (
        dict(
            hidden_size=d,
            num_hidden_layers=n_layer,
            num_attention_heads=n_head,
            n_positions=block,
            n_inner=4 * d,
            resid_pdrop=0.0,
        )
        if aliases
        else dict(n_embd=d, n_layer=n_layer, n_head=n_head, block_size=block, intermediate_dim=4 * d, dropout=0.0)
    )
    config = dict(
        model_type=model_type,
        vocab_size=vocab,
        bias=bias,
        steps=steps,
        **keys,
        architectures=["LoopFormerGPTForCausalLM"],  # theirs: the translation names our class
        auto_map={
            "AutoConfig": "configuration_loopformer.LoopFormerGPTConfig",
            "AutoModelForCausalLM": "modeling_loopformer.LoopFormerGPTForCausalLM",
        },
        torch_dtype=str(dtype).replace("torch.", ""),
        transformers_version="4.57.0",
    )
    if stated is not None:  # as published: transformers 4.57 writes `dtype`, and no size the class defaults give
        config["dtype"] = config.pop("torch_dtype")
        config = {key: config[key] for key in config if key in PUBLISHED_KEYS or key in stated}
    if code is not None:
        defaults = ", ".join(f"{name}={value}" for name, value in code.items())
        (folder / "configuration_loopformer.py").write_text(
            CODE_TEMPLATE.format(model_type=model_type, defaults=defaults)
        )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(
        json.dumps({"_from_model_config": True, "transformers_version": "4.57.0"})
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd
