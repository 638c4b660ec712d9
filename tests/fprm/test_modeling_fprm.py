"""FPRM model: config, Auto classes and export, the architecture, the solver (Algorithm 1), stability, bad input."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError

from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

from fprm_hf import FPRMConfig, FPRMForReasoning, FPRMModel, FPRMSolverState
from fprm_hf.configuration_fprm import RESIDUAL_SCALINGS


from support.tiny_models import grid_inputs, sequence_fprm_config, tiny_fprm, tiny_fprm_config

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 1. config, Auto classes, safetensors, trust_remote_code ------------------------------------------------------


def test_config_defaults_are_the_authors_arch_defaults_with_transformers_names():
    """FPRMConfig() is their config/arch/fprm.yaml: conv1d kernel 4 on the state, RoPE, 16 prefix rows, α 0.5/0.5,
    init_std 1.0, fresh random z0, pre-norm, no final norm, eps 1e-5, SwiGLU width 1536 for d = 512."""
    c = FPRMConfig()
    assert c.model_type == "fprm"
    assert (c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_hidden_layers) == (11, 512, 8, 2)
    assert (c.alpha1, c.alpha2, c.halt_eps, c.init_std, c.patience) == (0.5, 0.5, 0.1, 1.0, 5)
    assert (c.gamma_train, c.gamma_eval, c.conv_type, c.conv_kernel_size, c.num_prefix_tokens) == (
        0.9,
        0.99,
        "causal_1d",
        4,
        16,
    )
    assert (c.norm_type, c.norm_placement, c.fixed_init) == ("pre", "none", False)
    assert (c.expansion, c.intermediate_size, c.rms_norm_eps, c.position_embedding_type) == (4.0, 1536, 1e-5, "rope")
    assert tiny_fprm_config(conv_type="2d").conv_kernel_size == 3  # 3x3 for grids
    assert FPRMConfig(hidden_size=128, num_attention_heads=4).intermediate_size == 512  # 341.3 -> 341 -> 512


def test_auto_classes_resolve_fprm():
    config = tiny_fprm_config()
    assert isinstance(AutoConfig.for_model("fprm", hidden_size=32, num_attention_heads=4), FPRMConfig)
    assert type(AutoModel.from_config(config)) is FPRMModel
    assert type(AutoModelForTokenClassification.from_config(config)) is FPRMForReasoning


def test_save_and_load_roundtrip_safetensors(tmp_path):
    model = tiny_fprm()
    ids = grid_inputs()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not (tmp_path / "pytorch_model.bin").exists()
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForTokenClassification"] == "modeling_fprm.FPRMForReasoning"
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is FPRMForReasoning
    with torch.no_grad():
        a, b = model(ids), loaded(ids)
    torch.testing.assert_close(a.logits, b.logits)
    assert torch.equal(a.iterations, b.iterations)
    torch.testing.assert_close(loaded.model.z_init, model.model.z_init)  # z0 is saved, not re-drawn


def test_trust_remote_code_loads_without_the_package(tmp_path):
    model = tiny_fprm()
    ids = grid_inputs()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    script = f"""
import importlib.abc, sys, torch
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "fprm_hf":
            raise ImportError("package blocked for this test")
sys.meta_path.insert(0, Block())
from transformers import AutoModelForTokenClassification
m = AutoModelForTokenClassification.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()
assert "fprm_hf" not in sys.modules
e = torch.load({str(tmp_path / "expected.pt")!r})
with torch.no_grad():
    torch.testing.assert_close(m(e["ids"]).logits, e["logits"])
