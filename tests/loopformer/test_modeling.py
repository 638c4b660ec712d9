"""Config, architecture, baselines as configurations, elastic inference, standard args."""

import copy
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from support.tiny_models import cache_of, randomize_modulation, tiny_loopformer_config
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import loopformer_hf
from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM, LoopFormerModel, trajectory_loopformer

# ---- configuration ---------------------------------------------------------------------------------------------


def test_config_uses_transformers_standard_names():
    cfg = tiny_loopformer_config()
    for name in (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "hidden_act",
        "num_hidden_layers",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rms_norm_eps",
        "num_loops",
        "loop_conditioning",
        "use_cache",
    ):
        assert hasattr(cfg, name), name
    assert cfg.model_type == "loopformer"
    assert cfg.num_key_value_heads == cfg.num_attention_heads


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_loops", 0),
        ("num_hidden_layers", -1),
        ("hidden_size", 65),
        ("num_key_value_heads", 3),
        ("loop_conditioning", "adaptive"),
        ("position_embedding_type", "alibi"),
        ("hidden_act", "nope"),
        ("rms_norm_eps", -1.0),
        ("default_step_schedule", "zigzag"),
        ("default_loop_budget", 0),
        ("num_loops", True),
        ("attention_dropout", 2.0),
        ("initializer_scheme", "xavier"),
        ("block_norm_weight", "yes"),
    ],
)
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(StrictDataclassError, match=field):
        tiny_loopformer_config(**{field: value})


def test_config_error_names_the_initializer_schemes():
    with pytest.raises(
        StrictDataclassError, match=r"(?s)initializer_scheme.*\('reference', 'zero_adaln'\), got xavier"
    ):
        tiny_loopformer_config(initializer_scheme="xavier")


def test_config_round_trips(tmp_path):
    cfg = tiny_loopformer_config(loop_conditioning="timestep", position_embedding_type="rope", hidden_act="swiglu")
    cfg.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, LoopFormerConfig)
    strip = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert strip(loaded.to_dict()) == strip(cfg.to_dict())


# ---- architecture ----------------------------------------------------------------------------------------------


def test_architecture_matches_spec(tiny_config):
    model = LoopFormerForCausalLM(tiny_config)
    blocks = model.model.layers
    assert len(blocks) == tiny_config.num_hidden_layers  # k shared blocks, not k*L
    for block in blocks:
        assert block.adaLN_modulation[1].out_features == 4 * tiny_config.hidden_size
    cond = model.model.loop_conditioning
    assert cond.time_embedder.mlp[0].in_features == 256 and cond.dt_embedder.mlp[0].in_features == 256
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert [n for n, _ in model.model.norm.named_parameters()] == ["weight"]
    assert not any("norm" in n for n, _ in blocks[0].named_parameters())  # block norms have no weight


def test_zero_init_gates_make_the_loops_an_identity():
    model = LoopFormerForCausalLM(tiny_loopformer_config(initializer_scheme="zero_adaln")).eval()
    ids = torch.randint(3, 97, (1, 7))
    out = model(ids, output_hidden_states=True)
    for h in out.hidden_states[1:]:
        torch.testing.assert_close(h, out.hidden_states[0])


# ---- initialisation --------------------------------------------------------------------------------------------

SIGMA = 0.02


def _expected_init(name, scheme, k):
    """(mean, std) of a fresh parameter under each scheme, written from the authors' code: their model-level init
    (every Linear N(0, σ), zero bias; embeddings N(0, σ)) runs after the blocks' adaLN zero-init and overwrites it,
    then every `c_proj.weight` (attention and MLP output) is re-drawn N(0, σ/√(2·n_layer)), n_layer = shared
    blocks."""
    if name.endswith("bias"):
        return 0.0, 0.0
    if "norm" in name:
        return 1.0, 0.0
    if "adaLN_modulation" in name and scheme == "zero_adaln":
        return 0.0, 0.0
    if scheme == "reference" and name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, SIGMA / math.sqrt(2 * k)
    return 0.0, SIGMA


