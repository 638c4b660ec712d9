"""The authors' FPRM (GitHub nilskiKonjIzDunava/fprm), re-implemented as an oracle: an independent, minimal
re-implementation of their forward and solver, written from ../shared/spec/fprm.md ("The authors' computation, step by
step") and their code (models/transformer.py, models/layers.py, models/fixed_point_reasoning/{fprm,model_utils}.py).
It imports nothing from `fprm_hf` and works on a state dict in THEIR key layout, as their pretrain script saves it
(loss-head wrapper prefix `model.inner.`, all-ones `mask` buffers, a Q-head). Used by tests/fprm/test_convert_authors_fprm.py
(the forward), tests/training/fprm/test_fprm_training_oracle.py (training) and tests/test_wheel.py."""

import math

import torch
import torch.nn.functional as F

HIDDEN, HEADS, SEQ_LEN, BATCH, VOCAB = 32, 4, 16, 3, 9


# ---- their arch settings (their field names) ------------------------------------------------------------------------

BASE = dict(
    vocab_size=VOCAB,
    seq_len=SEQ_LEN,
    num_puzzle_identifiers=3,
    batch_size=8,
    H_cycles=3,
    L_cycles=4,
    H_layers=0,
    L_layers=2,
    n_backwards_L=4,
    hidden_size=HIDDEN,
    num_heads=HEADS,
    expansion=2,
    pos_encodings="rope",
    puzzle_emb_ndim=0,
    puzzle_emb_len=0,
    causal=False,
    norm_type="pre-norm",
    norm_placement="none",
    conv_type="conv1d",
    conv_kernel_size=4,
    conv_bias=False,
    residual_scale="input-independent",
    alpha_1_init=0.5,
    alpha_2_init=0.5,
    outer_only=False,
    normalize_input_injection=False,
    softmax_temp=1.0,
    fp_thresh=1e-6,
    stepsize=1.0,
    stepsize_decay_train=0.7,
    stepsize_decay_eval=0.5,
    decay_patience=2,
    eps=1e-8,
    init_std=6.0,
    fixed_init=False,
    max_iter=16,
    max_iter_eval=40,
    max_iter_dist="det",
    forward_dtype="bfloat16",
    mlp_t=False,
    weight_dropout=0.0,
    variational_dropout=0.0,
)


# ---- their checkpoint with random non-trivial weights ---------------------------------------------------------------