print("REMOTE_OK", type(m).__module__)
"""
    # the modeling file and every module it imports relatively lie next to the weights
    code = (
        "configuration_fprm.py",
        "modeling_fprm.py",
        "layers_fprm.py",
        "looped_common.py",
        "solver_fprm.py",
        "inputs_fprm.py",
        "outputs_fprm.py",
    )
    assert set(code) <= {p.name for p in tmp_path.glob("*.py")}
    # the common file as a file, not the package's link to common/ (which would not travel with the folder)
    assert not (tmp_path / "looped_common.py").is_symlink()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REMOTE_OK" in out.stdout and "fprm_hf" not in out.stdout.split("REMOTE_OK")[1]


# ---- 2. the architecture ------------------------------------------------------------------------------------------


def test_alpha_init_and_tied_betas():
    model = tiny_fprm(alpha1=0.75, alpha2=0.25)
    scaling = model.model.residual_scaling
    alpha1, beta1, alpha2, beta2 = scaling(torch.zeros(1, 1, 32))
    torch.testing.assert_close(alpha1, torch.full((32,), 0.75))
    torch.testing.assert_close(alpha2, torch.full((32,), 0.25))
    k = 2 * 2  # 2N sub-layers with N = 2 blocks
    expected_beta2 = 1 - 0.25 * 0.75**k
    expected_beta1 = expected_beta2 * (1 - 0.75) / (1 - 0.75**k + 1e-5)
    torch.testing.assert_close(beta2, torch.full((32,), expected_beta2))
    torch.testing.assert_close(beta1, torch.full((32,), expected_beta1))
    assert scaling.alpha1_logit.requires_grad  # learned; not buffers


def test_one_loop_step_matches_the_spec_equations():
    """f(y) recomputed by hand from the modules: y' = [prefix rows ; Conv(grid rows of y)], h = α2·y' + β2·x, then
    h = α1·h + β1·F(RMSNorm(h)) per sub-layer (tests/fprm/test_convert_authors_fprm.py checks the same against the authors')."""
    model = tiny_fprm().model
    torch.manual_seed(3)
    with torch.no_grad():
        model.residual_scaling.alpha1_logit.normal_()  # per-channel values, not just the init
        model.residual_scaling.alpha2_logit.normal_()
        x = model.embed(grid_inputs(2))
        y = torch.randn_like(x)
        a1 = torch.sigmoid(model.residual_scaling.alpha1_logit)
        a2 = torch.sigmoid(model.residual_scaling.alpha2_logit)
        b2 = 1 - a2 * a1**4
        b1 = b2 * (1 - a1) / (1 - a1**4 + 1e-5)
        norm = lambda t: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)  # noqa: E731
        grid = y[:, 2:].transpose(1, 2).reshape(2, 32, 4, 4)
        conv = torch.nn.functional.conv2d(grid, model.conv.weight, padding=1, groups=32).reshape(2, 32, 16)
        y_conv = torch.cat([y[:, :2], conv.transpose(1, 2)], dim=1)
        pe = model.position_embeddings(x)
        h = a2 * y_conv + b2 * x
        for block in model.layers:
            h = a1 * h + b1 * block.self_attn(norm(h), pe)
            h = a1 * h + b1 * block.mlp(norm(h))
        torch.testing.assert_close(model.fixed_point_map(y, x, pe), h, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scaling", RESIDUAL_SCALINGS)
def test_every_residual_scaling_variant_runs_and_trains(scaling):
    torch.manual_seed(0)
    model = FPRMForReasoning(tiny_fprm_config(residual_scaling=scaling, max_loops=3)).train()
    out = model(grid_inputs(), labels=grid_inputs(seed=2), halt_eps=1e-6)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert model.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_variant_coefficients():
    x = torch.zeros(1, 1, 32)
    fixed = tiny_fprm(residual_scaling="fixed", alpha1=0.6, alpha2=0.3).model.residual_scaling
    assert not list(fixed.parameters())  # fixed scalars are not learned
    a1, b1, a2, b2 = fixed(x)
    assert math.isclose(float(a1), 0.6, rel_tol=1e-6) and math.isclose(float(b2), 1 - 0.3 * 0.6**4, rel_tol=1e-6)
    outer = tiny_fprm(outer_only=True).model.residual_scaling
    assert outer.alpha1_logit is None  # only α2 is learned
    a1, b1, a2, b2 = outer(x)
    assert a1 == 1.0 and b1 == 1.0
    torch.testing.assert_close(b2, 1 - a2)
    dep = tiny_fprm(residual_scaling="input_dependent").model.residual_scaling
    y = torch.randn(2, 5, 32)
    a1, _, a2, _ = dep(y)
    assert a1.shape == (2, 5, 32)  # per token and channel
    torch.testing.assert_close(a1, torch.sigmoid(dep.alpha1_proj(y)))  # one linear layer per α, on the state
    torch.testing.assert_close(a2, torch.sigmoid(dep.alpha2_proj(y)))
    assert tiny_fprm(residual_scaling="none").model.residual_scaling(x) == (1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("scaling", ["none", "input_independent"])
def test_post_norm_variant_saturates_at_unit_rms(scaling):
    # post-norm with or without residual scaling, as the authors allow both
    model = tiny_fprm(norm_type="post", residual_scaling=scaling).model
    with torch.no_grad():
        x = model.embed(grid_inputs(2))
        f = model.fixed_point_map(torch.randn_like(x) * 50, x)
    torch.testing.assert_close(f.pow(2).mean(-1), torch.ones(2, 18), rtol=1e-3, atol=1e-3)


def test_peri_norm_and_norm_placements():
    """peri-norm normalises each sub-layer's output too; norm_placement='output' ends f with an RMSNorm;
    'input' normalises the state before the mix."""
    model = tiny_fprm(norm_type="peri", norm_placement="output").model
    with torch.no_grad():
        x = model.embed(grid_inputs(2))
        f = model.fixed_point_map(torch.randn_like(x) * 50, x)
    torch.testing.assert_close(f.pow(2).mean(-1), torch.ones(2, 18), rtol=1e-3, atol=1e-3)
    plain, placed = tiny_fprm(seed=3).model, tiny_fprm(seed=3, norm_placement="input").model
    with torch.no_grad():
        x = plain.embed(grid_inputs(2))
        y = torch.randn_like(x)
        assert not torch.allclose(plain.fixed_point_map(y, x), placed.fixed_point_map(y, x))
        # input placement: f(c·y) = f(y) for any c > 0 when the conv is linear and the state is normalised after it
        torch.testing.assert_close(
            placed.fixed_point_map(3 * y, x), placed.fixed_point_map(y, x), rtol=1e-4, atol=1e-4
        )


def test_input_is_reinjected_every_loop_step():
    """f depends on x at every step, not only at the first one: a changed x changes f(y) for the same y."""
    model = tiny_fprm().model
    with torch.no_grad():
        x1, x2 = model.embed(grid_inputs(1, seed=1)), model.embed(grid_inputs(1, seed=5))
        y = torch.randn_like(x1)
        assert not torch.allclose(model.fixed_point_map(y, x1), model.fixed_point_map(y, x2))


def test_causal_sequence_model_does_not_see_the_future_and_grid_model_does():
    torch.manual_seed(0)
    causal = FPRMForReasoning(sequence_fprm_config()).eval()
    ids = torch.randint(1, 7, (1, 12))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] % 6) + 1
    with torch.no_grad():
        a, b = causal(ids, halting=False, max_loops=5), causal(changed, halting=False, max_loops=5)
    torch.testing.assert_close(a.logits[:, :-1], b.logits[:, :-1])
    assert not torch.allclose(a.logits[:, -1], b.logits[:, -1])
    grid = tiny_fprm()
    ids = grid_inputs(1)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 7
    with torch.no_grad():
        a, b = grid(ids, halting=False, max_loops=5), grid(changed, halting=False, max_loops=5)
    assert not torch.allclose(a.logits[:, 0], b.logits[:, 0])  # bidirectional