@pytest.mark.parametrize("scheme", ["reference", "zero_adaln"])
@pytest.mark.parametrize("conditioning", ["shortcut", "timestep", "none"])
def test_fresh_model_init_statistics_follow_the_scheme(scheme, conditioning):
    """Per parameter: mean and std within 5% of the rule (≥ 8k draws each: the sample std's own spread is < 1%)."""
    k = 3
    config = tiny_loopformer_config(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_hidden_layers=k,
        num_loops=4,
        vocab_size=128,
        max_position_embeddings=64,
        pad_token_id=None,
        attention_bias=True,
        mlp_bias=True,
        loop_conditioning=conditioning,
        block_norm_weight=conditioning == "none",
        initializer_scheme=scheme,
    )
    torch.manual_seed(0)
    model = LoopFormerForCausalLM(config)
    assert config.initializer_range == SIGMA
    seen = set()
    for name, param in model.named_parameters():
        mean, std = _expected_init(name, scheme, k)
        seen.add((mean, std))
        if std == 0.0:
            assert torch.all(param == mean), name
        else:
            assert abs(param.mean().item()) < 0.05 * std, name
            assert param.std().item() == pytest.approx(std, rel=0.05), name
    # what each configuration must contain: residual projections (and, with conditioning, adaLN)
    assert (0.0, SIGMA / math.sqrt(2 * k) if scheme == "reference" else SIGMA) in seen
    assert (1.0, 0.0) in seen and (0.0, 0.0) in seen
    if conditioning != "none":
        adaln = model.model.layers[0].adaLN_modulation[1].weight
        assert (torch.count_nonzero(adaln) == 0) == (scheme == "zero_adaln")


def test_default_init_is_the_reference_and_opens_the_gates(tiny_config):
    """The default scheme's adaLN is non-zero, so the loops are no longer an identity at init."""
    assert tiny_config.initializer_scheme == "reference"
    torch.manual_seed(0)
    model = LoopFormerForCausalLM(tiny_config).eval()
    out = model(torch.randint(3, 97, (1, 7)), output_hidden_states=True)
    assert (out.hidden_states[1] - out.hidden_states[0]).abs().max() > 1e-4


def test_block_norm_weight_adds_learnable_block_norms():
    plain = LoopFormerModel(tiny_loopformer_config(loop_conditioning="none"))
    weighted = LoopFormerModel(tiny_loopformer_config(loop_conditioning="none", block_norm_weight=True))
    assert not any("layernorm" in n for n, _ in plain.named_parameters())
    names = [n for n, _ in weighted.layers[0].named_parameters() if "layernorm" in n]
    assert names == ["input_layernorm.weight", "post_attention_layernorm.weight"]
    weighted.load_state_dict(plain.state_dict(), strict=False)
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(weighted(ids).last_hidden_state, plain(ids).last_hidden_state)  # weight 1 = none
        weighted.layers[0].post_attention_layernorm.weight.mul_(2.0)
        assert not torch.allclose(weighted(ids).last_hidden_state, plain(ids).last_hidden_state)


