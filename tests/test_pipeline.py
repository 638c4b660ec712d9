"""pipeline("text-generation") passes loop_budget and step_schedule through the call to every forward of generate:
with the package imported, and in a fresh process where it cannot be imported (trust_remote_code=True)."""

import json

import pytest
import torch
from transformers import pipeline

from _hub_helpers import hf_env, last_json_line, run_python, save_checkpoint

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