def test_causal_conv_has_kernel_4_and_2d_conv_is_3x3_depthwise():
    seq = FPRMForReasoning(sequence_fprm_config()).model.conv
    assert seq.weight.shape == (32, 1, 4) and seq.bias is None  # depthwise: one kernel per channel, no bias
    grid = tiny_fprm().model.conv
    assert grid.weight.shape == (32, 1, 3, 3) and grid.bias is None


def test_2d_conv_only_mixes_grid_neighbours_and_leaves_prefix_rows():
    model = tiny_fprm().model
    with torch.no_grad():
        y = torch.randn(1, 18, 32)
        base = model.conv(y)
        assert base.shape == (1, 16, 32)  # grid rows only
        y[0, 2 + 5] = torch.randn(32)  # change only cell (1, 1) of the 4x4 grid
        after = model.conv(y)
        delta = (after - base).abs().sum(-1).view(4, 4)
        y[0, 0] = torch.randn(32)  # a prefix row does not enter the conv
        assert torch.equal(model.conv(y), after)
    touched = (delta > 0).nonzero().tolist()
    assert touched and all(abs(r - 1) <= 1 and abs(c - 1) <= 1 for r, c in touched)


def test_causal_conv_sees_the_last_kernel_positions_only():
    model = FPRMForReasoning(sequence_fprm_config()).model
    with torch.no_grad():
        y = torch.randn(1, 10, 32)
        base = model.conv(y)
        y[0, 5] = torch.randn(32)
        delta = (model.conv(y) - base).abs().sum(-1)[0]
    assert (delta > 0).nonzero().flatten().tolist() == [5, 6, 7, 8]  # positions 5..5+k-1, never earlier ones


