"""FPRM computes what the authors' FPRM computes (GitHub nilskiKonjIzDunava/fprm).

The reference below is an independent, minimal re-implementation of their forward and solver, written from
../shared/spec/fprm.md ("The authors' computation, step by step") and their code (models/transformer.py,
models/layers.py, models/fixed_point_reasoning/{fprm,model_utils}.py). It imports nothing from `fprm_hf`'s modelling
code and works on a state dict in THEIR key layout, as their pretrain script saves it (loss-head wrapper prefix
`model.inner.`, all-ones `mask` buffers, a Q-head). The same weights go through `fprm_hf.convert_reference`; the
states after 1 and 20 solver iterations, the residual / step-size / patience traces and the logits must agree
within 1e-4 (fp32) in every case.
"""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fprm_hf import FPRMForReasoning
from fprm_hf.convert_reference import convert, main as convert_main

TOL = dict(rtol=1e-4, atol=1e-4)
HIDDEN, HEADS, SEQ_LEN, BATCH, VOCAB = 32, 4, 16, 3, 9


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- their arch settings for each case (their field names) ---------------------------------------------------------

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
PREFIX = dict(puzzle_emb_ndim=2 * HIDDEN - 5, puzzle_emb_len=3)  # 3 rows, the last one partly zero padding
CASES = {
    "conv1d-rope-prefix-pre-input_independent": dict(**PREFIX),
    "conv2d-rope-prefix-pre-input_independent": dict(conv_type="conv2d", conv_kernel_size=3, alpha_1_init=0.75,
                                                     alpha_2_init=0.25, **PREFIX),
    "conv1d-learned-post-none": dict(pos_encodings="learned", norm_type="post-norm", residual_scale=None),
    "conv1d-none-causal-pre-fixed": dict(pos_encodings="none", causal=True, residual_scale="fixed",
                                         alpha_1_init=0.6, alpha_2_init=0.3),
    "conv2d-none-pre-input_dependent": dict(conv_type="conv2d", conv_kernel_size=3, pos_encodings="none",
                                            residual_scale="input-dependent"),
    "conv1d-rope-prefix-pre-outer_only": dict(outer_only=True, **PREFIX),
    "conv1d-learned-prefix-post-input_independent": dict(pos_encodings="learned", norm_type="post-norm", **PREFIX),
    "conv1d-rope-peri-output-normalized-injection": dict(norm_type="peri-norm", norm_placement="output",
                                                         normalize_input_injection=True, conv_bias=True),
    "conv2d-learned-prefix-pre-input-norm-fixed_init": dict(conv_type="conv2d", conv_kernel_size=3,
                                                            pos_encodings="learned", norm_placement="input",
                                                            fixed_init=True, **PREFIX),
    "none-conv-rope-pre-input_independent-temp": dict(conv_type="none", softmax_temp=1.7),
}
# with these seeds the residual improves at every one of the 20 iterations, so η never decays
MONOTONE = {"conv1d-none-causal-pre-fixed", "none-conv-rope-pre-input_independent-temp"}


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


# ---- the comparison -------------------------------------------------------------------------------------------------


def _inputs(s, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, s["vocab_size"], (BATCH, s["seq_len"]), generator=g)
    puzzles = torch.randint(0, s["num_puzzle_identifiers"], (BATCH,), generator=g)
    return ids, puzzles


def _compare(model, sd, s, training=False, iterations=20):
    """Run both for `iterations` solver steps from the same z0 and compare after 1 and after every step."""
    ref = Reference(sd, s)
    ids, puzzles = _inputs(s)
    model.train(training)
    ref_x = ref.input_embeddings(ids, puzzles)
    core = model.model
    with torch.no_grad():
        x = core.embed(ids, puzzles)
        torch.testing.assert_close(x, ref_x, **TOL)
        state = core.initial_solver_state(x, generator=torch.Generator().manual_seed(11))
        if s["fixed_init"]:  # their init_vec on every sample and token
            z0 = ref.w["L_optimizer.init_vec"].expand_as(ref_x).clone()
            torch.testing.assert_close(state.hidden, z0)
        else:  # a fresh draw per sample and token, handed to the reference as it is
            z0 = state.hidden.clone()
        ref_state = ref.reset(z0)
        cos_sin = ref.cos_sin(ref_x.shape[1])
        trace = []
        for it in range(1, iterations + 1):
            ref_state = ref.step(ref_state, ref.L_level(ref_state["y"], ref_x, cos_sin), training)
            out = model(ids, puzzle_identifiers=puzzles, solver_state=state, max_loops=1, halting=False)
            state = out.solver_state
            torch.testing.assert_close(state.residuals, ref_state["residues"], **TOL)
            torch.testing.assert_close(state.eta, ref_state["stepsize"].view(-1), **TOL)
            assert state.patience.tolist() == ref_state["patience"].long().tolist(), f"patience at iteration {it}"
            trace.append(state.residuals)
            if it in (1, iterations):
                torch.testing.assert_close(state.hidden, ref_state["y"], **TOL)
                torch.testing.assert_close(out.logits, ref.logits(ref_state["y"]), **TOL)
        # one call of `iterations` steps gives the same state and residual trace as the step-by-step calls
        fresh = core.initial_solver_state(x)
        fresh.hidden = z0.clone()
        full = model(ids, puzzle_identifiers=puzzles, solver_state=fresh, max_loops=iterations, halting=False,
                     output_residual_trace=True)
        torch.testing.assert_close(full.residual_trace, torch.stack(trace, dim=1), **TOL)
        torch.testing.assert_close(full.solver_state.hidden, ref_state["y"], **TOL)
    etas = state.eta.tolist()
    return etas


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_checkpoint_matches_the_reference(case, tmp_path):
    s = {**BASE, **CASES[case]}
    sd = reference_state_dict(s, seed=sorted(CASES).index(case))
    model = convert(sd, [s], tmp_path / "out").eval()
    assert isinstance(model, FPRMForReasoning)
    etas = _compare(model, sd, s)
    if case not in MONOTONE:  # elsewhere the residual stalls and patience 2 makes η decay within 20 iterations
        assert min(etas) < 1.0, "the step-size decay should have acted within 20 iterations (patience 2)"


