"""Every FPRMConfig value validated however it arrives (booleans strict), strict forward flags,
and `output_hidden_states` / `attention_mask` accepted as transformers models do."""

import pytest
import torch
from transformers import AutoModelForTokenClassification

from fprm_hf import FPRMConfig, FPRMForReasoning

from support.config_helpers import assert_refused_however_it_arrives
from support.bad_input_table import CASES
from support.tiny_models import grid_inputs, sequence_fprm_config, tiny_fprm, tiny_fprm_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fprm")
    tiny_fprm().save_pretrained(path)
    return path


# ---- config: every value validated however it arrives -----------------------------------------------------------

# the FPRM config rows of the refusal table (tests/support/bad_input_table.py), each run however the value arrives
BAD_VALUES = [(*case.setting, case.message) for case in CASES if case.area == "FPRM config" and case.setting]


@pytest.mark.parametrize("field,value,message", BAD_VALUES)
def test_bad_config_value_refused_however_it_arrives(checkpoint, tmp_path, field, value, message):
    assert_refused_however_it_arrives(
        tiny_fprm_config,
        FPRMForReasoning,
        AutoModelForTokenClassification,
        checkpoint,
        tmp_path,
        field,
        value,
        message,
    )


def test_good_values_still_set_and_grid_size_normalised(checkpoint):
    config = tiny_fprm_config()
    config.grid_size = 5  # a square grid, read as (5, 5)
    assert config.grid_shape == (5, 5) and config.num_grid_tokens == 25
    assert FPRMConfig(conv_type="2d", grid_size=5).grid_size == [5, 5]  # a constructed config holds [height, width]
    config.causal = True
    assert config.causal is True
    model = FPRMForReasoning.from_pretrained(checkpoint, max_loops=3)
    assert model.config.max_loops == 3


# ---- output_hidden_states ------------------------------------------------------------------------------------------


def test_output_hidden_states_are_the_solver_iterates():
    model = tiny_fprm()
    ids = grid_inputs(3)
    with torch.no_grad():
        out = model(ids, max_loops=5, halting=False, output_hidden_states=True)
        three = model(ids, max_loops=3, halting=False)
        plain = model(ids, max_loops=5, halting=False)
    assert isinstance(out.hidden_states, tuple) and len(out.hidden_states) == 6  # z0 + one per iteration
    assert all(h.shape == (3, 2 + 16, 32) for h in out.hidden_states)  # prefix rows included
    torch.testing.assert_close(out.hidden_states[0], model.model.initial_z(model.model.embed(ids)))
    torch.testing.assert_close(out.hidden_states[3], three.solver_state.hidden)
    torch.testing.assert_close(out.hidden_states[-1], out.solver_state.hidden)
    torch.testing.assert_close(out.logits, plain.logits)  # asking for them changes nothing
    assert plain.hidden_states is None
    assert model.model(ids, max_loops=2, output_hidden_states=True).hidden_states[-1].shape == (3, 18, 32)


def test_output_hidden_states_of_halted_samples_repeat_their_final_state():
    model = tiny_fprm()
    ids = grid_inputs(4)
    with torch.no_grad():
        out = model(ids, halt_eps=0.6, max_loops=30, output_hidden_states=True)
    assert out.iterations.min() < out.iterations.max(), "test needs samples that halt at different iterations"
    assert len(out.hidden_states) == int(out.iterations.max()) + 1
    for row, k in enumerate(out.iterations.tolist()):
        for later in out.hidden_states[k:]:
            assert torch.equal(later[row], out.hidden_states[k][row])


def test_output_fields_keep_their_order_with_the_solver_fields_declared_once():
    """Both outputs take the solver's fields from one declaration (`FPRMSolverOutputMixin`), between their leading
    fields and their own: the order their fields and `to_tuple()` have always had."""
    from dataclasses import fields

    from fprm_hf import FPRMModelOutput, FPRMReasoningOutput
    from fprm_hf.outputs_fprm import FPRMSolverOutputMixin

    solver = ["iterations", "residuals", "converged", "diverged", "residual_trace", "solver_state", "hidden_states"]
    assert [f.name for f in fields(FPRMSolverOutputMixin)] == solver
    assert [f.name for f in fields(FPRMModelOutput)] == ["last_hidden_state", *solver]
    assert [f.name for f in fields(FPRMReasoningOutput)] == ["loss", "logits", *solver, "q_halt_logits"]
    model = tiny_fprm(use_q_head=True)
    with torch.no_grad():
        out = model(grid_inputs(1), labels=grid_inputs(1), max_loops=2, output_residual_trace=True)
    assert list(out.keys()) == ["loss", "logits", *solver[:-1], "q_halt_logits"]
    assert all(a is b for a, b in zip(out.to_tuple(), out.values()))


