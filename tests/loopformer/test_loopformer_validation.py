"""Model-side input checks: every LoopFormerConfig value validated however it arrives, a bounded loop budget, clear
errors for empty inputs, and loop knobs read from `generation_config`."""

import json
import resource

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
from transformers import AutoModelForCausalLM, GenerationConfig

from support.config_helpers import assert_refused_however_it_arrives
from support.bad_input_table import CASES
from support.tiny_models import randomize_modulation, tiny_loopformer_config
from loopformer_hf import LoopFormerForCausalLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = randomize_modulation(LoopFormerForCausalLM(tiny_loopformer_config())).eval()
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path)
    return path


# ---- 1. every config value validated however it arrives -----------------------------------------------------------

# the LoopFormer config rows of the refusal table (tests/support/bad_input_table.py), each run however the value arrives
BAD_VALUES = [(*case.setting, case.message) for case in CASES if case.area == "LoopFormer config" and case.setting]


@pytest.mark.parametrize("field,value,message", BAD_VALUES)
def test_bad_config_value_refused_however_it_arrives(checkpoint, tmp_path, field, value, message):
    assert_refused_however_it_arrives(
        tiny_loopformer_config,
        LoopFormerForCausalLM,
        AutoModelForCausalLM,
        checkpoint,
        tmp_path,
        field,
        value,
        message,
    )


def test_from_pretrained_good_kwarg_is_used(checkpoint):
    model = LoopFormerForCausalLM.from_pretrained(checkpoint, default_loop_budget=2)
    assert model.config.default_loop_budget == 2
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3  # embeddings + M=2 loop steps


def test_setting_num_loops_below_default_budget_bound_is_refused():
    """A rule between fields, as transformers' configs check them: by `validate()` (construction, `from_pretrained`
    kwargs, `save_pretrained`), and the default budget again where a forward would use it."""
    config = tiny_loopformer_config(num_loops=4, default_loop_budget=32)  # 32 = 8 x 4, the default bound
    config.num_loops = 2
    with pytest.raises(
        StrictDataclassClassValidationError, match=r"default_loop_budget`=32 exceeds.*max_loop_budget=16"
    ):
        config.validate()
    with pytest.raises(ValueError, match=r"default_loop_budget`=32 exceeds.*max_loop_budget=16"):
        config.resolve_trajectory()


# ---- 2. an upper bound on the loop budget, checked before anything is allocated ---------------------------------


@pytest.mark.parametrize("budget", [10**6, 10**20])
def test_huge_loop_budget_refused_before_allocation(budget):
    torch.manual_seed(0)
    model = LoopFormerForCausalLM(tiny_loopformer_config(num_loops=4)).eval()
    ids = torch.tensor([[3, 4, 5]])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    message = rf"loop_budget`={budget} exceeds.*max_loop_budget=32 \(max_loop_budget_factor=8 x num_loops=4\)"
    with pytest.raises(ValueError, match=message):
        model(ids, loop_budget=budget)
    with pytest.raises(ValueError, match=message):
        model.generate(ids, loop_budget=budget, max_new_tokens=2, do_sample=False)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200_000  # KiB: nothing large allocated


def test_loop_budget_bound_is_configurable():
    torch.manual_seed(0)
    model = LoopFormerForCausalLM(tiny_loopformer_config(num_loops=2, max_loop_budget_factor=1)).eval()
    ids = torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match=r"max_loop_budget=2"):
        model(ids, loop_budget=3)
    with pytest.raises(ValueError, match=r"len\(step_schedule\)`=3 exceeds"):
        model(ids, step_schedule=[0.2, 0.3, 0.5])
    with pytest.warns(UserWarning, match="extrapolates"):
        model.config.max_loop_budget_factor = 2
        assert model(ids, loop_budget=4).logits.shape == (1, 2, 97)


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_max_loop_budget_factor_validated(value):
    with pytest.raises(StrictDataclassFieldValidationError, match=rf"(?s)'max_loop_budget_factor'.*got .*{value!r}"):
        tiny_loopformer_config(max_loop_budget_factor=value)


# ---- 3. empty inputs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 0), (0, 3), (0, 0)])
def test_empty_inputs_are_a_clear_error(tiny_model, shape):
    ids = torch.zeros(shape, dtype=torch.long)
    message = rf"input_ids.*at least one token.*got shape {tuple(shape)}".replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=message):
        tiny_model(ids)
    with pytest.raises(ValueError, match=r"inputs_embeds.*got shape"):
        tiny_model(inputs_embeds=torch.zeros(*shape, 64))


# ---- 4. loop knobs read from generation_config ------------------------------------------------------------------


def _loop_steps_of_generate(model, ids, **kwargs):
    """Number of loop steps each forward of a greedy generate ran (from output_hidden_states of the spied forward)."""
    seen = []

    def hook(module, args, kw, output):
        seen.append(len(output.hidden_states) - 1)

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        out = model.generate(
            ids, max_new_tokens=3, do_sample=False, output_hidden_states=True, return_dict_in_generate=True, **kwargs
        )
    finally:
        handle.remove()
    return set(seen), out