def test_the_conv_replaces_the_grid_rows_of_the_raw_state():
    """The authors' placement: y' = [prefix rows of y ; DWConv(grid rows of y)] before the mix h = α2·y' + β2·x."""
    model = tiny_fprm(residual_scaling="fixed", num_hidden_layers=1).model
    with torch.no_grad():
        x = model.embed(grid_inputs(1))
        y = torch.randn_like(x)
        for layer in model.layers:  # sub-layers off: f is the mix alone
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        a1, b1, a2, b2 = model.residual_scaling(y)
        mix = a2 * torch.cat([y[:, :2], model.conv(y)], dim=1) + b2 * x
        torch.testing.assert_close(model.fixed_point_map(y, x), a1 * a1 * mix, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positions", ["rope", "learned", "none"])
def test_position_embedding_types(positions):
    torch.manual_seed(0)
    # fixed_init: the same z0 on every token, so that only positions can tell the cells apart
    model = FPRMForReasoning(
        tiny_fprm_config(position_embedding_type=positions, conv_type="none", fixed_init=True)
    ).eval()
    assert (model.model.embed_positions is not None) == (positions == "learned")
    assert (model.model.rotary_emb is not None) == (positions == "rope")
    ids = torch.full((1, 16), 3)
    with torch.no_grad():
        logits = model(ids, halting=False, max_loops=3).logits
    # identical tokens everywhere: only positions can tell the cells apart
    spread = (logits - logits[:, :1]).abs().max()
    assert (spread > 1e-4) == (positions != "none")


def test_prefix_tokens_per_puzzle_identifier():
    model = tiny_fprm(num_puzzle_identifiers=3)
    assert model.model.prefix.shape == (3, 2, 32)
    assert not model.model.prefix.any()  # zero at init, as the authors' puzzle embedding
    with torch.no_grad():
        model.model.prefix.normal_()
    ids = grid_inputs(2)
    with torch.no_grad():
        a = model(ids, puzzle_identifiers=torch.tensor([0, 0]), halting=False, max_loops=3).logits
        b = model(ids, puzzle_identifiers=torch.tensor([0, 2]), halting=False, max_loops=3).logits
    assert a.shape == (2, 16, 7)  # prefix positions are dropped from the logits
    torch.testing.assert_close(a[0], b[0])
    assert not torch.allclose(a[1], b[1])


def test_z0_is_a_fresh_truncated_normal_per_sample_and_token_with_init_std():
    model = FPRMModel(tiny_fprm_config(init_std=6.0, hidden_size=256, intermediate_size=8, num_hidden_layers=1))
    x = torch.zeros(8, 18, 256)
    model.train()
    torch.manual_seed(0)
    z0 = model.initial_z(x)
    assert z0.shape == (8, 18, 256)
    assert not torch.allclose(z0[0], z0[1]) and not torch.allclose(z0[0, 0], z0[0, 1])  # per sample and token
    assert abs(float(z0.std()) - 6.0) < 0.1  # the std asked for (their truncated normal is rescaled)
    cut = 2 * 6.0 / math.sqrt(1 - 4 * math.exp(-2) / math.sqrt(2 * math.pi) / math.erf(math.sqrt(2)))
    assert float(z0.abs().max()) <= cut + 1e-4 and float(z0.abs().max()) > 0.95 * cut  # cut at ±2σ of the normal
    assert not torch.equal(model.initial_z(x), z0)  # training: a fresh draw at every reset (global RNG)
    torch.manual_seed(0)
    assert torch.equal(model.initial_z(x), z0)
    # a generator decides the draw, in either mode
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    model.eval()
    assert torch.equal(model.initial_z(x, g()), model.train().initial_z(x, g()))
    # evaluation mode: deterministic (seeded by config.initial_state_seed), the same for every row of the batch,
    # and a prefix of a longer input gets the z0 of the longer input's first tokens
    model.eval()
    a = model.initial_z(x)
    assert torch.equal(a, model.initial_z(x)) and torch.equal(a[0], a[5]) and not torch.allclose(a[0, 0], a[0, 1])
    torch.testing.assert_close(model.initial_z(x[:2, :7]), a[:2, :7])
    model.config.initial_state_seed = 1
    assert not torch.equal(model.initial_z(x), a)


def test_fixed_init_stores_one_z0_vector_that_is_saved(tmp_path):
    model = tiny_fprm(fixed_init=True, init_std=6.0)
    z = model.model.z_init
    assert z.shape == (32,) and "model.z_init" in model.state_dict()
    y0 = model.model.initial_z(torch.zeros(3, 18, 32))
    assert torch.equal(y0, z.expand(3, 18, 32))
    model.save_pretrained(tmp_path)
    torch.testing.assert_close(FPRMForReasoning.from_pretrained(tmp_path).model.z_init, z)  # saved, not re-drawn
    assert "model.z_init" not in tiny_fprm().state_dict()  # the default draws z0 fresh: nothing to store


# ---- 3. the solver ------------------------------------------------------------------------------------------------


def test_residual_and_damped_update_of_one_iteration():
    model = tiny_fprm().model
    ids = grid_inputs(2)
    with torch.no_grad():
        out = model(ids, max_loops=1, eta=0.5, halting=False)
        x = model.embed(ids)
        y0 = model.initial_solver_state(x).hidden
        f = model.fixed_point_map(y0, x, model.position_embeddings(x))
    r = ((y0 - f).abs().amax(-1) / (f.abs().amax(-1) + 1e-8)).amax(-1)
    torch.testing.assert_close(out.residuals, r)
    torch.testing.assert_close(out.solver_state.hidden, 0.5 * f + 0.5 * y0)


def _simulate_decay(trace, eta0, patience, gamma, halt_eps, min_eta):
    """Algorithm 1's bookkeeping replayed from a residual trace: returns (eta, halting iteration)."""
    eta, best, p = eta0, math.inf, patience
    for i, r in enumerate(trace, start=1):
        if r < best:
            best, p = r, patience
        else:
            p -= 1
        if p <= 0 and r >= halt_eps:
            eta, p = eta * gamma, patience
        if r < halt_eps or eta < min_eta:
            return eta, i
    return eta, len(trace)


def test_step_decay_patience_and_eta_halting_follow_algorithm_1():
    model = tiny_fprm(seed=4).model
    ids = grid_inputs(3, seed=7)
    knobs = dict(halt_eps=1e-9, patience=2, gamma=0.5, min_eta=0.02, max_loops=300)
    with torch.no_grad():
        out = model(ids, output_residual_trace=True, **knobs)
    assert out.converged.sum() == 0
    for row in range(3):
        n = int(out.iterations[row])
        eta, stop = _simulate_decay(out.residual_trace[row, :n].tolist(), 1.0, 2, 0.5, 1e-9, 0.02)
        assert stop == n
        assert math.isclose(float(out.solver_state.eta[row]), eta, rel_tol=1e-6)
    assert (out.iterations < 300).all()  # halted by η < min_eta, not the cap
    assert (out.solver_state.eta < 0.02).all()


def test_per_sample_halting_freezes_rows_and_stops_when_all_halted():
    model = tiny_fprm(seed=3).model
    ids = grid_inputs(4, seed=3)
    calls = []
    model.layers[0].register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[0]))
    with torch.no_grad():
        out = model(ids, halt_eps=0.1, max_loops=200, output_residual_trace=True)
    assert out.converged.all() and (out.residuals < 0.1).all()
    assert len(set(out.iterations.tolist())) > 1, "rows should halt at different iterations for this test"
    assert len(calls) == int(out.iterations.max())  # the loop ends when the last row halts
    # only rows still iterating are evaluated
    assert calls == [int((out.iterations > i).sum()) for i in range(len(calls))]
    # a frozen row equals the same sample solved alone, so nothing touched it after it halted
    for row in (int(out.iterations.argmin()), int(out.iterations.argmax())):
        with torch.no_grad():
            alone = model(ids[row : row + 1], halt_eps=0.1, max_loops=200)
        assert int(alone.iterations) == int(out.iterations[row])
        torch.testing.assert_close(alone.last_hidden_state[0], out.last_hidden_state[row], rtol=1e-4, atol=1e-5)
    # its residual trace stays flat after it halted
    first = int(out.iterations.min())
    row = int(out.iterations.argmin())
    assert torch.all(out.residual_trace[row, first - 1 :] == out.residual_trace[row, first - 1])