@pytest.mark.parametrize("conditioning", ["shortcut", "none"])
def test_weighted_block_norms_in_cached_adaptive_decode(conditioning):
    """With halting and halt_kv_fill="recompute", the slots of halted tokens are projected through the block's
    attention norm, its weight included: cached decoding still equals the uncached forward."""
    torch.manual_seed(0)
    config = tiny_loopformer_config(loop_conditioning=conditioning, block_norm_weight=True, halt_kv_fill="recompute")
    model = randomize_modulation(LoopFormerForCausalLM(config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.copy_(1 + 0.5 * torch.randn_like(param))
    ids, eps = torch.randint(3, 97, (2, 24)), 0.5
    with torch.no_grad():
        full = model(ids, halt_eps=eps, use_cache=False)
        assert full.loop_counts.min() < full.loop_counts.max(), "test needs tokens that halt at different steps"
        out = model(ids[:, :8], halt_eps=eps)
        logits, cache = [out.logits], cache_of(out)
        for i in range(8, ids.shape[1]):
            out = model(ids[:, i : i + 1], cache=cache, halt_eps=eps)
            logits.append(out.logits)
            cache = cache_of(out)
    torch.testing.assert_close(torch.cat(logits, 1), full.logits, atol=1e-5, rtol=0)


def test_block_applies_gates_and_scales_in_spec_order(tiny_config):
    torch.manual_seed(0)
    block = loopformer_hf.modeling_loopformer.LoopFormerBlock(tiny_config, 0).eval()
    d = tiny_config.hidden_size
    x, c = torch.randn(1, 5, d), torch.randn(d)  # one conditioning vector per loop step, shared by every token
    with torch.no_grad():
        block.adaLN_modulation[1].weight.normal_(0, 0.1)
        block.adaLN_modulation[1].bias.normal_(0, 0.1)
    gate_attn, gate_mlp, scale_attn, scale_mlp = block.adaLN_modulation(c).chunk(4, -1)
    norm = lambda v: torch.nn.functional.rms_norm(v, (d,))  # noqa: E731
    attn, _ = block.self_attn(norm(x) * (1 + scale_attn), None, None)
    h = x + gate_attn * attn
    expected = h + gate_mlp * block.mlp(norm(h) * (1 + scale_mlp))
    got = block(x, c)
    torch.testing.assert_close(got, expected)


def test_conditioning_depends_on_t_and_delta(tiny_model):
    cond = tiny_model.model.loop_conditioning
    for mlp in (cond.time_embedder.mlp, cond.dt_embedder.mlp):
        torch.nn.init.normal_(mlp[2].weight, std=0.1)
    a = cond((0.5, 0.25, 0.25), "cpu", torch.float32)
    b = cond((0.25, 0.25, 0.5), "cpu", torch.float32)
    assert a.shape == (3, 64)
    torch.testing.assert_close(a[1], b[1] + (a[1] - b[1]))  # shapes sane
    assert not torch.allclose(a[0], b[0])  # same t=0, different Δ
    assert not torch.allclose(a[2], b[2])  # different t and Δ


# ---- baselines are configurations ------------------------------------------------------------------------------


def test_baselines_are_configurations_of_one_model():
    base_loop = LoopFormerModel(tiny_loopformer_config(loop_conditioning="none"))
    assert not hasattr(base_loop.loop_conditioning, "time_embedder")
    assert not hasattr(base_loop.layers[0], "adaLN_modulation")
    tmlt = LoopFormerModel(tiny_loopformer_config(loop_conditioning="timestep"))
    assert hasattr(tmlt.loop_conditioning, "time_embedder") and not hasattr(tmlt.loop_conditioning, "dt_embedder")
    iso = LoopFormerModel(tiny_loopformer_config(loop_conditioning="none", num_hidden_layers=8, num_loops=1))
    assert len(iso.layers) == 8
    ids = torch.randint(3, 97, (1, 6))
    assert len(iso(ids, output_hidden_states=True).hidden_states) == 2  # one loop over k*L blocks


def test_timestep_conditioning_ignores_delta_but_rejects_nonuniform_schedules():
    model = randomize_modulation(LoopFormerForCausalLM(tiny_loopformer_config(loop_conditioning="timestep")))
    ids = torch.randint(3, 97, (1, 6))
    model(ids, loop_budget=2)
    with pytest.raises(ValueError, match="needs loop_conditioning='shortcut'"):
        model(ids, step_schedule=[0.75, 0.25])


# ---- elastic inference -----------------------------------------------------------------------------------------


def test_budget_changes_the_number_of_loop_steps(tiny_model):
    ids = torch.randint(3, 97, (1, 6))
    calls = []
    hook = tiny_model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    for budget in (1, 2, 4):
        calls.clear()
        out = tiny_model(ids, loop_budget=budget, output_hidden_states=True)
        assert len(calls) == budget and len(out.hidden_states) == budget + 1
    hook.remove()
    assert not torch.allclose(tiny_model(ids, loop_budget=1).logits, tiny_model(ids, loop_budget=4).logits)


def test_schedule_changes_the_output_and_alone_sets_the_budget(tiny_model):
    ids = torch.randint(3, 97, (1, 6))
    a = tiny_model(ids, step_schedule=[0.75, 0.25], output_hidden_states=True)
    b = tiny_model(ids, step_schedule=[0.25, 0.75], output_hidden_states=True)
    assert len(a.hidden_states) == 3
    assert not torch.allclose(a.logits, b.logits)


def test_defaults_come_from_the_config():
    model = randomize_modulation(LoopFormerForCausalLM(tiny_loopformer_config(default_loop_budget=2)))
    ids = torch.randint(3, 97, (1, 6))
    torch.testing.assert_close(model(ids).logits, model(ids, loop_budget=2).logits)
    assert model.config.resolve_trajectory() == (0.5, 0.5)


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("preset", ["uniform", "coarse_to_fine", "fine_to_coarse"])
def test_presets_are_valid_trajectories(budget, preset):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps = tiny_loopformer_config().resolve_trajectory(budget, preset)
    assert len(steps) == budget and math.isclose(sum(steps), 1.0, abs_tol=1e-9) and min(steps) > 0
    if preset == "coarse_to_fine":
        assert list(steps) == sorted(steps, reverse=True)
    if preset == "fine_to_coarse":
        assert list(steps) == sorted(steps)
    if budget <= 4 and preset != "uniform":  # on the 1/L grid inside the training distribution
        assert all(abs(s * 4 - round(s * 4)) < 1e-9 for s in steps)


BAD_BUDGETS = [0, -1, 2.0, 1.5, True, float("nan"), "3", {2}, None.__class__]  # a list gives one budget per row


@pytest.mark.parametrize("budget", BAD_BUDGETS)
def test_bad_budgets_raise_value_error_naming_the_value(tiny_model, budget):
    with pytest.raises(ValueError, match=r"`loop_budget` must be an integer >= 1, got") as info:
        tiny_model(torch.randint(3, 97, (1, 4)), loop_budget=budget)
    assert repr(budget) in str(info.value)


BAD_SCHEDULES = [
    [],
    [0.5, 0.6],
    [1.0, 0.0],
    [1.5, -0.5],
    [float("nan"), 1.0],
    [True],
    "zigzag",
    0.5,
    ["a", 1],
    [0.5, float("inf")],
    {"a": 1},
]


@pytest.mark.parametrize("schedule", BAD_SCHEDULES)
def test_bad_schedules_raise_value_error(tiny_model, schedule):
    with pytest.raises(ValueError, match="step_schedule"):
        tiny_model(torch.randint(3, 97, (1, 4)), step_schedule=schedule)


def test_budget_that_disagrees_with_schedule_length_raises(tiny_model):
    with pytest.raises(ValueError, match="disagrees"):
        tiny_model(torch.randint(3, 97, (1, 4)), loop_budget=3, step_schedule=[0.5, 0.5])


def test_schedule_tolerance_is_1e_6(tiny_config):
    tiny_config.resolve_trajectory(step_schedule=[0.5, 0.5 + 5e-7])
    with pytest.raises(ValueError):
        tiny_config.resolve_trajectory(step_schedule=[0.5, 0.5 + 5e-6])


def test_extrapolation_warns_once(tiny_model, monkeypatch):
    monkeypatch.setattr(trajectory_loopformer, "_warned_trajectories", set())
    ids = torch.randint(3, 97, (1, 4))
    for kwargs in ({"loop_budget": 6}, {"step_schedule": [0.3, 0.7]}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tiny_model(ids, **kwargs)
            tiny_model(ids, **kwargs)
        assert len([w for w in caught if "extrapolates" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny_model(ids, loop_budget=2)  # on the grid: silent


def test_generate_takes_budget_and_schedule_kwargs(tiny_model):
    ids = torch.randint(3, 97, (1, 5))
    seen = []
    hook = tiny_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw.get("loop_budget"), kw.get("step_schedule"))), with_kwargs=True
    )
    tiny_model.generate(ids, max_new_tokens=3, do_sample=False, loop_budget=4, step_schedule=[0.4, 0.3, 0.2, 0.1])
    hook.remove()
    assert seen == [(4, [0.4, 0.3, 0.2, 0.1])] * 3
    with pytest.raises(ValueError, match="loop_budget"):
        tiny_model.generate(ids, max_new_tokens=2, loop_budget=0)


def test_out_of_vocabulary_ids_raise(tiny_model):
    with pytest.raises(ValueError, match=r"input_ids.*\[0, 96\]"):
        tiny_model(torch.tensor([[5, 97]]))


# ---- standard transformers behaviour -----------------------------------------------------------------------------


def test_auto_classes_are_registered(tiny_config, tmp_path):
    assert type(AutoModelForCausalLM.from_config(tiny_config)) is LoopFormerForCausalLM
    assert type(AutoModel.from_config(tiny_config)) is LoopFormerModel
    model = randomize_modulation(LoopFormerForCausalLM(tiny_config)).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 97, (1, 6))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_saved_folder_loads_with_trust_remote_code_without_the_package(tiny_model, tmp_path):
    """The folder carries the model's files alone (no loader of the authors' layout, converter or vLLM module) and
    loads from them where the package cannot be imported."""
    tiny_model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.py")) == [
        "cache_loopformer.py",
        "configuration_loopformer.py",
        "generation_loopformer.py",
        "halting_loopformer.py",
        "looped_common.py",
        "loss_loopformer.py",
        "modeling_loopformer.py",
        "trajectory_loopformer.py",
    ]
    # the common file as a file, not the package's link to common/ (which would not travel with the folder)
    assert not (tmp_path / "looped_common.py").is_symlink()
    ids = torch.randint(3, 97, (1, 6))
    expected = tiny_model(ids, loop_budget=3, step_schedule=[0.5, 0.25, 0.25]).logits
    torch.save({"ids": ids, "expected": expected}, tmp_path / "check.pt")
    script = f"""
import sys
sys.modules["loopformer_hf"] = None  # the package cannot be imported in this process
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
data = torch.load({str(tmp_path / "check.pt")!r})
got = model(data["ids"], loop_budget=3, step_schedule=[0.5, 0.25, 0.25]).logits
torch.testing.assert_close(got, data["expected"])
out = model.generate(data["ids"], max_new_tokens=4, do_sample=False, loop_budget=2)
print("OK", tuple(out.shape))
"""
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert "OK (1, 10)" in res.stdout, res.stderr[-3000:]


