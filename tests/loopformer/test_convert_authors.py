"""Weights from the reference code (nanoGPT-style keys) -> a saved LoopFormerForCausalLM.

The converted model is checked against an independent, minimal re-implementation of the reference forward written
here from the spec (learned positions, GELU, no biases, torch-default RMSNorm eps, adaLN without shift, separate
sinusoidal t/Δ embedders), not against the package's own modules. One forward per reference file:
models/loopformer.py (t, Δ), models/tmlt.py (integer loop index), models/base_loop.py (no conditioning, block
RMSNorms with a weight) and models/base.py (the same blocks in a plain list `transformer.h.{j}`, one pass).
"""

import os
import subprocess
import sys

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import save_file

import loopformer_hf
from loopformer_hf.convert_authors import convert, load_reference_state_dict, main

from support.reference_oracle import (
    BLOCK,
    N_EMBD,
    N_HEAD,
    N_LAYER,
    N_LOOPS,
    VOCAB,
    reference_forward,
    reference_state_dict,
)
from support import REPO_ROOT

SHAPE_ARGS = [
    "--n-layer",
    str(N_LAYER),
    "--n-loops",
    str(N_LOOPS),
    "--n-embd",
    str(N_EMBD),
    "--n-head",
    str(N_HEAD),
    "--vocab-size",
    str(VOCAB),
    "--block-size",
    str(BLOCK),
]
SHAPE_KWARGS = dict(n_layer=N_LAYER, n_loops=N_LOOPS, n_embd=N_EMBD, n_head=N_HEAD, vocab_size=VOCAB, block_size=BLOCK)
FULL = [1 / N_LOOPS] * N_LOOPS
SHORTCUT = [0.5, 0.25, 0.25]
SHORTCUT_REVERSED = [0.25, 0.25, 0.5]


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
        torch.testing.assert_close(
            model(ids, use_cache=False).logits, reference_forward(ref_sd, ids, FULL), atol=1e-4, rtol=0
        )


def test_convert_wrapped_compiled_pt_matches_reference(tmp_path, ref_sd, ids):
    """A nanoGPT train.py checkpoint: {"model": sd, ...}, keys prefixed by torch.compile, causal-mask buffers."""
    compiled = {"_orig_mod." + k: v for k, v in ref_sd.items()}
    for j in range(N_LAYER):
        compiled[f"_orig_mod.transformer.h.blocks.{j}.attn.bias"] = torch.ones(BLOCK, BLOCK).tril()[None, None]
    ckpt = tmp_path / "ckpt.pt"
    torch.save(
        {"model": compiled, "optimizer": {"state": {}}, "model_args": {"n_layer": N_LAYER}, "iter_num": 7}, ckpt
    )
    out = tmp_path / "hf"
    assert main(["--checkpoint", str(ckpt), "--output", str(out), *SHAPE_ARGS]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    _check_matches_reference(out, ref_sd, ids)


def test_convert_safetensors_via_command_line(tmp_path, ref_sd, ids):
    """`python -m loopformer_hf.convert_authors` on a plain safetensors state dict (lm_head stored as a copy)."""
    plain = {k: v.clone().contiguous() for k, v in ref_sd.items()}
    ckpt = tmp_path / "ckpt.safetensors"
    save_file(plain, str(ckpt))
    out = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopformer_hf.convert_authors",
            "--checkpoint",
            str(ckpt),
            "--output",
            str(out),
            *SHAPE_ARGS,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
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
    sd = dict(
        ref_sd, **{"transformer.h.blocks.0.attn.q_norm.weight": torch.ones(N_EMBD), "extra.thing": torch.ones(1)}
    )
    with pytest.raises(ValueError, match=r"unknown keys.*'extra\.thing'.*'transformer\.h\.blocks\.0\.attn\.q_norm"):
        convert(_save(tmp_path, sd), tmp_path / "out", **SHAPE_KWARGS)


def test_wrong_n_layer_lists_the_extra_block(tmp_path, ref_sd):
    with pytest.raises(ValueError, match=r"unknown keys.*transformer\.h\.blocks\.1\.attn\.c_attn\.weight"):
        convert(_save(tmp_path, ref_sd), tmp_path / "out", **dict(SHAPE_KWARGS, n_layer=1))
    with pytest.raises(ValueError, match=r"missing keys.*model\.layers\.2\."):
        convert(_save(tmp_path, ref_sd), tmp_path / "out", **dict(SHAPE_KWARGS, n_layer=3))


def test_shape_mismatch_is_listed(tmp_path, ref_sd):
    with pytest.raises(
        ValueError,
        match=r"transformer\.wte\.weight -> model\.embed_tokens\.weight: checkpoint shape "
        r"\(97, 64\), model expects \(100, 64\)",
    ):
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
    with pytest.raises(
        ValueError, match=r"neither a state dict.*'model' or 'state_dict'.*\['iter_num', 'optimizer'\]"
    ):
        load_reference_state_dict(_save(tmp_path, {"optimizer": {"state": {}}, "iter_num": 3}))
    with pytest.raises(ValueError, match="holds a list"):
        load_reference_state_dict(_save(tmp_path, [1, 2]))


def test_bad_hyper_parameters_are_rejected(tmp_path, ref_sd):
    path = _save(tmp_path, ref_sd)
    with pytest.raises(StrictDataclassError, match="hidden_size.*divisible.*num_attention_heads"):  # as the config
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
    shape_args = [
        *SHAPE_ARGS[: SHAPE_ARGS.index("--n-head") + 1],
        "5",
        *SHAPE_ARGS[SHAPE_ARGS.index("--n-head") + 2 :],
    ]
    with pytest.raises(SystemExit) as exit_info:  # a shape the config refuses: its error, in one line
        main(["--checkpoint", str(_save(tmp_path, ref_sd)), "--output", str(tmp_path / "out"), *shape_args])
    assert exit_info.value.code == 2
    assert "divisible by `num_attention_heads` (5)" in capsys.readouterr().err.strip().splitlines()[-1]


# ---- TMLT, Base-Loop and Base: the other reference variants ----------------------------------------------------------

BASE_LAYERS = 3  # Base: a plain list of blocks, one pass


def _shape(model_type):
    return dict(SHAPE_KWARGS, n_layer=BASE_LAYERS, n_loops=None) if model_type == "base" else SHAPE_KWARGS


@pytest.mark.parametrize("model_type", ["loopformer", "tmlt", "base_loop", "base"])
def test_each_reference_model_type_converts_and_matches(tmp_path, ids, model_type):
    sd = reference_state_dict(seed=5, model_type=model_type, n_layer=BASE_LAYERS if model_type == "base" else N_LAYER)
    compiled = {"_orig_mod." + k: v for k, v in sd.items()}  # as nanoGPT's train.py saves it
    torch.save({"model": compiled, "iter_num": 1}, tmp_path / "ckpt.pt")
    convert(tmp_path / "ckpt.pt", tmp_path / "hf", model_type=model_type, **_shape(model_type))
    model = loopformer_hf.LoopFormerForCausalLM.from_pretrained(tmp_path / "hf").eval()
    expected_conditioning = {"loopformer": "shortcut", "tmlt": "timestep"}.get(model_type, "none")
    assert model.config.loop_conditioning == expected_conditioning
    assert model.config.block_norm_weight == (model_type in ("base_loop", "base"))
    budgets = [None] if model_type == "base" else [None, 2, 1]
    with torch.no_grad():
        for budget in budgets:
            trajectory = [1 / (budget or N_LOOPS)] * (budget or N_LOOPS)
            expected = reference_forward(sd, ids, trajectory, model_type=model_type)
            got = model(ids, loop_budget=budget, use_cache=False).logits
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=f"{model_type}, budget {budget}")
    if model_type == "base":
        assert model.config.num_loops == 1 and model.config.num_hidden_layers == BASE_LAYERS