def test_forward_knobs_override_config_and_halting_false_runs_the_cap():
    model = tiny_fprm(seed=1)
    ids = grid_inputs(3)
    with torch.no_grad():
        loose = model(ids, halt_eps=0.5, max_loops=200)
        tight = model(ids, halt_eps=0.01, max_loops=200)
        capped = model(ids, max_loops=7)
        always = model(ids, max_loops=9, halting=False)
    assert (loose.iterations <= tight.iterations).all() and loose.iterations.sum() < tight.iterations.sum()
    assert (capped.iterations <= 7).all()
    assert (always.iterations == 9).all()


def test_solver_state_continues_where_it_stopped():
    model = tiny_fprm(seed=2).model
    ids = grid_inputs(2)
    with torch.no_grad():
        full = model(ids, max_loops=8, halting=False)
        first = model(ids, max_loops=3, halting=False)
        second = model(ids, max_loops=5, halting=False, solver_state=first.solver_state)
    torch.testing.assert_close(second.solver_state.hidden, full.solver_state.hidden)
    assert (second.solver_state.iterations == 8).all() and (second.iterations == 5).all()


def test_a_solver_state_is_refused_on_other_inputs_of_the_same_shape():
    # it was reused silently: a row converged on the old puzzle ran 0 iterations and returned the old puzzle's answer
    model = tiny_fprm(seed=2, num_puzzle_identifiers=2)
    ids, other = grid_inputs(2), grid_inputs(2, seed=5)
    other[0] = ids[0]  # row 0 is the same puzzle, row 1 another
    with torch.no_grad():
        first = model(ids, halt_eps=0.5)
        assert first.converged.any()
        model(ids, solver_state=first.solver_state)  # the same inputs: continued
        with pytest.raises(ValueError, match=r"`solver_state` was computed on other inputs than these \(rows \[1\]"):
            model(other, solver_state=first.solver_state)
        with pytest.raises(ValueError, match=r"rows \[0, 1\]"):  # the puzzle identifier is part of the input
            model(ids, puzzle_identifiers=torch.tensor([1, 1]), solver_state=first.solver_state)
        embeds = model.get_input_embeddings()(ids)
        from_embeds = model.model(inputs_embeds=embeds, max_loops=2)
        model.model(inputs_embeds=embeds, max_loops=2, solver_state=from_embeds.solver_state)
        with pytest.raises(ValueError, match="computed on other inputs"):
            model.model(inputs_embeds=embeds + 1e-3, solver_state=from_embeds.solver_state)
        # a state that records no inputs (built by hand, an older checkpoint's carry) is taken on trust
        unknown = model(other, solver_state=dataclasses.replace(first.solver_state, fingerprint=None))
    assert torch.equal(unknown.solver_state.fingerprint, model(other, max_loops=1).solver_state.fingerprint)