def test_sdpa_and_eager_agree_with_padding(tiny_config):
    torch.manual_seed(0)
    sdpa = randomize_modulation(
        LoopFormerForCausalLM._from_config(copy.deepcopy(tiny_config), attn_implementation="sdpa")
    ).eval()
    eager = LoopFormerForCausalLM._from_config(copy.deepcopy(tiny_config), attn_implementation="eager").eval()
    eager.load_state_dict(sdpa.state_dict())
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    a = sdpa(ids, attention_mask=mask).logits
    b = eager(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()


def test_output_attentions_one_per_step_and_block(tiny_model):
    out = tiny_model(torch.randint(3, 97, (1, 5)), loop_budget=3, output_attentions=True)
    assert len(out.attentions) == 3 * 2 and out.attentions[0].shape == (1, 4, 5, 5)


def test_return_dict_false_and_logits_to_keep(tiny_model):
    ids = torch.randint(3, 97, (1, 5))
    tup = tiny_model(ids, labels=ids, return_dict=False, use_cache=False)
    assert isinstance(tup, tuple) and tup[0].ndim == 0
    assert tiny_model(ids, logits_to_keep=1).logits.shape == (1, 1, 97)


def test_inputs_embeds_equals_input_ids(tiny_model):
    ids = torch.randint(3, 97, (1, 5))
    emb = tiny_model.get_input_embeddings()(ids)
    torch.testing.assert_close(tiny_model(inputs_embeds=emb).logits, tiny_model(ids).logits)


def test_loss_matches_shifted_cross_entropy_and_ignores_minus_100(tiny_model):
    ids = torch.randint(3, 97, (2, 7))
    labels = ids.clone()
    labels[:, :2] = -100
    out = tiny_model(ids, labels=labels)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_config):
    torch.manual_seed(0)
    model = randomize_modulation(LoopFormerForCausalLM(tiny_config)).train()
    ids = torch.randint(3, 97, (2, 8))
    model(ids, labels=ids, loop_budget=3, step_schedule=[0.5, 0.25, 0.25]).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    model(ids, labels=ids, loop_budget=3, step_schedule=[0.5, 0.25, 0.25]).loss.backward()
    for n, g in ref.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, atol=1e-6, rtol=1e-5, msg=n)
    assert any("adaLN" in n for n in ref) and any("dt_embedder" in n for n in ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope", [False, True])
def test_half_precision_runs_without_nan(tiny_config, dtype, rope):
    if rope:
        tiny_config = tiny_loopformer_config(position_embedding_type="rope", hidden_act="swiglu")
    torch.manual_seed(0)
    model = randomize_modulation(LoopFormerForCausalLM(tiny_config)).to(dtype).eval()
    ids = torch.randint(3, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    out = model(ids, attention_mask=mask, labels=ids, loop_budget=4)
    assert out.logits.dtype == dtype and torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, loop_budget=2, pad_token_id=0)
    assert gen.shape == (2, 17)


def test_rope_and_gqa_variants_cache_correctly():
    torch.manual_seed(0)
    cfg = tiny_loopformer_config(position_embedding_type="rope", num_key_value_heads=2, hidden_act="swiglu")
    model = randomize_modulation(LoopFormerForCausalLM(cfg)).eval()
    ids = torch.randint(3, 97, (1, 12))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :6])
    pieces = [out.logits]
    for i in range(6, 12):
        out = model(ids[:, i : i + 1], cache=cache_of(out))
        pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)


