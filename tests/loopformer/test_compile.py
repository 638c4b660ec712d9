"""torch.compile of LoopFormer's forward at a fixed budget matches eager on CPU; what recompiles when the budget
changes (documented in docs/compile.md) is measured here with a counting backend."""

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounter
from transformers import CompileConfig

from support.hub_helpers import make_model


IDS = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _check_matches_eager(backend):
    model = make_model()
    compiled = torch.compile(model.forward, backend=backend)
    with torch.no_grad():
        for kwargs in ({"loop_budget": 2}, {"loop_budget": 2}, {"step_schedule": [0.5, 0.25, 0.25]}):
            eager = model(IDS, use_cache=False, **kwargs).logits
            got = compiled(IDS, use_cache=False, **kwargs).logits
            torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(IDS, loop_budget=1, use_cache=False).logits, eager, atol=1e-4)


def test_compiled_forward_matches_eager_aot():
    """Dynamo capture + AOTAutograd (no code generation): the quick check of the default test run."""
    _check_matches_eager("aot_eager")


@pytest.mark.slow
def test_compiled_forward_matches_eager_inductor():
    """The default backend (inductor, C++ code generation on CPU): ~40 s of CPU for this tiny model."""
    _check_matches_eager("inductor")


def test_same_budget_reuses_graphs_new_budget_recompiles():
    model = make_model()
    counter = CompileCounter()
    compiled = torch.compile(model.forward, backend=counter)
    with torch.no_grad():
        compiled(IDS, loop_budget=2, use_cache=False)
        first = counter.frame_count
        assert first >= 1
        compiled(IDS, loop_budget=2, use_cache=False)
        assert counter.frame_count == first  # fixed budget: the cached graphs are reused
        compiled(IDS, loop_budget=4, use_cache=False)
        assert counter.frame_count > first  # a new budget unrolls a different loop: new graphs
        after_four = counter.frame_count
        compiled(IDS, loop_budget=4, use_cache=False)
        assert counter.frame_count == after_four  # ... which are then cached too


def _graphs_per_generate(model, calls, **kw):
    """Decode greedily each (prompt, budget) of `calls` in turn with transformers' own compiled generation (a static
    cache and a `CompileConfig`: the decode steps run a compiled `model.__call__`, the prefill runs eager), with a
    counting backend, `fullgraph`, and the recompile limit made an error (past it Dynamo would go on in eager with a
    log line): the graphs each `generate` call compiled, after checking its tokens against eager decoding."""
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static", **kw)
    with torch.no_grad():
        eager = [model.generate(ids, loop_budget=b, **kw) for ids, b in calls]
        counter = CompileCounter()
        # CompileConfig hands its `mode` on to the backend: a counting one takes none
        compile_config = CompileConfig(backend=lambda gm, inputs, **_: counter(gm, inputs), fullgraph=True)
        compile_config._compile_all_devices = True  # transformers compiles on CUDA-like devices unless told so
        graphs = []
        with dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for (ids, b), expected in zip(calls, eager):
                before = counter.frame_count
                out = model.generate(ids, loop_budget=b, compile_config=compile_config, **kw)
                assert torch.equal(out, expected), f"budget {b}"
                graphs.append(counter.frame_count - before)
    print("graphs per generate call at budgets", [b for _, b in calls], ":", graphs)
    return graphs


def test_generate_across_budgets_compiled_with_static_cache():
    """transformers' compiled generation decodes with the static loop cache at budget 4, then 1, 2, 3 twice, then
    5..8 (beyond L, extrapolating) and a longer prompt: no error, eager's tokens, and one decode graph per trajectory
    (the prefill runs eager; Dynamo guards on the trajectory as plain values; seen budgets and prompt lengths reuse
    their graphs), so Dynamo's recompile limit (8 versions) holds 8 budgets."""
    calls = [(IDS[:, :5], b) for b in (4, 1, 2, 3, 4, 1, 2, 3, 5, 6, 7, 8)] + [(IDS[:, :9], 2)]
    with pytest.warns(UserWarning, match="extrapolates beyond training"):
        graphs = _graphs_per_generate(make_model(), calls)
    assert graphs == [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0]  # no recompile per token


def test_a_forward_compiled_by_hand_decodes_with_the_dynamic_cache():
    """`model.forward = torch.compile(model.forward)` with generate's default dynamic cache: eager's tokens; a budget
    seen before reuses its graphs (the prefill and the decode steps compile as Dynamo does for any model: see
    docs/compile.md for the graphs per budget)."""
    model = make_model()
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        eager = {b: model.generate(IDS[:, :5], loop_budget=b, **kw) for b in (4, 1)}
        counter = CompileCounter()
        model.forward = torch.compile(model.forward, backend=counter)
        graphs = []
        for b in (4, 1, 4, 1):
            before = counter.frame_count
            assert torch.equal(model.generate(IDS[:, :5], loop_budget=b, **kw), eager[b])
            graphs.append(counter.frame_count - before)
    assert graphs[0] > 0 and graphs[1] > 0 and graphs[2:] == [0, 0], graphs
