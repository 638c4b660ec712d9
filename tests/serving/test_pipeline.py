"""pipeline("text-generation") passes loop_budget and step_schedule through the call to every forward of generate:
with the package imported, and in a fresh process where it cannot be imported (trust_remote_code=True)."""

import json

import pytest
import torch
from transformers import pipeline

from support.hub_helpers import hf_env, last_json_line, run_python, save_checkpoint

import loopformer_hf  # noqa: F401  (registers the Auto classes)


PROMPT = "the cat sat"
SCHEDULE = [0.5, 0.25, 0.25]
CALLS = [  # (pipeline kwargs, what every forward must receive)
    ({"loop_budget": 1}, (1, None)),
    ({"loop_budget": 4}, (4, None)),
    ({"step_schedule": SCHEDULE}, (None, SCHEDULE)),
    ({"loop_budget": 3, "step_schedule": "coarse_to_fine"}, (3, "coarse_to_fine")),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe") / "model"
    save_checkpoint(path, seed=0)
    return path


def _run_pipeline(pipe, kwargs):
    seen = []
    handle = pipe.model.register_forward_pre_hook(
        lambda module, args, kw: seen.append((kw.get("loop_budget"), kw.get("step_schedule"))), with_kwargs=True
    )
    try:
        text = pipe(PROMPT, max_new_tokens=6, do_sample=False, **kwargs)[0]["generated_text"]
    finally:
        handle.remove()
    return text, seen


def test_pipeline_with_package_passes_depth_knobs_to_every_forward(folder):
    pipe = pipeline("text-generation", model=str(folder))
    assert type(pipe.model).__module__ == "loopformer_hf.modeling_loopformer"
    tok, model = pipe.tokenizer, pipe.model
    texts = {}
    for kwargs, expected in CALLS:
        text, seen = _run_pipeline(pipe, kwargs)
        assert len(seen) == 6 and all(s == expected for s in seen), (kwargs, seen)  # prefill + 5 decode steps
        ids = tok([PROMPT], return_tensors="pt")
        direct = model.generate(**ids, max_new_tokens=6, do_sample=False, **kwargs)
        assert text == tok.decode(direct[0], skip_special_tokens=True)
        texts[json.dumps(kwargs)] = text
    assert len(set(texts.values())) > 1  # the depth knobs change the text
    with pytest.raises(ValueError, match="loop_budget"):
        pipe(PROMPT, max_new_tokens=2, loop_budget=0)
    with pytest.raises(ValueError, match="step_schedule"):
        pipe(PROMPT, max_new_tokens=2, step_schedule=[0.5, 0.6])


def test_pipeline_without_package_with_trust_remote_code(folder, tmp_path):
    code = f"""
    import json
    from transformers import pipeline
    try:
        import loopformer_hf
        raise SystemExit("loopformer_hf should not be importable here")
    except ImportError:
        pass
    pipe = pipeline("text-generation", model=r"{folder}", trust_remote_code=True)
    out = {{"module": type(pipe.model).__module__}}
    for kwargs in {json.dumps([c[0] for c in CALLS])}:
        seen = []
        h = pipe.model.register_forward_pre_hook(
            lambda m, a, kw: seen.append([kw.get("loop_budget"), kw.get("step_schedule")]), with_kwargs=True)
        text = pipe({PROMPT!r}, max_new_tokens=6, do_sample=False, **kwargs)[0]["generated_text"]
        h.remove()
        out[json.dumps(kwargs)] = [text, seen]
    print(json.dumps(out))
    """
    result = last_json_line(run_python(code, env=hf_env(tmp_path)).stdout)
    assert result.pop("module").startswith("transformers_modules")
    local = pipeline("text-generation", model=str(folder))
    for kwargs, expected in CALLS:
        text, seen = result[json.dumps(kwargs)]
        assert len(seen) == 6 and all(tuple(s) == expected for s in seen), (kwargs, seen)
        assert text == local(PROMPT, max_new_tokens=6, do_sample=False, **kwargs)[0]["generated_text"]


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
    """A synthetic-task run of the training command (2 steps): its folder and its record."""
    from looped_training.loopformer import train

    path = tmp_path_factory.mktemp("trained") / "run"
    train.main([*TRAIN_TINY, "--output_dir", str(path)])
    return path, json.loads((path / "loopformer_training.json").read_text())


def test_a_trained_run_generates_through_the_pipeline_with_no_extra_argument(trained):
    from looped_training.loopformer.arguments import DataArguments
    from looped_training.loopformer.data import held_out_problems

    path, record = trained
    pipe = pipeline("text-generation", model=str(path))
    tokenizer, config = pipe.tokenizer, pipe.model.generation_config
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert len(newline) == 1 and config.eos_token_id == [newline[0], tokenizer.eos_token_id]
    problems = held_out_problems(DataArguments(**record["data"]))
    longest = max(problems, key=lambda p: len(tokenizer(p.prompt)["input_ids"])).prompt
    context = pipe.model.config.max_position_embeddings
    assert config.max_new_tokens == context - len(tokenizer(longest)["input_ids"]) >= 2  # the answer and its newline
    assert record["prompt"] == problems[0].prompt and record["generation"]["max_new_tokens"] == config.max_new_tokens
    # the task's longest prompt and the record's generate inside the context (256 new tokens ran past 12 positions)
    for prompt in (longest, record["prompt"]):
        ids = pipe(prompt, return_tensors=True)[0]["generated_token_ids"]
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert list(ids[: len(prompt_ids)]) == prompt_ids and len(prompt_ids) < len(ids) <= context


def test_generation_stops_at_the_answers_newline(trained):
    path, record = trained
    pipe = pipeline("text-generation", model=str(path))
    (newline,) = pipe.tokenizer("\n", add_special_tokens=False)["input_ids"]

    def prefer_newline(module, args, logits):  # a model that has learned to close its answer at once
        bump = torch.zeros_like(logits)
        bump[..., newline] = 1e4
        return logits + bump

    handle = pipe.model.lm_head.register_forward_hook(prefer_newline)
    try:
        out = pipe(record["prompt"], return_tensors=True)[0]["generated_token_ids"]
    finally:
        handle.remove()
    prompt_ids = pipe.tokenizer(record["prompt"])["input_ids"]
    assert list(out) == [*prompt_ids, newline]  # one new token, the stop token, then generation ended


def test_pipeline_with_a_budget_per_input(folder):
    """A list of budgets is one per row of a batch: with batch_size=len(inputs) each input gets its own, as when it
    runs alone; with the pipeline's default batch of 1 the error says to pass batch_size (issue 55)."""
    pipe = pipeline("text-generation", model=str(folder))
    prompts, budgets = ["the cat sat", "a dog ran far"], [1, 4]
    together = pipe(prompts, max_new_tokens=4, do_sample=False, loop_budget=budgets, batch_size=2)
    alone = [pipe(p, max_new_tokens=4, do_sample=False, loop_budget=b) for p, b in zip(prompts, budgets)]
    assert [t[0]["generated_text"] for t in together] == [a[0]["generated_text"] for a in alone]
    with pytest.raises(
        ValueError, match=r"`loop_budget` gives 2 values.*batch has 1 rows.*pass batch_size=len\(inputs\)"
    ):
        pipe(prompts, max_new_tokens=2, loop_budget=budgets)


def test_a_folder_without_a_tokenizer_says_so(tmp_path):
    # "You need to have sentencepiece or tiktoken installed to convert a slow tokenizer" (issue 55)
    from transformers import AutoTokenizer

    from support.hub_helpers import make_model

    make_model(seed=0).save_pretrained(tmp_path / "m")
    for load in (
        lambda: AutoTokenizer.from_pretrained(tmp_path / "m"),
        lambda: pipeline("text-generation", model=str(tmp_path / "m")),
    ):
        with pytest.raises(
            OSError, match=r"holds no tokenizer \(none of tokenizer\.json, .*tokenizer\.save_pretrained"
        ):
            load()


def test_a_folder_with_a_tokenizer_loads_it_as_saved(folder, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(tokenizer).__name__ != "LoopFormerTokenizerFast"
    tokenizer.save_pretrained(tmp_path / "tok")
    assert "LoopFormer" not in (tmp_path / "tok" / "tokenizer_config.json").read_text()
