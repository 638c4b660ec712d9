"""FPRM computes what the authors' FPRM computes (GitHub nilskiKonjIzDunava/fprm).

The reference (tests/support/fprm_reference_oracle.py) is an independent, minimal re-implementation of their forward
and solver that imports nothing from `fprm_hf`, on a state dict in THEIR key layout. The same weights go through
`fprm_hf.convert_authors`; the states after 1 and 20 solver iterations, the residual / step-size / patience traces
and the logits must agree within 1e-4 (fp32) in every case.
"""

import os
import subprocess
import sys

import pytest
import torch

from fprm_hf import FPRMForReasoning
from fprm_hf.convert_authors import convert, main as convert_main
from support.fprm_reference_oracle import BASE, BATCH, HIDDEN, SEQ_LEN, VOCAB, Reference, reference_state_dict

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- their arch settings for each case (their field names, over BASE) ----------------------------------------------

PREFIX = dict(puzzle_emb_ndim=2 * HIDDEN - 5, puzzle_emb_len=3)  # 3 rows, the last one partly zero padding
CASES = {
    "conv1d-rope-prefix-pre-input_independent": dict(**PREFIX),
    "conv2d-rope-prefix-pre-input_independent": dict(
        conv_type="conv2d", conv_kernel_size=3, alpha_1_init=0.75, alpha_2_init=0.25, **PREFIX
    ),
    "conv1d-learned-post-none": dict(pos_encodings="learned", norm_type="post-norm", residual_scale=None),
    "conv1d-none-causal-pre-fixed": dict(
        pos_encodings="none", causal=True, residual_scale="fixed", alpha_1_init=0.6, alpha_2_init=0.3
    ),
    "conv2d-none-pre-input_dependent": dict(
        conv_type="conv2d", conv_kernel_size=3, pos_encodings="none", residual_scale="input-dependent"
    ),
    "conv1d-rope-prefix-pre-outer_only": dict(outer_only=True, **PREFIX),
    "conv1d-learned-prefix-post-input_independent": dict(pos_encodings="learned", norm_type="post-norm", **PREFIX),
    "conv1d-rope-peri-output-normalized-injection": dict(
        norm_type="peri-norm", norm_placement="output", normalize_input_injection=True, conv_bias=True
    ),
    "conv2d-learned-prefix-pre-input-norm-fixed_init": dict(
        conv_type="conv2d",
        conv_kernel_size=3,
        pos_encodings="learned",
        norm_placement="input",
        fixed_init=True,
        **PREFIX,
    ),
    "none-conv-rope-pre-input_independent-temp": dict(conv_type="none", softmax_temp=1.7),
}
# with these seeds the residual improves at every one of the 20 iterations, so η never decays
MONOTONE = {"conv1d-none-causal-pre-fixed", "none-conv-rope-pre-input_independent-temp"}


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
        full = model(
            ids,
            puzzle_identifiers=puzzles,
            solver_state=fresh,
            max_loops=iterations,
            halting=False,
            output_residual_trace=True,
        )
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
    arch.update(
        L_cycles=4,
        n_backwards_L="${.L_cycles}",
        name="fixed_point_reasoning.fprm@FixedPointReasoningModel",
        loss={"name": "losses@ACTLossHead", "loss_type": "stablemax_cross_entropy"},
    )
    (tmp_path / "fprm.yaml").write_text(yaml.safe_dump(arch))
    (tmp_path / "task.yaml").write_text(yaml.safe_dump({"global_batch_size": 768, "arch": {"max_iter_eval": 33}}))
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "fprm_hf.convert_authors",
        "--checkpoint",
        str(tmp_path / "step_100"),
        "--config",
        str(tmp_path / "fprm.yaml"),
        "--config",
        str(tmp_path / "task.yaml"),
        "--vocab-size",
        str(VOCAB),
        "--seq-len",
        str(SEQ_LEN),
        "--num-puzzle-identifiers",
        "3",
        "--output",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "saved FPRMForReasoning" in done.stdout
    model = FPRMForReasoning.from_pretrained(tmp_path / "out").eval()
    assert model.config.max_loops == 33 and model.config.grid_size == [4, 4] and model.config.num_prefix_tokens == 3
    _compare(model, {k[len("_orig_mod.") :]: v for k, v in sd.items()}, s, iterations=3)