def test_training_mode_uses_gamma_train_like_the_reference(tmp_path):
    s = {**BASE, **PREFIX}
    sd = reference_state_dict(s, seed=3)
    model = convert(sd, [s], tmp_path / "out")
    etas = _compare(model, sd, s, training=True)
    assert any(abs(e - 0.7**k) < 1e-6 for e in etas for k in range(1, 10))  # decayed by γ_train = 0.7


def test_compiled_prefix_yaml_config_and_cli(tmp_path):
    """Their files as they come: `_orig_mod.` keys saved with torch.save, config/arch/fprm.yaml-style YAML with
    `${.field}` references plus a task config's `arch:` section, dataset fields as flags; through the CLI."""
    import yaml

    s = {**BASE, **CASES["conv2d-rope-prefix-pre-input_independent"]}
    sd = {f"_orig_mod.{k}": v for k, v in reference_state_dict(s, seed=9).items()}
    torch.save(sd, tmp_path / "step_100")
    arch = {k: v for k, v in s.items() if k not in ("vocab_size", "seq_len", "num_puzzle_identifiers", "L_cycles")}
    arch.update(L_cycles=4, n_backwards_L="${.L_cycles}", name="fixed_point_reasoning.fprm@FixedPointReasoningModel",
                loss={"name": "losses@ACTLossHead", "loss_type": "stablemax_cross_entropy"})
    (tmp_path / "fprm.yaml").write_text(yaml.safe_dump(arch))
    (tmp_path / "task.yaml").write_text(yaml.safe_dump({"global_batch_size": 768, "arch": {"max_iter_eval": 33}}))
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "fprm_hf.convert_reference", "--checkpoint", str(tmp_path / "step_100"),
           "--config", str(tmp_path / "fprm.yaml"), "--config", str(tmp_path / "task.yaml"),
           "--vocab-size", str(VOCAB), "--seq-len", str(SEQ_LEN), "--num-puzzle-identifiers", "3",
           "--output", str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "saved FPRMForReasoning" in done.stdout
    model = FPRMForReasoning.from_pretrained(tmp_path / "out").eval()
    assert model.config.max_loops == 33 and model.config.grid_size == [4, 4] and model.config.num_prefix_tokens == 3
    _compare(model, {k[len("_orig_mod."):]: v for k, v in sd.items()}, s, iterations=3)


# ---- the converter's errors ------------------------------------------------------------------------------------------


def _case(**overrides):
    s = {**BASE, **PREFIX, **overrides}
    return s, reference_state_dict(s)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s, sd: sd.update({"model.inner.L_level.extra.weight": torch.zeros(1)}),
         r"unknown keys \['L_level.extra.weight'\]"),
        (lambda s, sd: sd.pop("model.inner.L_level.layers.1.mlp.down_proj.weight"),
         r"missing keys \['model.layers.1.mlp.down_proj.weight'\]"),
        (lambda s, sd: sd.update({"model.inner.L_level.conv.weight": torch.zeros(HIDDEN, 1, 3)}),
         r"wrong shapes: \['model.conv.weight: checkpoint \(32, 1, 3\) vs model \(32, 1, 4\)'\]"),
        (lambda s, sd: sd.update({"other.weight": torch.zeros(1)}), r"unknown keys \['other.weight'\].*model.inner."),
        (lambda s, sd: s.update(mlp_t=True), r"unsupported settings: mlp_t=True"),
        (lambda s, sd: s.update(use_spec_norm_linear=True, residual_scale="input-dependent"),
         r"unsupported settings: use_spec_norm_linear=True"),
        (lambda s, sd: s.update(additive_noise_std=0.1), r"unsupported settings: additive_noise_std=0.1"),
        (lambda s, sd: s.update(bogus_field=1), r"unknown settings \['bogus_field'\]"),
        (lambda s, sd: s.pop("seq_len"), r"missing settings \['seq_len'\]"),
        (lambda s, sd: s.update(norm_type="sandwich"), r"`norm_type` must be one of .* got 'sandwich'"),
    ],
)
def test_converter_errors_name_what_is_wrong(change, message, tmp_path):
    s, sd = _case()
    change(s, sd)
    with pytest.raises(ValueError, match=message):
        convert(sd, [s], tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_converter_cli_refuses_an_output_file_and_pickles(tmp_path, capsys):
    s, sd = _case()
    import yaml

    (tmp_path / "arch.yaml").write_text(yaml.safe_dump(s))
    torch.save(sd, tmp_path / "ckpt.pt")
    (tmp_path / "taken").write_text("a file")
    code = convert_main(["--checkpoint", str(tmp_path / "ckpt.pt"), "--config", str(tmp_path / "arch.yaml"),
                         "--output", str(tmp_path / "taken")])
    out = capsys.readouterr()
    assert code == 2 and "exists and is not a folder" in out.err and "saved" not in out.out
    # a pickle holding more than tensors is refused unless --allow-pickle
    torch.save({"state": sd, "note": object.__new__(Marker)}, tmp_path / "pickled.pt")
    code = convert_main(["--checkpoint", str(tmp_path / "pickled.pt"), "--config", str(tmp_path / "arch.yaml"),
                         "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "weights_only=True" in err and "--allow-pickle" in err


class Marker:
    """A picklable non-tensor object: `torch.load(weights_only=True)` refuses it."""