def _find_multiple(a, b):
    return -(a // -b) * b


def reference_state_dict(s, seed=0):
    """Random weights with the keys and shapes of their model, as `state_dict()` of the loss-head wrapper."""
    g = torch.Generator().manual_seed(seed)
    d, vocab, L = s["hidden_size"], s["vocab_size"], s["seq_len"]
    inter = _find_multiple(round(s["expansion"] * d * 2 / 3), 256)
    prefix = -(s["puzzle_emb_ndim"] // -d) if s["puzzle_emb_len"] == 0 else s["puzzle_emb_len"]
    rnd = lambda *shape, std=1.0: torch.randn(*shape, generator=g) * std  # noqa: E731
    sd = {}

    def linear(name, fan_in, fan_out, bias=False):
        sd[f"{name}.weight"] = rnd(fan_out, fan_in, std=fan_in**-0.5)
        if bias:
            sd[f"{name}.bias"] = rnd(fan_out, std=0.1)
        sd[f"{name}.mask"] = torch.ones(fan_out, fan_in)  # CastedLinear's DropConnect mask

    sd["embed_tokens.embedding_weight"] = rnd(vocab, d, std=d**-0.5)
    linear("lm_head", d, vocab)
    linear("q_head", d, 2, bias=True)
    if s["puzzle_emb_ndim"] > 0:
        sd["puzzle_emb.weights"] = rnd(s["num_puzzle_identifiers"], s["puzzle_emb_ndim"], std=d**-0.5)
    if s["pos_encodings"] == "learned":
        sd["embed_pos.embedding_weight"] = rnd(L + prefix, d, std=d**-0.5)
    for i in range(s["L_layers"]):
        linear(f"L_level.layers.{i}.self_attn.qkv_proj", d, 3 * d)
        linear(f"L_level.layers.{i}.self_attn.o_proj", d, d)
        linear(f"L_level.layers.{i}.mlp.gate_up_proj", d, 2 * inter)
        linear(f"L_level.layers.{i}.mlp.down_proj", inter, d)
    k = s["conv_kernel_size"]
    if s["conv_type"] == "conv1d":
        sd["L_level.conv.weight"] = rnd(d, 1, k, std=0.4)
    elif s["conv_type"] == "conv2d":
        sd["L_level.conv.weight"] = rnd(d, 1, k, k, std=0.3)
    if s["conv_type"] != "none" and s["conv_bias"]:
        sd["L_level.conv.bias"] = rnd(d, std=0.1)
    alphas = ["2"] if s["outer_only"] else ["1", "2"]
    for a in alphas:
        if s["residual_scale"] == "fixed":
            sd[f"L_level.alpha_{a}_param"] = torch.tensor(s[f"alpha_{a}_init"])
        elif s["residual_scale"] == "input-independent":  # logits, per channel, away from their init
            sd[f"L_level.alpha_{a}_param"] = rnd(d, std=1.0)
        elif s["residual_scale"] == "input-dependent":
            sd[f"L_level.alpha_{a}_layer.weight"] = rnd(d, d, std=0.3 * d**-0.5)
            sd[f"L_level.alpha_{a}_layer.bias"] = rnd(d, std=0.5)
            sd[f"L_level.alpha_{a}_layer.mask"] = torch.ones(d, d)
    if s["fixed_init"]:
        sd["L_optimizer.init_vec"] = rnd(d, std=s["init_std"])
    return {f"model.inner.{key}": value for key, value in sd.items()}


# ---- the reference: their forward and solver, written from the spec --------------------------------------------------


def ref_rms_norm(x, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_linear(w, name, x):
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


class Reference:
    """Their FixedPointReasoningModel_Inner + FixedPointTransformer + FixedPointOptimizer, on a state dict."""

    def __init__(self, sd, s):
        self.w = {k[len("model.inner.") :]: v for k, v in sd.items()}
        self.s = s
        d = s["hidden_size"]
        self.prefix = -(s["puzzle_emb_ndim"] // -d) if s["puzzle_emb_len"] == 0 else s["puzzle_emb_len"]
        self.n = 2 * s["L_layers"]

    def input_embeddings(self, inputs, puzzle_identifiers):
        w, s, d = self.w, self.s, self.s["hidden_size"]
        emb = w["embed_tokens.embedding_weight"][inputs]
        if s["puzzle_emb_ndim"] > 0:
            pe = w["puzzle_emb.weights"][puzzle_identifiers]
            pe = F.pad(pe, (0, self.prefix * d - pe.shape[-1]))
            emb = torch.cat((pe.view(-1, self.prefix, d), emb), dim=-2)
        if s["pos_encodings"] == "learned":
            emb = 0.707106781 * (emb + w["embed_pos.embedding_weight"])
        return math.sqrt(d) * emb

    def cos_sin(self, length):
        if self.s["pos_encodings"] != "rope":
            return None
        hd = self.s["hidden_size"] // self.s["num_heads"]
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        freqs = torch.outer(torch.arange(self.s["seq_len"] + self.prefix, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:length], emb.sin()[:length]

    def attention(self, i, h, cos_sin):
        s = self.s
        B, L, d = h.shape
        H, hd = s["num_heads"], d // s["num_heads"]
        qkv = ref_linear(self.w, f"L_level.layers.{i}.self_attn.qkv_proj", h).reshape(B, L, 3 * H, hd)
        q, k, v = qkv[:, :, :H], qkv[:, :, H : 2 * H], qkv[:, :, 2 * H :]
        if cos_sin is not None:
            cos, sin = (t.unsqueeze(-2) for t in cos_sin)
            half = lambda t: torch.cat((-t[..., hd // 2 :], t[..., : hd // 2]), dim=-1)  # noqa: E731
            q, k = q * cos + half(q) * sin, k * cos + half(k) * sin
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=s["causal"], scale=1.0 / (math.sqrt(hd) * s["softmax_temp"])
        )
        return ref_linear(self.w, f"L_level.layers.{i}.self_attn.o_proj", out.transpose(1, 2).reshape(B, L, d))

    def swiglu(self, i, h):
        gate, up = ref_linear(self.w, f"L_level.layers.{i}.mlp.gate_up_proj", h).chunk(2, dim=-1)
        return ref_linear(self.w, f"L_level.layers.{i}.mlp.down_proj", F.silu(gate) * up)

    def L_level(self, y, x, cos_sin):
        w, s, eps = self.w, self.s, 1e-5
        if s["normalize_input_injection"]:
            x = ref_rms_norm(x, eps)
        B, total, d = y.shape
        p = self.prefix
        if s["conv_type"] != "none":
            grid = y[:, p:]
            k = s["conv_kernel_size"]
            if s["conv_type"] == "conv1d":
                grid = F.conv1d(
                    grid.transpose(1, 2), w["L_level.conv.weight"], w.get("L_level.conv.bias"), padding=k - 1, groups=d
                ).transpose(1, 2)[:, : total - p]
            else:
                hw = int(math.sqrt(total - p))
                g = grid.reshape(B, hw, hw, d).permute(0, 3, 1, 2)
                g = F.conv2d(g, w["L_level.conv.weight"], w.get("L_level.conv.bias"), padding=k // 2, groups=d)
                grid = g.permute(0, 2, 3, 1).reshape(B, total - p, d)
            y = torch.cat([y[:, :p], grid], dim=1)
        mode = s["residual_scale"]
        if mode is None:
            a1 = a2 = b1 = b2 = 1.0
        else:
            if mode == "fixed":
                get = lambda a: w[f"L_level.alpha_{a}_param"]  # noqa: E731
            elif mode == "input-independent":
                get = lambda a: torch.sigmoid(w[f"L_level.alpha_{a}_param"]).reshape(1, 1, -1)  # noqa: E731
            else:
                get = lambda a: torch.sigmoid(ref_linear(w, f"L_level.alpha_{a}_layer", y))  # noqa: E731
            a2 = get("2")
            if s["outer_only"]:
                a1, b1, b2 = 1.0, 1.0, 1 - a2
            else:
                a1 = get("1")
                b2 = 1 - a2 * a1**self.n
                b1 = b2 * (1 - a1) / (1 - a1**self.n + 1e-5)
        if s["norm_placement"] == "input":
            y = ref_rms_norm(y, eps)
        h = a2 * y + b2 * x
        norm = s["norm_type"]
        for i in range(s["L_layers"]):
            for sub in ("attn", "mlp"):
                inp = ref_rms_norm(h, eps) if norm in ("pre-norm", "peri-norm") else h
                out = self.attention(i, inp, cos_sin) if sub == "attn" else self.swiglu(i, inp)
                if norm == "peri-norm":
                    out = ref_rms_norm(out, eps)
                h = a1 * h + b1 * out
                if norm == "post-norm":
                    h = ref_rms_norm(h, eps)
        if s["norm_placement"] == "output":
            h = ref_rms_norm(h, eps)
        return h

    def reset(self, z0):
        B = z0.shape[0]
        return dict(
            y=z0.clone(),
            residues=torch.full((B,), math.inf),
            stepsize=torch.full((B, 1, 1), 1.0),
            patience=torch.full((B,), float(self.s["decay_patience"])),
            best=torch.full((B,), math.inf),
        )

    def step(self, state, z, training):
        s = self.s
        r = ((state["y"] - z).norm(p=math.inf, dim=-1) / (z.norm(p=math.inf, dim=-1) + 1e-8)).max(dim=1)[0]
        state["y"] = z * state["stepsize"] + state["y"] * (1 - state["stepsize"])
        improved = r < state["best"]
        state["residues"] = r
        state["best"] = torch.where(improved, r, state["best"])
        state["patience"] = torch.where(improved, float(s["decay_patience"]), state["patience"] - 1)
        adapt = (state["patience"] <= 0) & (r >= s["fp_thresh"])
        state["patience"] = torch.where(adapt, float(s["decay_patience"]), state["patience"])
        decay = s["stepsize_decay_train"] if training else s["stepsize_decay_eval"]
        state["stepsize"] = state["stepsize"] * torch.where(adapt, decay, 1.0).reshape(-1, 1, 1)
        return state

    def logits(self, y):
        return ref_linear(self.w, "lm_head", y)[:, self.prefix :]


# ---- their authors' checkpoints (Hub fixed-point-reasoners/fprm), stood in for at the real sizes --------------------
# Written from their files, not from fprm_hf: config/arch/fprm.yaml as their Hydra run resolves it (`${.field}`
# filled), each task file's `arch:` section over it, the data paths of config/cfg_pretrain_{sudoku,maze}.yaml, and the
# sizes their dataset builders write (pretrain.py adds seq_len, vocab_size, num_puzzle_identifiers and batch_size to
# the model's settings from the data; they are not in all_config.yaml).

FPRM_YAML = dict(
    name="fixed_point_reasoning.fprm@FixedPointReasoningModel_ACTV1",
    loss=dict(
        name="losses@ACTLossHead",
        loss_type="stablemax_cross_entropy",
        q_loss_coeff=0.5,
        deep_supervision=True,
        jacobian_reg_lambda=0.0,
    ),
    H_cycles=3,
    L_cycles=6,
    H_layers=0,
    L_layers=2,
    max_iter=1000,
    max_iter_eval=None,
    n_backwards_L=6,
    hidden_size=512,
    num_heads=8,
    expansion=4,
    puzzle_emb_ndim=512,
    pos_encodings="rope",
    forward_dtype="bfloat16",
    mlp_t=False,
    puzzle_emb_len=16,
    no_ACT_continue=True,
    fp_thresh=0.1,
    outlier_quantile=0.25,
    stepsize=1.0,
    stepsize_decay_train=0.9,
    stepsize_decay_eval=0.99,
    decay_patience=5,
    eps=1.0e-8,
    init_std=1.0,
    additive_noise_std=0.0,
    fixed_init=False,
    max_iter_dist="expon",
    gamma_alpha=4.0,
    gamma_scale=16.6666666667,
    expon_scale=72.1347520444,
    conv_type="conv1d",
    conv_kernel_size=4,
    conv_bias=False,
    residual_scale="input-independent",
    alpha_1_init=0.5,
    alpha_2_init=0.5,
    outer_only=False,
    norm_placement="none",
    norm_type="pre-norm",
    normalize_input_injection=False,
    softmax_temp=1.0,
    n_decode_steps=0,
    weight_dropout=0.0,
    variational_dropout=0.0,
    jacobian_reg="fda",
    n_jacobian_samples=0,
    jacobian_eps=1.0e-3,
)
TASK_ARCH = {
    "sudoku": dict(
        H_cycles=3,
        L_cycles=6,
        H_layers=0,
        L_layers=2,
        n_backwards_L=6,
        hidden_size=512,
        num_heads=8,
        expansion=4,
        puzzle_emb_len=16,
        pos_encodings="rope",
        max_iter=12,
        max_iter_dist="det",
        max_iter_eval=1000,
        alpha_1_init=0.75,
        alpha_2_init=0.25,
        residual_scale="input-independent",
        outer_only=False,
        norm_type="pre-norm",
        norm_placement="none",
        conv_type="conv2d",
        conv_kernel_size=3,
        conv_bias=False,
        fp_thresh=0.1,
        stepsize=1.0,
        stepsize_decay_train=0.9,
        stepsize_decay_eval=0.99,
        decay_patience=5,
        init_std=6.0,
        softmax_temp=1.0,
        mlp_t=False,
        no_ACT_continue=True,
        normalize_input_injection=False,
        variational_dropout=0.0,
        weight_dropout=0.0,
    ),
    "maze": dict(
        H_cycles=3,
        H_layers=0,
        L_cycles=6,
        L_layers=2,
        n_backwards_L=6,
        hidden_size=512,
        num_heads=8,
        expansion=4,
        puzzle_emb_len=16,
        puzzle_emb_ndim=512,
        pos_encodings="rope",
        forward_dtype="bfloat16",
        max_iter=24,
        max_iter_dist="det",
        max_iter_eval=1000,
        alpha_1_init=0.75,
        alpha_2_init=0.25,
        residual_scale="input-independent",
        outer_only=False,
        norm_type="pre-norm",
        norm_placement="output",
        conv_type="conv1d",
        conv_kernel_size=4,
        conv_bias=False,
        fp_thresh=0.1,
        outlier_quantile=0.25,
        stepsize=1.0,
        stepsize_decay_train=0.9,
        stepsize_decay_eval=0.99,
        decay_patience=5,
        eps=1.0e-8,
        init_std=6.0,
        additive_noise_std=0.0,
        n_decode_steps=0,
        softmax_temp=1.0,
        mlp_t=False,
        no_ACT_continue=True,
        normalize_input_injection=False,
    ),
}
TASK_DATA = {  # data_paths of the task file, and what the builder writes: (seq_len, vocab_size, grid side)
    "sudoku": (["data/sudoku-extreme-1k-aug-1000"], 81, 11, 9),
    "maze": (["data/maze-30x30-hard-1k-noaug"], 900, 6, 30),
}
PUBLISHED_STEPS = (6510, 78120)  # two of their twelve steps (every 6,510 to 78,120)


def published_settings(task, **arch):
    """Their model settings of an authors' task folder (their field names), as their pretrain.py builds them;
    `arch` overrides fields of its arch (smaller stand-ins)."""
    paths, seq_len, vocab, _ = TASK_DATA[task]
    return {
        **FPRM_YAML,
        **TASK_ARCH[task],
        **arch,
        "seq_len": seq_len,
        "vocab_size": vocab,
        "num_puzzle_identifiers": 1,
        "batch_size": 768,
        "causal": False,
    }


def write_published_folder(folder, task, steps=PUBLISHED_STEPS, with_yaml=True, model_source=None, **arch):
    """A task folder as published: `step_N` files (torch.save of the compiled wrapper's state dict, `_orig_mod.`
    keys, fp32, no extension), `all_config.yaml` (their pretrain config dump) when `with_yaml`, and `model_source`
    written as the copied model file; `arch` overrides arch fields (a smaller stand-in). Returns {step: their state
    dict without `_orig_mod.`}."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    s = published_settings(task, **arch)
    written = {}
    for i, step in enumerate(steps):
        sd = reference_state_dict(s, seed=step)
        sd = {k: v.contiguous() for k, v in sd.items()}
        torch.save({f"_orig_mod.{k}": v for k, v in sd.items()}, folder / f"step_{step}")
        written[step] = sd
    if with_yaml:
        dump = dict(
            arch={**FPRM_YAML, **TASK_ARCH[task], **arch, "loss": {**FPRM_YAML["loss"]}},
            data_paths=TASK_DATA[task][0],
            data_paths_test=[],
            evaluators=[],
            global_batch_size=768,
            epochs=60000,
            lr=1e-3,
            lr_min_ratio=1.0,
            lr_warmup_steps=2000,
            weight_decay=0.001,
            beta1=0.9,
            beta2=0.95,
            optimizer="adamw",
            puzzle_emb_lr=1e-3,
            puzzle_emb_weight_decay=0.001,
            project_name=f"fprm-{task}",
            run_name="run",
            seed=0,
            checkpoint_path=f"checkpoints/fprm-{task}",
            checkpoint_every_eval=True,
            eval_interval=5000,
            min_eval_interval=0,
            ema=True,
            ema_rate=0.999,
            freeze_weights=False,
            profile_flops=False,
        )
        (folder / "all_config.yaml").write_text(yaml.dump(dump))
    if model_source is not None:
        (folder / "fp_trm_singlez.py").write_text(model_source)
    return written