def test_a_solver_state_of_another_dtype_or_hand_edited_is_a_named_error():
    model = tiny_fprm(seed=2)
    ids = grid_inputs(2)
    with torch.no_grad():
        state = model(ids, max_loops=2).solver_state
        with pytest.raises(
            ValueError,
            match=r"`solver_state.hidden` is torch.bfloat16, this model computes in "
            r"torch.float32",
        ):
            model(ids, solver_state=dataclasses.replace(state, hidden=state.hidden.bfloat16()))
        with pytest.raises(
            ValueError,
            match=r"`solver_state.eta` must be a torch.float32 tensor of shape \(2,\), got "
            r"Tensor \(3,\)",
        ):
            model(ids, solver_state=dataclasses.replace(state, eta=torch.ones(3)))
        with pytest.raises(ValueError, match=r"`solver_state.halted` must be a torch.bool tensor"):
            model(ids, solver_state=dataclasses.replace(state, halted=state.halted.long()))


# ---- 7. stability ---------------------------------------------------------------------------------------------------


def _run_loops(model, steps, seed=0):
    """Iterate f `steps` times; return the state norms ‖y_t‖∞, ‖x‖∞ and the largest sub-layer output ‖F_k‖∞ seen."""
    seen = {"f": 0.0}

    def record(module, args, output):
        seen["f"] = max(seen["f"], float(output.abs().max()))

    m = model.model
    for block in m.layers:
        block.self_attn.register_forward_hook(record)
        block.mlp.register_forward_hook(record)
    norms = []
    with torch.no_grad():
        x = m.embed(grid_inputs(1, seed=seed))
        y = m.initial_solver_state(x).hidden
        pe = m.position_embeddings(x)
        norms.append(float(y.abs().max()))
        for _ in range(steps):
            y = m.fixed_point_map(y, x, pe)
            norms.append(float(y.abs().max()))
    return norms, float(x.abs().max()), seen["f"]


