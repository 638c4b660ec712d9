"""Issue 2, item 7: weights from the reference code (nanoGPT-style keys) -> a saved LoopFormerForCausalLM.

The converted model is checked against an independent, minimal re-implementation of the reference forward written
here from the spec (learned positions, GELU, no biases, torch-default RMSNorm eps, adaLN without shift, separate
sinusoidal t/Δ embedders), not against the package's own modules.
"""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import loopformer_hf
from loopformer_hf.convert_reference import convert, load_reference_state_dict, main

N_LAYER, N_LOOPS, N_EMBD, N_HEAD, VOCAB, BLOCK = 2, 4, 64, 4, 97, 64
SHAPE_ARGS = ["--n-layer", str(N_LAYER), "--n-loops", str(N_LOOPS), "--n-embd", str(N_EMBD), "--n-head", str(N_HEAD),
              "--vocab-size", str(VOCAB), "--block-size", str(BLOCK)]
SHAPE_KWARGS = dict(n_layer=N_LAYER, n_loops=N_LOOPS, n_embd=N_EMBD, n_head=N_HEAD, vocab_size=VOCAB, block_size=BLOCK)
FULL = [1 / N_LOOPS] * N_LOOPS
SHORTCUT = [0.5, 0.25, 0.25]
SHORTCUT_REVERSED = [0.25, 0.25, 0.5]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- a random checkpoint in the reference layout ---------------------------------------------------------------------


def reference_state_dict(seed=0, d=N_EMBD, n_layer=N_LAYER, vocab=VOCAB, block=BLOCK, mlp=None, freq=256):
    g = torch.Generator().manual_seed(seed)
    mlp = 4 * d if mlp is None else mlp

    def lin(out_f, in_f, gain=1.0):
        return torch.randn(out_f, in_f, generator=g) * gain / math.sqrt(in_f)

    def vec(n, std):
        return torch.randn(n, generator=g) * std

    sd = {"transformer.wte.weight": torch.randn(vocab, d, generator=g),
          "transformer.wpe.weight": torch.randn(block, d, generator=g) * 0.5}
    for j in range(n_layer):
        p = f"transformer.h.blocks.{j}."
        sd[p + "attn.c_attn.weight"] = lin(3 * d, d)
        sd[p + "attn.c_proj.weight"] = lin(d, d)
        sd[p + "mlp.c_fc.weight"] = lin(mlp, d)
        sd[p + "mlp.c_proj.weight"] = lin(d, mlp)
        # random (not zero-init) modulation, so that gates, scales and the trajectory all change the logits
        sd[p + "adaLN_modulation.1.weight"] = lin(4 * d, d, gain=0.5)
        sd[p + "adaLN_modulation.1.bias"] = vec(4 * d, 0.3)
    sd["transformer.norm_f.weight"] = 1 + vec(d, 0.1)
    for name in ("time_embedder", "dt_embedder"):
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


def reference_forward(sd, idx, trajectory, n_head=N_HEAD):
    """Logits of the reference model: x = x + g_a·Attn(RMSNorm(x)(1+s_a)); x = x + g_m·MLP(RMSNorm(x)(1+s_m))."""
    B, T = idx.shape
    d = sd["transformer.wte.weight"].shape[1]
    hs = d // n_head
    n_layer = len({k.split(".")[3] for k in sd if k.startswith("transformer.h.blocks.")})
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T][None]
    t = 0.0
    for dt in trajectory:
        c = _embedder(sd, "time_embedder", t) + _embedder(sd, "dt_embedder", dt)  # (1, d)
        for j in range(n_layer):
            p = f"transformer.h.blocks.{j}."
            mod = F.linear(F.silu(c), sd[p + "adaLN_modulation.1.weight"], sd[p + "adaLN_modulation.1.bias"])
            gate_attn, gate_mlp, scale_attn, scale_mlp = mod[:, None, :].chunk(4, dim=-1)
            h = F.rms_norm(x, (d,)) * (1 + scale_attn)  # eps=None: torch default
            q, k, v = F.linear(h, sd[p + "attn.c_attn.weight"]).split(d, dim=2)
            q, k, v = (z.view(B, T, n_head, hs).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
            att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, d)
            x = x + gate_attn * F.linear(y, sd[p + "attn.c_proj.weight"])
            h = F.rms_norm(x, (d,)) * (1 + scale_mlp)
            x = x + gate_mlp * F.linear(F.gelu(F.linear(h, sd[p + "mlp.c_fc.weight"])), sd[p + "mlp.c_proj.weight"])
        t += dt
    x = F.rms_norm(x, (d,), sd["transformer.norm_f.weight"])
    return F.linear(x, sd["lm_head.weight"])


