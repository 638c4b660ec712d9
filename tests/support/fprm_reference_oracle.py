"""The authors' FPRM (GitHub nilskiKonjIzDunava/fprm), re-implemented as an oracle: an independent, minimal
re-implementation of their forward and solver, written from ../shared/spec/fprm.md ("The authors' computation, step by
step") and their code (models/transformer.py, models/layers.py, models/fixed_point_reasoning/{fprm,model_utils}.py).
It imports nothing from `fprm_hf` and works on a state dict in THEIR key layout, as their pretrain script saves it
(loss-head wrapper prefix `model.inner.`, all-ones `mask` buffers, a Q-head). Used by tests/fprm/test_fprm_reference.py
(the forward), tests/training/test_fprm_training_oracle.py (training) and tests/test_wheel.py."""

import math

import torch
import torch.nn.functional as F

HIDDEN, HEADS, SEQ_LEN, BATCH, VOCAB = 32, 4, 16, 3, 9


# ---- their arch settings (their field names) ------------------------------------------------------------------------

BASE = dict(
    vocab_size=VOCAB, seq_len=SEQ_LEN, num_puzzle_identifiers=3, batch_size=8, H_cycles=3, L_cycles=4, H_layers=0,
    L_layers=2, n_backwards_L=4, hidden_size=HIDDEN, num_heads=HEADS, expansion=2, pos_encodings="rope",
    puzzle_emb_ndim=0, puzzle_emb_len=0, causal=False, norm_type="pre-norm", norm_placement="none",
    conv_type="conv1d", conv_kernel_size=4, conv_bias=False, residual_scale="input-independent",
    alpha_1_init=0.5, alpha_2_init=0.5, outer_only=False, normalize_input_injection=False, softmax_temp=1.0,
    fp_thresh=1e-6, stepsize=1.0, stepsize_decay_train=0.7, stepsize_decay_eval=0.5, decay_patience=2,
    eps=1e-8, init_std=6.0, fixed_init=False, max_iter=16, max_iter_eval=40, max_iter_dist="det",
    forward_dtype="bfloat16", mlp_t=False, weight_dropout=0.0, variational_dropout=0.0,
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
        self.w = {k[len("model.inner."):]: v for k, v in sd.items()}
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
        out = F.scaled_dot_product_attention(q, k, v, is_causal=s["causal"],
                                             scale=1.0 / (math.sqrt(hd) * s["softmax_temp"]))
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
                grid = F.conv1d(grid.transpose(1, 2), w["L_level.conv.weight"], w.get("L_level.conv.bias"),
                                padding=k - 1, groups=d).transpose(1, 2)[:, : total - p]
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
                b2 = 1 - a2 * a1 ** self.n
                b1 = b2 * (1 - a1) / (1 - a1 ** self.n + 1e-5)
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
        return dict(y=z0.clone(), residues=torch.full((B,), math.inf), stepsize=torch.full((B, 1, 1), 1.0),
                    patience=torch.full((B,), float(self.s["decay_patience"])), best=torch.full((B,), math.inf))

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