def test_input_independent_stays_within_theorem_1_bound_while_plain_prenorm_grows():
    """Theorem 1 with the tied β's and the conv on the state (‖Conv(y)‖∞ ≤ c‖y‖∞, c the largest per-channel ℓ1 norm
    of the kernel): per channel |f(y)| ≤ a|y| + β2(α1^(2N)|x| + c_f) with a = c·α2·α1^(2N), so when a < 1 every
    iterate obeys ‖y_t‖∞ ≤ max(‖z0‖∞, β2(α1^(2N)‖x‖∞ + c_f)/(1 − a)), c_f the largest sub-layer output."""
    torch.manual_seed(0)
    stable = FPRMForReasoning(tiny_fprm_config(init_std=6.0)).eval()
    n = 2 * stable.config.num_hidden_layers
    a1, a2 = stable.config.alpha1, stable.config.alpha2  # at init, the same in every channel
    beta2 = 1 - a2 * a1**n
    c = float(stable.model.conv.weight.detach().abs().sum(dim=(1, 2, 3)).max())
    a = c * a2 * a1**n
    assert a < 1
    norms, x_norm, c_f = _run_loops(stable, 500)
    bound = max(norms[0], beta2 * (a1**n * x_norm + c_f) / (1 - a))
    assert all(math.isfinite(v) and v <= bound * (1 + 1e-5) for v in norms)

    torch.manual_seed(0)
    plain = FPRMForReasoning(tiny_fprm_config(residual_scaling="none", init_std=6.0)).eval()
    plain_norms, plain_x, plain_f = _run_loops(plain, 500)
    assert plain_norms[-1] > 10 * max(plain_norms[0], plain_x + plain_f)  # far outside what a scaled model obeys
    assert plain_norms[-1] > 3 * plain_norms[100]  # and still growing


def test_non_finite_residual_stops_and_flags_that_sample_only():
    model = tiny_fprm(seed=1).model
    ids = grid_inputs(3, seed=3)
    with torch.no_grad():
        clean = model(ids, halt_eps=0.05, max_loops=100)
        bad_x = model.embed(ids[1:2])
    original = model.fixed_point_map
    calls = {"n": 0}

    def sabotaged(y, x, pe=None):
        out = original(y, x, pe)
        calls["n"] += 1
        if calls["n"] == 3:  # the third iteration of sample 1 blows up
            hit = (x - bad_x).abs().amax(dim=(1, 2)) == 0
            out = out.masked_fill(hit[:, None, None], float("nan"))
        return out

    model.fixed_point_map = sabotaged
    with torch.no_grad():
        out = model(ids, halt_eps=0.05, max_loops=100, output_residual_trace=True)
    assert out.diverged.tolist() == [False, True, False]
    assert not out.converged[1] and int(out.iterations[1]) == 3
    assert torch.isinf(out.residuals[1])
    for t in (out.last_hidden_state, out.residual_trace, out.solver_state.hidden):
        assert not torch.isnan(t).any()
    # the other samples are untouched by their neighbour's failure
    for row in (0, 2):
        assert int(out.iterations[row]) == int(clean.iterations[row])
        torch.testing.assert_close(out.last_hidden_state[row], clean.last_hidden_state[row])


def test_non_finite_weights_give_finite_logits_and_a_flag():
    model = tiny_fprm(seed=1)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
        out = model(grid_inputs(2), max_loops=10)
    assert out.diverged.all() and not torch.isnan(out.logits).any()


# ---- 8. bad input -------------------------------------------------------------------------------------------------


def test_the_values_of_removed_options_that_the_model_computes_still_load(tmp_path):
    """config.json files of earlier 0.1.0 builds hold `conv_placement="state"` and `final_norm=False` (what the model
    computes today): they load, and the keys are dropped (any other value is a row of the refusal table)."""
    config = tiny_fprm_config(conv_placement="state", final_norm=False)
    assert not hasattr(config, "conv_placement") and not hasattr(config, "final_norm")
    FPRMForReasoning(tiny_fprm_config()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "conv_placement": "state", "final_norm": False}))
    loaded = FPRMForReasoning.from_pretrained(tmp_path).config
    assert not hasattr(loaded, "conv_placement") and not hasattr(loaded, "final_norm")


def test_labels_all_ignored_give_a_nan_loss_as_cross_entropy():
    # the refusals of bad labels, identifiers and ids are rows of tests/support/bad_input_table.py
    assert tiny_fprm()(grid_inputs(2), labels=torch.full((2, 16), -100)).loss.isnan()
    assert FPRMSolverState  # exported for users who carry states between calls