def test_learned_positions_beyond_the_table_raise(tiny_model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_model(torch.randint(3, 97, (1, 129)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_computes_what_autocast_computes(dtype):
    """`rms_norm_eps=None` is float32's eps in every dtype, as the reference's norms see it under autocast: taken
    from the input dtype, a bf16 model added 7.8e-3 to a mean square of about 0.02 (a trained model's) and its
    logits moved far beyond the autocast difference."""
    model = randomize_modulation(LoopFormerForCausalLM(tiny_loopformer_config())).eval()
    with torch.no_grad():  # trained-like: block inputs of mean square ~0.02
        model.model.embed_tokens.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
        model.model.embed_positions.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fp32 = model(ids).logits
        with torch.autocast("cpu", dtype=dtype):
            autocast = model(ids).logits.float()
        cast = copy.deepcopy(model).to(dtype)(ids).logits.float()
    autocast_error = (autocast - fp32).abs().max()
    assert autocast_error > 0  # the comparison has a scale
    assert (cast - fp32).abs().max() <= 2 * autocast_error


def test_the_untrained_trajectory_warning_says_what_is_true_for_the_variant(monkeypatch):
    """LoopFormer interpolates Δ: a uniform budget M <= L (the README's loop_budget=2 on the Quickstart's L=3) is
    silent. Base-Loop and TMLT have no Δ: every M != L, on the 1/L grid or not, is a loop count never run, said once
    per trajectory with the variant's name."""
    from support.tiny_models import tiny_loopformer_config

    def tiny_loopformer(**overrides):
        return loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(**overrides)).eval()

    monkeypatch.setattr(trajectory_loopformer, "_warned_trajectories", set())
    ids = torch.randint(3, 97, (1, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny_loopformer(num_loops=3)(ids, loop_budget=2)
    for conditioning, variant in (("none", "Base-Loop"), ("timestep", "TMLT")):
        model = tiny_loopformer(num_loops=8, loop_conditioning=conditioning, block_norm_weight=conditioning == "none")
        for budget in (2, 3, 4):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model(ids, loop_budget=budget)
                model(ids, loop_budget=budget)
            said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
            assert said == [
                f"{variant} was trained at exactly num_loops=8 loop steps and has no step-size "
                f"conditioning to interpolate: loop_budget={budget} is a loop count it never ran."
            ], said
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(ids, loop_budget=8)


def _files_the_forward_enters(model, **kwargs):
    """The package files that `LoopFormerModel.forward`'s own calls enter, in order (consecutive calls into one file
    merged; calls into its own file and what its callees call are left out): the trip of `input_ids` through it."""
    import os
    import sys

    package = os.path.dirname(loopformer_hf.__file__)
    trip = []

    def is_forward(frame):
        code = frame.f_code
        return code.co_name == "forward" and type(frame.f_locals.get("self")) is loopformer_hf.LoopFormerModel

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(package):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(package):
            caller = caller.f_back  # through torch's Module.__call__
        name = os.path.basename(frame.f_code.co_filename)
        if caller is not None and is_forward(caller) and name != "modeling_loopformer.py" and trip[-1:] != [name]:
            trip.append(name)

    sys.setprofile(profile)
    try:
        with torch.no_grad():
            model.model(torch.randint(3, 97, (2, 6)), **kwargs)
    finally:
        sys.setprofile(None)
    return trip


@pytest.mark.parametrize(
    "kwargs, files",
    [
        ({}, ["cache_loopformer.py"]),
        ({"loop_budget": [1, 2]}, ["cache_loopformer.py"]),
        ({"use_cache": False}, []),
        ({"halt_eps": 0.1}, ["trajectory_loopformer.py", "cache_loopformer.py", "halting_loopformer.py"]),
    ],
    ids=["default", "per_row", "no_cache", "halting"],
)
def test_the_forward_reads_top_to_bottom(tiny_model, kwargs, files):
    """As Llama's: inputs, the loop's trajectory, the cache (a new one, bound to the call's loop: the cache file),
    positions and mask, the loop, the final norm; with `halt_eps` the loop is halting's. Each file entered once."""
    assert _files_the_forward_enters(tiny_model, **kwargs) == files