@pytest.fixture(scope="module")
def ref_sd():
    return reference_state_dict()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))


def test_reference_forward_depends_on_modulation(ref_sd, ids):
    """Guards the test itself: with random adaLN, two schedules of the same length give different logits."""
    with torch.no_grad():
        a = reference_forward(ref_sd, ids, SHORTCUT)
        b = reference_forward(ref_sd, ids, SHORTCUT_REVERSED)
    assert (a - b).abs().max() > 1e-2


def _check_matches_reference(folder, ref_sd, ids):
    model = loopformer_hf.LoopFormerForCausalLM.from_pretrained(folder).eval()
    assert model.config.num_hidden_layers == N_LAYER and model.config.num_loops == N_LOOPS
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    with torch.no_grad():
        for trajectory in (FULL, SHORTCUT, SHORTCUT_REVERSED):
            expected = reference_forward(ref_sd, ids, trajectory)
            got = model(ids, step_schedule=trajectory, use_cache=False).logits
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=f"trajectory {trajectory}")
        # the default trajectory is the full uniform one
        torch.testing.assert_close(model(ids, use_cache=False).logits, reference_forward(ref_sd, ids, FULL),
                                   atol=1e-4, rtol=0)


def test_convert_wrapped_compiled_pt_matches_reference(tmp_path, ref_sd, ids):
    """A nanoGPT train.py checkpoint: {"model": sd, ...}, keys prefixed by torch.compile, causal-mask buffers."""
    compiled = {"_orig_mod." + k: v for k, v in ref_sd.items()}
    for j in range(N_LAYER):
        compiled[f"_orig_mod.transformer.h.blocks.{j}.attn.bias"] = torch.ones(BLOCK, BLOCK).tril()[None, None]
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": compiled, "optimizer": {"state": {}}, "model_args": {"n_layer": N_LAYER}, "iter_num": 7}, ckpt)
    out = tmp_path / "hf"
    assert main(["--checkpoint", str(ckpt), "--output", str(out), *SHAPE_ARGS]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    _check_matches_reference(out, ref_sd, ids)


def test_convert_safetensors_via_command_line(tmp_path, ref_sd, ids):
    """`python -m loopformer_hf.convert_reference` on a plain safetensors state dict (lm_head stored as a copy)."""
    plain = {k: v.clone().contiguous() for k, v in ref_sd.items()}
    ckpt = tmp_path / "ckpt.safetensors"
    save_file(plain, str(ckpt))
    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "loopformer_hf.convert_reference", "--checkpoint", str(ckpt), "--output", str(out),
         *SHAPE_ARGS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    _check_matches_reference(out, ref_sd, ids)


def test_load_plain_pt_without_lm_head(tmp_path, ref_sd):
    sd = {k: v for k, v in ref_sd.items() if k != "lm_head.weight"}
    torch.save(sd, tmp_path / "plain.pt")
    loaded = load_reference_state_dict(tmp_path / "plain.pt")
    assert sorted(loaded) == sorted(sd)
    model = convert(tmp_path / "plain.pt", tmp_path / "hf", **SHAPE_KWARGS)
    torch.testing.assert_close(model.lm_head.weight, sd["transformer.wte.weight"])


def test_mlp_hidden_option(tmp_path):
    sd = reference_state_dict(mlp=96)
    torch.save(sd, tmp_path / "c.pt")
    with pytest.raises(ValueError, match=r"mlp\.c_fc\.weight.*\(96, 64\).*\(256, 64\)"):
        convert(tmp_path / "c.pt", tmp_path / "a", **SHAPE_KWARGS)  # default width 4d = 256
    model = convert(tmp_path / "c.pt", tmp_path / "b", mlp_hidden=96, **SHAPE_KWARGS)
    assert model.config.intermediate_size == 96


# ---- bad inputs ------------------------------------------------------------------------------------------------------


def _save(tmp_path, sd, name="bad.pt"):
    path = tmp_path / name
    torch.save(sd, path)
    return path


def test_missing_key_is_listed(tmp_path, ref_sd):
    sd = {k: v for k, v in ref_sd.items() if k != "transformer.h.blocks.1.mlp.c_fc.weight"}
    with pytest.raises(ValueError, match=r"missing keys.*model\.layers\.1\.mlp\.up_proj\.weight"):
        convert(_save(tmp_path, sd), tmp_path / "out", **SHAPE_KWARGS)
    assert not (tmp_path / "out").exists()


def test_unknown_key_is_listed(tmp_path, ref_sd):
    sd = dict(ref_sd, **{"transformer.h.blocks.0.attn.q_norm.weight": torch.ones(N_EMBD), "extra.thing": torch.ones(1)})
    with pytest.raises(ValueError, match=r"unknown keys.*'extra\.thing'.*'transformer\.h\.blocks\.0\.attn\.q_norm"):
        convert(_save(tmp_path, sd), tmp_path / "out", **SHAPE_KWARGS)


def test_wrong_n_layer_lists_the_extra_block(tmp_path, ref_sd):
    with pytest.raises(ValueError, match=r"unknown keys.*transformer\.h\.blocks\.1\.attn\.c_attn\.weight"):
        convert(_save(tmp_path, ref_sd), tmp_path / "out", **dict(SHAPE_KWARGS, n_layer=1))
    with pytest.raises(ValueError, match=r"missing keys.*model\.layers\.2\."):
        convert(_save(tmp_path, ref_sd), tmp_path / "out", **dict(SHAPE_KWARGS, n_layer=3))


def test_shape_mismatch_is_listed(tmp_path, ref_sd):
    with pytest.raises(ValueError, match=r"transformer\.wte\.weight -> model\.embed_tokens\.weight: checkpoint shape "
                                         r"\(97, 64\), model expects \(100, 64\)"):
        convert(_save(tmp_path, ref_sd), tmp_path / "out", **dict(SHAPE_KWARGS, vocab_size=100))
    with pytest.raises(ValueError, match=r"fused qkv must have shape \(96, 32\), got \(192, 64\)"):
        convert(_save(tmp_path, ref_sd), tmp_path / "out", **dict(SHAPE_KWARGS, n_embd=32, n_head=4))


def test_untied_lm_head_is_rejected(tmp_path, ref_sd):
    sd = dict(ref_sd, **{"lm_head.weight": ref_sd["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte.weight"):
        convert(_save(tmp_path, sd), tmp_path / "out", **SHAPE_KWARGS)


def test_bad_files_are_rejected(tmp_path, ref_sd):
    with pytest.raises(ValueError, match=r"unsupported extension.*\.safetensors"):
        load_reference_state_dict(tmp_path / "weights.npz")
    with pytest.raises(ValueError, match="does not exist"):
        load_reference_state_dict(tmp_path / "nope.pt")
    with pytest.raises(ValueError, match=r"neither a state dict.*'model' or 'state_dict'.*\['iter_num', 'optimizer'\]"):
        load_reference_state_dict(_save(tmp_path, {"optimizer": {"state": {}}, "iter_num": 3}))
    with pytest.raises(ValueError, match="holds a list"):
        load_reference_state_dict(_save(tmp_path, [1, 2]))


def test_bad_hyper_parameters_are_rejected(tmp_path, ref_sd):
    path = _save(tmp_path, ref_sd)
    with pytest.raises(ValueError, match="hidden_size.*divisible.*num_attention_heads"):
        convert(path, tmp_path / "out", **dict(SHAPE_KWARGS, n_head=5))
    with pytest.raises(ValueError, match="dtype.*float16.*float64"):
        convert(path, tmp_path / "out", dtype="float64", **SHAPE_KWARGS)


def test_command_line_reports_errors_without_traceback(tmp_path, ref_sd, capsys):
    sd = {k: v for k, v in ref_sd.items() if k != "transformer.norm_f.weight"}
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(_save(tmp_path, sd)), "--output", str(tmp_path / "out"), *SHAPE_ARGS])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "missing keys" in err and "model.norm.weight" in err and "Traceback" not in err