def test_a_carried_solver_state_is_judged_by_the_calls_halting_rule():
    """A state that halted under one halt_eps continues under another call's rule: a lower halt_eps (or
    halting=False) reopens its rows, and `converged` means "residual below this call's halt_eps" (it used to keep
    the old flags: 0 iterations, converged=True at residuals far above the new halt_eps)."""
    model = tiny_fprm().eval()
    ids = grid_inputs(3)
    state = model(ids, halt_eps=0.5).solver_state
    assert state.halted.all() and (state.residuals > 1e-4).all()
    tighter = model(ids, halt_eps=1e-4, max_loops=5, solver_state=state)
    assert (tighter.iterations == 5).all()
    assert torch.equal(tighter.converged, tighter.residuals < 1e-4)
    assert (model(ids, halting=False, max_loops=4, solver_state=state).iterations == 4).all()
    assert (model(ids, halt_eps=0.5, solver_state=state).iterations == 0).all()  # the same rule: still halted


def test_tie_word_embeddings_ties_the_head_to_the_embeddings(tmp_path):
    """`tie_word_embeddings=True` was accepted and did nothing; the default stays untied (the authors' head)."""
    tied = tiny_fprm(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    tied.save_pretrained(tmp_path)
    loaded = FPRMForReasoning.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, tied.lm_head.weight)
    untied = tiny_fprm()
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_inputs_embeds_stand_in_for_the_token_embeddings():
    """As transformers models: `inputs_embeds` = `get_input_embeddings()(input_ids)` gives the same result; exactly
    one of the two is needed; `output_attentions` is taken as None / False only."""
    model = tiny_fprm().eval()
    ids = grid_inputs(2)
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(
        model(inputs_embeds=embeds, labels=ids).logits, model(ids, labels=ids).logits, rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="exactly one of `input_ids` or `inputs_embeds`"):
        model(ids, inputs_embeds=embeds)
    with pytest.raises(ValueError, match="`inputs_embeds` must be a float tensor of shape"):
        model(inputs_embeds=embeds[..., :-1])
    with pytest.raises(ValueError, match="reads 4x4 grids"):
        model(inputs_embeds=embeds[:, :-1])
    assert model(ids, output_attentions=False).logits.shape == (2, 16, model.config.vocab_size)
    with pytest.raises(ValueError, match="`output_attentions` must be None or False, got True"):
        model(ids, output_attentions=True)


def test_lora_with_the_token_classification_task_type_trains():
    """PEFT's TOKEN_CLS wrapper (the model is registered as AutoModelForTokenClassification) passes `inputs_embeds`
    and `output_attentions`: it used to fail with an unexpected keyword argument."""
    from peft import LoraConfig, get_peft_model

    model = tiny_fprm()
    peft_model = get_peft_model(model, LoraConfig(target_modules=["qkv_proj", "o_proj"], task_type="TOKEN_CLS"))
    ids = grid_inputs(2)
    out = peft_model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert all(p.grad is not None for n, p in peft_model.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("layout, bound", [("grid", 2.0), ("sequence", 5.0)])
def test_half_precision_computes_the_fp32_function_up_to_rounding(layout, bound):
    """FPRM's norms use a fixed eps (`rms_norm_eps`, 1e-5, never the dtype's machine epsilon; None is refused), so a
    trained-like model (block inputs of mean square ~0.02, where a bf16 eps of 7.8e-3 would change the function) cast
    to bf16 or fp16 stays close to what autocast (the authors' training precision) makes: within 2x on a grid model;
    the causal sequence layout, whose whole state is rounded to bf16 at every loop where autocast keeps it in fp32,
    within 5x (printed: ~3.7x bf16, ~2.6x fp16)."""
    import copy

    overrides = (
        {}
        if layout == "grid"
        else dict(
            grid_size=None, conv_type="causal_1d", causal=True, position_embedding_type="none", num_prefix_tokens=0
        )
    )
    model = tiny_fprm(0, init_std=0.15, **overrides)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.15)
        if model.model.prefix is not None:
            model.model.prefix.normal_(0, 0.15 / 32**0.5)
    ids = grid_inputs(batch=4)
    assert abs(float(model.model.embed(ids).pow(2).mean()) - 0.02) < 0.01
    run = lambda m: m(ids, max_loops=6, halting=False).logits.float()  # noqa: E731
    with torch.no_grad():
        reference = run(model)
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", dtype=dtype):
                autocast = float((run(model) - reference).abs().max())
            cast = float((run(copy.deepcopy(model).to(dtype)) - reference).abs().max())
            print(f"{layout} {dtype}: cast {cast:.4f}, autocast {autocast:.4f}, ratio {cast / autocast:.2f}")
            assert 0 < cast <= bound * autocast, f"{dtype}: cast {cast:.4f} vs autocast {autocast:.4f}"
    with pytest.raises(StrictDataclassError, match="rms_norm_eps"):
        tiny_fprm_config(rms_norm_eps=None)