@pytest.mark.parametrize("model_type", ["tmlt", "base_loop"])
def test_reference_forward_depends_on_what_the_type_adds(ids, model_type):
    """Guards the test itself: TMLT's logits change with the loop index' embedder, Base-Loop's with the norm weights."""
    sd = reference_state_dict(seed=5, model_type=model_type)
    changed = dict(sd)
    for key in sd:
        if key.endswith(("norm_1.weight", "norm_2.weight")):
            changed[key] = torch.ones_like(sd[key])
        if key == "time_embedder.mlp.2.bias":
            changed[key] = sd[key] + 1.0
    with torch.no_grad():
        assert (
            reference_forward(sd, ids, FULL, model_type=model_type)
            - reference_forward(changed, ids, FULL, model_type=model_type)
        ).abs().max() > 1e-2


def test_base_layout_needs_model_type_base(tmp_path):
    base = _save(tmp_path, reference_state_dict(model_type="base", n_layer=BASE_LAYERS), "base.pt")
    with pytest.raises(ValueError, match=r"(?s)unknown keys.*transformer\.h\.0\.attn.*layout of models/base\.py"):
        convert(base, tmp_path / "out", model_type="base_loop", **dict(SHAPE_KWARGS, n_layer=BASE_LAYERS))
    with pytest.raises(ValueError, match=r"`n_loops` must be 1.*model_type='base'.*got 4"):
        convert(base, tmp_path / "out", model_type="base", **dict(SHAPE_KWARGS, n_layer=BASE_LAYERS))
    with pytest.raises(
        ValueError,
        match=r"`model_type` must be one of \('loopformer', 'tmlt', 'tmlt_ee', 'base_loop', "
        r"'base_loop_ee', 'base'\), got 'gpt'",
    ):
        convert(base, tmp_path / "out", model_type="gpt", **SHAPE_KWARGS)


def test_base_loop_without_norm_weights_is_rejected(tmp_path):
    sd = {k: v for k, v in reference_state_dict(model_type="base_loop").items() if "norm_2" not in k}
    with pytest.raises(ValueError, match=r"missing keys.*model\.layers\.0\.post_attention_layernorm\.weight"):
        convert(_save(tmp_path, sd), tmp_path / "out", model_type="base_loop", **SHAPE_KWARGS)
    # a LoopFormer checkpoint has no block-norm weights: given one, it is an unknown key, not silently dropped
    sd = dict(reference_state_dict(), **{"transformer.h.blocks.0.norm_1.weight": torch.ones(N_EMBD)})
    with pytest.raises(ValueError, match=r"unknown keys.*transformer\.h\.blocks\.0\.norm_1\.weight"):
        convert(_save(tmp_path, sd), tmp_path / "out", **SHAPE_KWARGS)


def test_command_line_converts_a_base_checkpoint(tmp_path, ids):
    sd = reference_state_dict(model_type="base", n_layer=BASE_LAYERS)
    ckpt = _save(tmp_path, sd, "base.pt")
    args = [a for a in SHAPE_ARGS]
    args[args.index("--n-layer") + 1] = str(BASE_LAYERS)
    i = args.index("--n-loops")
    del args[i : i + 2]
    assert main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "hf"), "--model-type", "base", *args]) == 0
    model = loopformer_hf.LoopFormerForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, use_cache=False).logits, reference_forward(sd, ids, None, model_type="base"), atol=1e-4, rtol=0
        )
