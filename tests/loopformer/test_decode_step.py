"""One decode step of `generate`, measured as a reader would follow it: the package functions (and files) that one
decode forward runs, and how many calls. Llama's runs 9 of its own functions in 1 file, 4 + 8 calls per layer; ours
runs at most 10 functions in at most 2 files, in at most 6 + 8·M·k calls, and the default path runs no halting code."""

import os
import sys

import pytest
import torch
from support.tiny_models import randomize_modulation, tiny_loopformer_config

import loopformer_hf

PACKAGE = os.path.dirname(loopformer_hf.__file__) + os.sep


def profile_one_decode_forward(model, ids, decode_step=2, **generate_kwargs):
    """(distinct (file, function) pairs, number of calls) of loopformer_hf code that forward call number
    `decode_step` + 1 of a `generate` (the prefill is call 1) runs, from entering `model.__call__` to leaving it."""
    calls, seen, count = [0], set(), [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            code = frame.f_code
            seen.add((os.path.basename(code.co_filename), getattr(code, "co_qualname", code.co_name)))
            count[0] += 1

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
    return seen, count[0]


def _model(**overrides):
    torch.manual_seed(0)
    return randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(**overrides))).eval()


@pytest.mark.parametrize("overrides", [{}, {"position_embedding_type": "rope"}], ids=["learned", "rope"])
def test_a_default_decode_step_runs_at_most_10_functions_in_2_files_and_8_calls_per_block(overrides):
    model = _model(**overrides)
    k = model.config.num_hidden_layers
    for budget in (1, 3):
        seen, calls = profile_one_decode_forward(model, torch.randint(3, 97, (2, 5)), loop_budget=budget)
        files = sorted({file for file, _ in seen})
        listing = "\n".join(f"{file}: {name}" for file, name in sorted(seen))
        print(f"M={budget}, k={k}: {len(seen)} functions in {len(files)} files, {calls} calls")
        assert len(seen) <= 10 and len(files) <= 2, f"{len(seen)} functions in {len(files)} files:\n{listing}"
        assert calls <= 6 + 8 * budget * k, (calls, listing)
        # decided before the loop: no trajectory resolved, no input checked, no cache, halting or loss code per step
        assert set(files) <= {"modeling_loopformer.py", "looped_common.py"}, listing


def test_per_row_budgets_run_no_halting_code():
    """Per-row budgets are not halting: their decode step runs in the modeling file alone."""
    seen, _ = profile_one_decode_forward(_model(), torch.randint(3, 97, (2, 5)), loop_budget=[1, 3])
    assert {file for file, _ in seen} <= {"modeling_loopformer.py", "looped_common.py"}, seen


def test_a_tensor_step_schedule_is_resolved_once_per_generate(monkeypatch):
    """A schedule given as a tensor is resolved once per generate call, not at every forward: generate hands it on
    as plain numbers, which the model remembers."""
    from loopformer_hf import modeling_loopformer

    model, resolved = _model(), []
    original = modeling_loopformer.resolve_call
    monkeypatch.setattr(modeling_loopformer, "resolve_call", lambda *a, **k: resolved.append(1) or original(*a, **k))
    schedule = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    ids = torch.randint(3, 97, (2, 5))
    out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, step_schedule=schedule)
    assert len(resolved) == 1, resolved
    expected = model.generate(
        ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, step_schedule=[0.5, 0.25, 0.25]
    )
    assert torch.equal(out, expected)