@pytest.fixture
def generating_model():
    torch.manual_seed(0)
    model = randomize_modulation(LoopFormerForCausalLM(tiny_loopformer_config(num_loops=4))).eval()
    return model


def test_generation_config_loop_budget_reaches_forward(generating_model):
    ids = torch.tensor([[3, 4, 5]])
    steps, _ = _loop_steps_of_generate(generating_model, ids, generation_config=GenerationConfig(loop_budget=1))
    assert steps == {1}
    steps, _ = _loop_steps_of_generate(generating_model, ids)
    assert steps == {4}


def test_call_kwarg_overrides_generation_config(generating_model):
    ids = torch.tensor([[3, 4, 5]])
    generating_model.generation_config.loop_budget = 1
    steps, _ = _loop_steps_of_generate(generating_model, ids, loop_budget=2)
    assert steps == {2}
    steps, _ = _loop_steps_of_generate(generating_model, ids, generation_config=GenerationConfig(loop_budget=3))
    assert steps == {3}
    steps, _ = _loop_steps_of_generate(generating_model, ids)
    assert steps == {1}


def test_generation_config_step_schedule_and_halt_eps(generating_model):
    ids = torch.tensor([[3, 4, 5]])
    schedule = [0.5, 0.25, 0.25]
    by_kwarg = generating_model.generate(
        ids,
        max_new_tokens=4,
        do_sample=False,
        step_schedule=schedule,
        output_scores=True,
        return_dict_in_generate=True,
    )
    by_config = generating_model.generate(
        ids,
        max_new_tokens=4,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        generation_config=GenerationConfig(step_schedule=schedule),
    )
    default = generating_model.generate(
        ids, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    torch.testing.assert_close(torch.stack(by_config.scores), torch.stack(by_kwarg.scores))
    assert not torch.allclose(torch.stack(default.scores), torch.stack(by_kwarg.scores))
    out = generating_model.generate(
        ids,
        max_new_tokens=3,
        do_sample=False,
        return_dict_in_generate=True,
        generation_config=GenerationConfig(halt_eps=1e9),
    )
    assert out.loop_counts is not None and bool((out.loop_counts == 1).all())  # every token halts after one step


def test_generation_config_halt_eps_with_chunked_prefill_is_refused(generating_model):
    with pytest.raises(ValueError, match="halt_eps.*chunked prefill"):
        generating_model.generate(
            torch.tensor([[3, 4, 5]]),
            max_new_tokens=2,
            generation_config=GenerationConfig(halt_eps=0.1, prefill_chunk_size=2),
        )


def test_loop_knobs_saved_in_generation_config_json(generating_model, tmp_path):
    generating_model.generation_config.loop_budget = 1
    generating_model.generation_config.step_schedule = "coarse_to_fine"
    generating_model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["loop_budget"] == 1 and saved["step_schedule"] == "coarse_to_fine"
    loaded = LoopFormerForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.generation_config.loop_budget == 1
    steps, _ = _loop_steps_of_generate(loaded, torch.tensor([[3, 4, 5]]))
    assert steps == {1}


def _config_warnings(caplog, make):
    from support.instruments import warnings_logged

    return warnings_logged(caplog, "loopformer_hf.looped_common", make)


def test_an_unknown_config_keyword_is_a_warning_naming_the_closest_field(caplog, tmp_path):
    """`num_loop=3` (a typo) was kept silently and the model looped 8 times (issue 55)."""
    from loopformer_hf import LoopFormerConfig

    config, lines = _config_warnings(caplog, lambda: LoopFormerConfig(num_loop=3))
    assert config.num_loops == 8 and len(lines) == 1
    assert "['num_loop']" in lines[0] and "did you mean 'num_loops'?" in lines[0]
    caplog.clear()  # a saved config (auto_map, transformers_version, model_type) loads without a word
    LoopFormerForCausalLM(tiny_loopformer_config()).save_pretrained(tmp_path / "m")
    _, lines = _config_warnings(caplog, lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "m"))
    assert lines == []


def test_numpy_integers_are_integers():
    """num_loops=np.int64(4) (an np.arange sweep) was refused as "expected int, got int64" (issue 55)."""
    import numpy as np

    from loopformer_hf import LoopFormerConfig

    config = LoopFormerConfig(num_loops=np.int64(4), hidden_size=np.int32(64), num_attention_heads=4)
    assert type(config.num_loops) is int and config.num_loops == 4 and type(config.hidden_size) is int
    config.default_loop_budget = np.int16(2)
    assert type(config.default_loop_budget) is int and json.loads(config.to_json_string())["num_loops"] == 4
    with pytest.raises(StrictDataclassFieldValidationError, match="positive integer, got 0"):
        config.num_loops = np.int64(0)
