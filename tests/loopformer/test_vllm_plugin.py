"""vllm_plugin.py without vLLM (nothing in it imports vLLM at module level): the server's trajectory from
`--hf-overrides`, then generation_config.json, then the config; each request's own knobs over the server's, bounded by
the largest budget its cache holds; per-token halting refused for both; a logits processor class bound to its server
pickles with it. Against a running vLLM: tests/serving/test_vllm.py (scripts/test_vllm.sh)."""

import pickle

import pytest
from support.tiny_models import tiny_loopformer_config

from loopformer_hf.vllm_plugin import (
    LoopFormerServing,
    RequestLoop,
    max_request_loop_budget,
    request_trajectory,
    served_processor,
    server_knobs,
    server_trajectory,
)


class Processor:  # a logits processor class vLLM loads by name
    pass


@pytest.fixture
def config():
    return tiny_loopformer_config(num_loops=3)


def test_the_servers_knobs_come_from_overrides_then_generation_config(config):
    saved = {"loop_budget": 2, "step_schedule": "coarse_to_fine"}
    assert server_knobs(config) == {"loop_budget": None, "step_schedule": None, "halt_eps": None}
    assert server_trajectory(config) == (1 / 3,) * 3
    assert server_trajectory(config, saved) == config.resolve_trajectory(2, "coarse_to_fine")
    config.loop_budget = 1  # what --hf-overrides '{"loop_budget": 1}' sets
    assert server_knobs(config, saved)["loop_budget"] == 1
    assert server_trajectory(config, saved) == (1.0,)


def test_per_token_halting_is_refused_for_the_server_and_for_a_request(config):
    with pytest.raises(ValueError, match="halt_eps=0.1 .* not supported by the vLLM LoopFormer model"):
        server_trajectory(config, {"halt_eps": 0.1})
    with pytest.raises(ValueError, match="per-token halting"):
        request_trajectory(config, None, {"halt_eps": 0.1})


@pytest.mark.filterwarnings("ignore:LoopFormer trajectory")  # off the grid and above num_loops: asked for here
def test_a_requests_knobs_replace_the_servers_up_to_the_largest_budget(config):
    saved = {"loop_budget": 2, "step_schedule": "coarse_to_fine"}
    assert request_trajectory(config, saved, {}) is None and request_trajectory(config, saved, {"seed": 1}) is None
    assert request_trajectory(config, saved, {"loop_budget": 3}) == config.resolve_trajectory(3, "coarse_to_fine")
    assert request_trajectory(config, saved, {"step_schedule": [0.25, 0.75]}) == (0.25, 0.75)
    assert max_request_loop_budget(config, saved) == 3  # num_loops, above the server's own budget 2
    with pytest.raises(ValueError, match="`loop_budget`=4 exceeds this server's largest per-request loop budget, 3"):
        request_trajectory(config, saved, {"loop_budget": 4})
    config.max_request_loop_budget = 4  # --hf-overrides '{"max_request_loop_budget": 4}'
    assert len(request_trajectory(config, saved, {"loop_budget": 4})) == 4
    config.max_request_loop_budget = 1
    with pytest.raises(ValueError, match="below the server's own loop budget 2"):
        max_request_loop_budget(config, saved)


def test_the_serving_is_resolved_once_and_a_processor_bound_to_it_pickles_with_it(config):
    serving = LoopFormerServing.build(config, {"loop_budget": 2})
    assert serving.loop == RequestLoop((0.5, 0.5), 2) and serving.budget_knob == 2 and serving.max_budget == 3
    assert serving.request_loop({"loop_budget": 1}) == RequestLoop((1.0,), 1)
    bound = served_processor(Processor, serving)
    assert issubclass(bound, Processor) and bound.serving is serving
    again = pickle.loads(pickle.dumps(bound))  # as a VllmConfig holding it reaches a spawned engine core
    assert again.__bases__ == (Processor,) and again.serving.loop == serving.loop


def test_a_draft_checkpoint_serves_the_same_weights_at_its_own_budget(config, tmp_path):
    """write_draft_checkpoint: the folder vLLM's draft_model speculative decoding loads as the draft. Its
    generation_config.json holds the draft's budget where vLLM's generation-config reader finds it (a saved
    `"_from_model_config": true` would make transformers drop it), and its weights are the checkpoint's."""
    import filecmp

    from transformers import GenerationConfig

    from loopformer_hf import LoopFormerForCausalLM
    from loopformer_hf.vllm_plugin import write_draft_checkpoint

    checkpoint = tmp_path / "ckpt"
    LoopFormerForCausalLM(config).save_pretrained(checkpoint)  # a fresh save says "_from_model_config": true
    draft = write_draft_checkpoint(str(checkpoint), str(tmp_path / "draft"), 1)
    saved = GenerationConfig.from_pretrained(draft).to_dict()  # what vLLM's try_get_generation_config reads
    assert (saved["loop_budget"], saved["step_schedule"]) == (1, "uniform")
    assert server_trajectory(config, saved) == (1.0,)
    assert filecmp.cmp(checkpoint / "model.safetensors", tmp_path / "draft" / "model.safetensors", shallow=False)
    assert GenerationConfig.from_pretrained(checkpoint).to_dict().get("loop_budget") is None  # the source untouched

    with pytest.raises(ValueError, match="exists and is not empty"):
        write_draft_checkpoint(str(checkpoint), draft, 1)
    with pytest.raises(ValueError, match="loop_budget"):
        write_draft_checkpoint(str(checkpoint), str(tmp_path / "bad"), 0)
    assert not (tmp_path / "bad").exists()  # refused before anything is written
    with pytest.raises(ValueError, match="no config.json"):
        write_draft_checkpoint(str(tmp_path / "missing"), str(tmp_path / "d2"), 1)