# ---- the converter's errors ------------------------------------------------------------------------------------------


def _case(**overrides):
    s = {**BASE, **PREFIX, **overrides}
    return s, reference_state_dict(s)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda s, sd: sd.update({"model.inner.L_level.extra.weight": torch.zeros(1)}),
            r"unknown keys \['L_level.extra.weight'\]",
        ),
        (
            lambda s, sd: sd.pop("model.inner.L_level.layers.1.mlp.down_proj.weight"),
            r"missing keys \['model.layers.1.mlp.down_proj.weight'\]",
        ),
        (
            lambda s, sd: sd.update({"model.inner.L_level.conv.weight": torch.zeros(HIDDEN, 1, 3)}),
            r"states conv_kernel_size=4, the weights show 3 \(L_level.conv.weight \(32, 1, 3\)\)",
        ),
        (lambda s, sd: sd.update({"other.weight": torch.zeros(1)}), r"unknown keys \['other.weight'\].*model.inner."),
        (lambda s, sd: s.update(mlp_t=True), r"unsupported settings: mlp_t=True"),
        (
            lambda s, sd: (
                s.update(use_spec_norm_linear=True, residual_scale="input-dependent"),
                sd.clear(),
                sd.update(reference_state_dict(s)),
            ),
            r"unsupported settings: use_spec_norm_linear=True",
        ),
        (lambda s, sd: s.update(additive_noise_std=0.1), r"unsupported settings: additive_noise_std=0.1"),
        (lambda s, sd: s.update(bogus_field=1), r"unknown settings \['bogus_field'\]"),
        (lambda s, sd: s.pop("seq_len"), r"nothing determines \['seq_len'\]"),
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
    code = convert_main(
        [
            "--checkpoint",
            str(tmp_path / "ckpt.pt"),
            "--config",
            str(tmp_path / "arch.yaml"),
            "--output",
            str(tmp_path / "taken"),
        ]
    )
    out = capsys.readouterr()
    assert code == 2 and "exists and is not a folder" in out.err and "saved" not in out.out
    # a pickle holding more than tensors is refused unless --allow-pickle
    torch.save({"state": sd, "note": object.__new__(Marker)}, tmp_path / "pickled.pt")
    code = convert_main(
        [
            "--checkpoint",
            str(tmp_path / "pickled.pt"),
            "--config",
            str(tmp_path / "arch.yaml"),
            "--output",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "weights_only=True" in err and "--allow-pickle" in err


class Marker:
    """A picklable non-tensor object: `torch.load(weights_only=True)` refuses it."""


def test_the_sizes_come_from_the_weights_and_a_stated_one_they_contradict_is_named(tmp_path):
    """The converter reads vocabulary, width, blocks and the SwiGLU width from the tensors (their `expansion` rule
    is not assumed), so a settings file that states only what no tensor shows converts; a stated size the tensors
    contradict names both."""
    s = {**BASE, **PREFIX, "expansion": 13}  # SwiGLU width round(13·32·2/3) -> 512, not the 256 of expansion 2
    sd = reference_state_dict(s, seed=4)
    stated_only = {
        k: s[k]
        for k in (
            "num_heads",
            "seq_len",
            "pos_encodings",
            "puzzle_emb_len",
            "norm_type",
            "fp_thresh",
            "stepsize_decay_eval",
            "decay_patience",
        )
    }
    model = convert(sd, [stated_only], tmp_path / "out").eval()
    c = model.config
    assert (c.intermediate_size, c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_puzzle_identifiers) == (
        512,
        VOCAB,
        HIDDEN,
        2,
        3,
    )
    _compare(model, sd, {**s, "fixed_init": False}, iterations=3)
    with pytest.raises(
        ValueError,
        match=r"states expansion=2 \(SwiGLU width 256 for hidden 32\), the weights show "
        r"512 \(L_level.layers.0.mlp.gate_up_proj.weight \(1024, 32\)\)",
    ):
        convert(sd, [{**stated_only, "expansion": 2}], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
