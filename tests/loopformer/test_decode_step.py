"""One decode step of `generate`, measured as a reader would follow it: the package functions (and files) that one
decode forward runs. Llama's runs nine of its own functions in one file; ours decides the loop before the loop (the
plan comes from `generate`, bound to the cache) and the default path pays nothing for halting."""

import os
import sys

import pytest
import torch

from support.tiny_models import randomize_modulation, tiny_loopformer_config
import loopformer_hf
from loopformer_hf.modeling_loopformer import CACHE_FIELD

PACKAGE = os.path.dirname(loopformer_hf.__file__) + os.sep


def functions_of_one_decode_forward(model, ids, decode_step=2, **generate_kwargs):
    """The distinct (file, function) pairs of loopformer_hf that forward call number `decode_step` + 1 of a
    `generate` (the prefill is call 1) runs, from entering `model.__call__` to leaving it."""
    calls, seen = [0], set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            code = frame.f_code
            seen.add((os.path.basename(code.co_filename), getattr(code, "co_qualname", code.co_name)))

    def before(module, args, kwargs):
        calls[0] += 1
        if calls[0] == decode_step + 1:
            sys.setprofile(profile)

    def after(module, args, kwargs, output):
        if calls[0] == decode_step + 1:
            sys.setprofile(None)

    hooks = (
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    )
    try:
        model.generate(ids, max_new_tokens=decode_step + 2, min_new_tokens=decode_step + 2, **generate_kwargs)
    finally:
        sys.setprofile(None)
        for hook in hooks:
            hook.remove()
    assert calls[0] > decode_step + 1, "generate stopped before the measured decode step"
    return seen


def _model(**overrides):
    torch.manual_seed(0)
    return randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(**overrides))).eval()


@pytest.mark.parametrize("overrides", [{}, {"position_embedding_type": "rope"}], ids=["learned", "rope"])
def test_a_default_decode_step_runs_at_most_20_functions_in_4_files(overrides):
    seen = functions_of_one_decode_forward(_model(**overrides), torch.randint(3, 97, (2, 5)))
    files = sorted({file for file, _ in seen})
    listing = "\n".join(f"{file}: {name}" for file, name in sorted(seen))
    assert len(seen) <= 20 and len(files) <= 4, f"{len(seen)} functions in {len(files)} files:\n{listing}"
    # decided before the loop: no plan is rebuilt or compared, no input check or loss code runs per step
    assert "plan_loopformer.py" not in files and "halting_loopformer.py" not in files, listing


def test_a_tensor_step_schedule_is_resolved_once_per_generate(monkeypatch):
    """A schedule given as a tensor is resolved with the call's plan, once, not at every forward."""
    from loopformer_hf import plan_loopformer

    model, resolved = _model(), []
    original = plan_loopformer.resolve_call
    monkeypatch.setattr(plan_loopformer, "resolve_call", lambda *a, **k: resolved.append(1) or original(*a, **k))
    schedule = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    ids = torch.randint(3, 97, (2, 5))
    out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, step_schedule=schedule)
    assert len(resolved) == 1, resolved
    expected = model.generate(
        ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, step_schedule=[0.5, 0.25, 0.25]
    )
    assert torch.equal(out, expected)


def test_the_decode_step_reads_the_plan_bound_to_the_cache():
    """The plan generate made is the one every forward of that call runs (it reaches them on the cache)."""
    model, plans = _model(), []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: plans.append(getattr(kwargs.get(CACHE_FIELD), "plan", None)), with_kwargs=True
    )
    model.generate(torch.randint(3, 97, (2, 5)), max_new_tokens=4, min_new_tokens=4, loop_budget=3)
    assert len(plans) == 4 and plans[0] is not None and all(plan is plans[0] for plan in plans)
    assert plans[0].trajectory == (1 / 3,) * 3
