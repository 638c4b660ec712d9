"""A trained folder decodes the same through `pipeline()` as through `generate` (greedy, written into its
generation_config.json), and loop knobs written by hand into generation_config.json are honoured by `generate`, or
refused at load when invalid."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, pipeline

import loopformer_hf  # noqa: F401  (registers the Auto classes)

TRAIN_TINY = [
    "--preset",
    "synthetic-tiny",
    "--hidden_size",
    "32",
    "--num_attention_heads",
    "2",
    "--num_train_problems",
    "64",
    "--num_eval_problems",
    "24",
    "--per_device_train_batch_size",
    "8",
    "--max_steps",
    "2",
    "--save_strategy",
    "no",
    "--disable_tqdm",
    "true",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A synthetic-task run of the training command (2 steps: near-uniform next-token distributions, which sampling
    would show at once): its folder and its record."""
    from looped_training.loopformer import train

    path = tmp_path_factory.mktemp("trained") / "run"
    train.main([*TRAIN_TINY, "--output_dir", str(path)])
    return path, json.loads((path / "loopformer_training.json").read_text())


def test_a_trained_folder_decodes_greedily_through_a_pipeline_with_no_argument(trained):
    # the same prompt gave 2, 0, 3, 9, 0: pipeline's default (sampling, T=0.7) applied
    path, record = trained
    assert json.loads((path / "generation_config.json").read_text())["do_sample"] is False
    pipe = pipeline("text-generation", model=str(path))
    outputs = []
    for seed in range(5):
        torch.manual_seed(seed)
        outputs.append(pipe(record["prompt"], return_tensors=True)[0]["generated_token_ids"])
    ids = pipe.tokenizer(record["prompt"], return_tensors="pt").input_ids
    greedy = pipe.model.generate(ids)[0].tolist()
    assert all(list(out) == greedy for out in outputs), outputs


# ---- loop knobs hand-edited into generation_config.json -----------------------------------------------------------


@pytest.fixture
def edited(trained, tmp_path):
    """edit(**knobs): a copy of the trained folder whose generation_config.json has `knobs` added by hand (its
    `"_from_model_config": true` kept, as the trainer writes it)."""

    def edit(**knobs):
        folder = shutil.copytree(trained[0], tmp_path / f"edited{len(list(tmp_path.iterdir()))}")
        file = folder / "generation_config.json"
        config = json.loads(file.read_text())
        assert config.get("_from_model_config") is True
        file.write_text(json.dumps({**config, **knobs}))
        return folder

    return edit


def forward_knobs(model, **generate_kwargs):
    """The loop knobs each forward of `model.generate(...)` received."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(
            {k: kwargs.get(k) for k in ("loop_budget", "step_schedule", "halt_eps")}
        ),
        with_kwargs=True,
    )
    try:
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, **generate_kwargs)
    finally:
        handle.remove()
    return seen


def test_loop_knobs_written_by_hand_into_generation_config_json_are_honoured(edited):
    # the custom keys were dropped (the file says "_from_model_config": true): generate ran the full loop
    knobs = {"loop_budget": 2, "step_schedule": "coarse_to_fine", "halt_eps": 0.5}
    model = AutoModelForCausalLM.from_pretrained(edited(**knobs))
    assert {k: getattr(model.generation_config, k, None) for k in knobs} == knobs
    assert forward_knobs(model) == [knobs] * 2
    assert forward_knobs(model, loop_budget=3)[0]["loop_budget"] == 3  # a call kwarg wins
    # a list schedule sets the budget; a file without knobs keeps the model's defaults
    model = AutoModelForCausalLM.from_pretrained(edited(step_schedule=[0.75, 0.25]))
    assert forward_knobs(model)[0]["step_schedule"] == [0.75, 0.25]
    model = AutoModelForCausalLM.from_pretrained(edited())
    assert forward_knobs(model)[0] == dict.fromkeys(knobs)


@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"loop_budget": 0}, r"`loop_budget` must be an integer >= 1, got 0"),
        ({"loop_budget": "bogus"}, r"`loop_budget` must be an integer >= 1, got 'bogus'"),
        ({"loop_budget": 10**6}, r"`loop_budget`=1000000 exceeds the largest loop budget"),
        ({"step_schedule": [0.5, 0.4]}, r"`step_schedule` must sum to 1"),
        ({"step_schedule": "bogus"}, r"`step_schedule` preset must be one of .* got 'bogus'"),
        (
            {"loop_budget": 3, "step_schedule": [0.5, 0.5]},
            r"`loop_budget`=3 disagrees with `step_schedule` of length 2",
        ),
        ({"halt_eps": 0}, r"`halt_eps` must be None or a positive finite float, got 0"),
        ({"halt_eps": "x"}, r"`halt_eps` must be None or a positive finite float, got 'x'"),
    ],
)
def test_invalid_loop_knobs_in_generation_config_json_are_refused_at_load(edited, knobs, message):
    folder = edited(**knobs)
    with pytest.raises(ValueError, match=rf"generation_config\.json sets a loop knob .*{message}"):
        AutoModelForCausalLM.from_pretrained(folder)