def test_output_hidden_states_from_config_and_in_tuple_output():
    model = tiny_fprm(output_hidden_states=True)
    with torch.no_grad():
        out = model(grid_inputs(1), max_loops=2, halting=False)
        as_tuple = model(grid_inputs(1), max_loops=2, halting=False, return_dict=False)
    assert len(out.hidden_states) == 3
    assert isinstance(as_tuple[-1], tuple) and len(as_tuple[-1]) == 3


# ---- attention_mask ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [tiny_fprm_config, sequence_fprm_config])
def test_all_ones_attention_mask_is_accepted_and_changes_nothing(config):
    model = tiny_fprm(config=config())
    ids = grid_inputs(2)
    with torch.no_grad():
        plain = model(ids, max_loops=4).logits
        masked = model(ids, attention_mask=torch.ones_like(ids), max_loops=4).logits
    torch.testing.assert_close(masked, plain)


@pytest.mark.parametrize("config", [tiny_fprm_config, sequence_fprm_config])
def test_padded_attention_mask_is_refused(config):
    # attention, the conv and the halting residual read every token (the authors' fixed-length grids): a padded
    # position would change the real ones, so the mask cannot be honoured and is refused
    model = tiny_fprm(config=config())
    ids = grid_inputs(2)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with pytest.raises(ValueError, match=r"cannot honour a padded `attention_mask` \(it has 3 entries"):
        model(ids, attention_mask=mask)


def test_attention_mask_of_another_shape_is_refused():
    with pytest.raises(
        ValueError,
        match=r"`attention_mask` must be a tensor of the shape of `input_ids` \(2, 16\), "
        r"got Tensor \(2, 15\)",
    ):
        tiny_fprm()(grid_inputs(2), attention_mask=torch.ones(2, 15, dtype=torch.long))


def test_eager_attention_keeps_float64_and_equals_sdpa():
    """The eager softmax computed in float32 even for a float64 model (1e-7 from sdpa); at least float32 now."""
    cfg = FPRMConfig(vocab_size=11, hidden_size=32, num_attention_heads=4, intermediate_size=64)
    ids = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = {}
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = FPRMForReasoning(cfg).double().eval()
        model.config._attn_implementation = impl
        with torch.no_grad():
            logits[impl] = model(ids, halting=False).logits
    assert logits["eager"].dtype == torch.float64
    assert not torch.equal(logits["eager"], logits["sdpa"])  # two code paths ran
    torch.testing.assert_close(logits["eager"], logits["sdpa"], atol=1e-12, rtol=0)


# ---- a save of an earlier version of this package -------------------------------------------------------------------

# config.json as b160b8c's FPRMConfig wrote it (separate q/k/v and gate/up, weighted norms, a stored z0), trimmed to
# the fields that tell the layout; its model computed another step than the authors' one this version computes
B160B8C_CONFIG = {
    "model_type": "fprm",
    "architectures": ["FPRMForReasoning"],
    "vocab_size": 6,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 1536,
    "num_hidden_layers": 2,
    "grid_size": [4, 4],
    "conv_type": "2d",
    "conv_kernel_size": 3,
    "norm_position": "pre",
    "residual_scaling": "input_independent",
    "alpha1": 0.75,
    "alpha2": 0.25,
    "init_std": 6.0,
    "rope_theta": 10000.0,
    "num_prefix_tokens": 16,
}


def test_a_save_of_an_earlier_release_says_which_commit_reads_it(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(B160B8C_CONFIG))
    for load in (FPRMForReasoning.from_pretrained, AutoModelForTokenClassification.from_pretrained):
        with pytest.raises(
            ValueError,
            match=r"`norm_position='pre'`: this config.json was saved by an earlier "
            r"version .* at commit ffb16f3 \(the last commit before 05bdf19",
        ) as error:
            load(tmp_path)
        assert "\n" not in str(error.value)


def test_an_unknown_config_keyword_is_a_warning_naming_the_closest_field(caplog, tmp_path):
    """`hiden_size=64` (a typo) was silent and the model kept its width (issue 64), where LoopFormerConfig warns."""
    from support.instruments import warnings_logged

    config, lines = warnings_logged(caplog, "fprm_hf.looped_common", lambda: tiny_fprm_config(hiden_size=64))
    assert config.hidden_size == 32 and len(lines) == 1
    assert "['hiden_size']" in lines[0] and "did you mean 'hidden_size'?" in lines[0]
    caplog.clear()  # a saved config (auto_map, transformers_version, model_type) loads without a word
    FPRMForReasoning(tiny_fprm_config()).save_pretrained(tmp_path / "m")
    _, lines = warnings_logged(
        caplog, "fprm_hf.looped_common", lambda: FPRMForReasoning.from_pretrained(tmp_path / "m")
    )
    assert lines == []
