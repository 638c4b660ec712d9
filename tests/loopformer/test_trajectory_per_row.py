"""Per-row loop budgets and step schedules: each row of a batch runs its own trajectory (`loop_budget` as a list or a
1-D tensor, `step_schedule` as a list of schedules) and computes what a call of that row alone computes."""

import pytest
import torch
import torch._dynamo as dynamo
from support.tiny_models import cache_of, randomize_modulation, tiny_loopformer_config
from torch._dynamo.testing import CompileCounter

import loopformer_hf

pytestmark = pytest.mark.usefixtures("one_thread")

L = 4  # the tiny config's num_loops
BUDGETS = [1, 2, L]
SCHEDULES = [None, [0.5, 0.25, 0.25], "coarse_to_fine"]  # a row's default, a non-uniform list, a preset
EPS = 0.5  # tests/loopformer/test_halting.py's: some tokens halt after 1-3 steps, others run all 4


def ids_and_left_padding(batch=3, length=7, seed=1):
    ids = torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # row 1 is two tokens shorter, padded on the left as generate pads
    ids[1, :2] = 0
    return ids, mask


def solo_knobs(b, knobs):
    """Row b's own `loop_budget` / `step_schedule` out of per-row `knobs`."""
    return {name: value[b].item() if isinstance(value, torch.Tensor) else value[b] for name, value in knobs.items()}


def check_rows_match_solo(model, knobs, **kw):
    """The logits (fp32, within 1e-5) and loop counts of each row of a per-row call equal a call of that row alone."""
    ids, mask = ids_and_left_padding()
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, **knobs, **kw)
        for b in range(ids.shape[0]):
            solo = model(ids[b : b + 1], attention_mask=mask[b : b + 1], **solo_knobs(b, knobs), **kw)
            real = mask[b].bool()
            torch.testing.assert_close(batched.logits[b, real], solo.logits[0, real], atol=1e-5, rtol=0)
            if kw.get("halt_eps") is not None:
                assert torch.equal(batched.loop_counts[b, real], solo.loop_counts[0, real])
    return batched


@pytest.mark.parametrize(
    "knobs",
    [
        {"loop_budget": BUDGETS},
        {"loop_budget": torch.tensor(BUDGETS)},
        {"step_schedule": SCHEDULES},
        {"loop_budget": [2, 3, L], "step_schedule": ["fine_to_coarse", [0.5, 0.25, 0.25], None]},
    ],
    ids=["list", "tensor", "schedules", "budgets_and_schedules"],
)
def test_each_row_computes_its_solo_call(tiny_model, knobs):
    check_rows_match_solo(tiny_model, knobs)


@pytest.mark.parametrize(
    "budgets", [[L, 2, 1], [1, 2, L], [L, 1, 2], [2, L, 2]], ids=["sorted", "ascending", "unsorted", "one_row_deeper"]
)
def test_rows_past_their_budget_leave_the_later_steps(tiny_model, budgets):
    """Mixed budgets cost their own depth: `generate` sorts the rows once per call (largest budget first), so the
    rows still looping at a step are a prefix of the batch and the step computes them alone (each block sees that
    many rows); every row still equals its solo call, and comes back in the caller's order."""
    seen = []
    hooks = [
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
        for block in tiny_model.model.layers
    ]
    ids, mask = ids_and_left_padding()
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, attention_mask=mask)
    try:
        with torch.no_grad():
            batched = tiny_model.generate(ids, loop_budget=torch.tensor(budgets), **kw)
    finally:
        for hook in hooks:
            hook.remove()
    k, largest = tiny_model.config.num_hidden_layers, max(budgets)
    live = [sum(m > i for m in budgets) for i in range(largest)]  # rows computed at each step
    assert seen == [n for n in live for _ in range(k)] * 4, seen  # the prefill and 3 decode steps
    with torch.no_grad():
        for b, budget in enumerate(budgets):
            kw["attention_mask"] = mask[b : b + 1]
            assert torch.equal(batched[b], tiny_model.generate(ids[b : b + 1], loop_budget=budget, **kw)[0])


@pytest.mark.parametrize("budgets", [[1, 2, L], [L, 1, 2]], ids=["ascending", "unsorted"])
def test_halted_rows_under_halt_eps_are_gathered_out(tiny_model, monkeypatch, budgets):
    """With `halt_eps` (halting's own loop) and halting's gather on (the tests' grids are below GATHER_MIN_GRID), rows
    past their budget are left out of the later steps, and each row equals its solo call."""
    from loopformer_hf import halting_loopformer

    monkeypatch.setattr(halting_loopformer, "GATHER_ACTIVE_FRACTION", 1.0)
    monkeypatch.setattr(halting_loopformer, "GATHER_MIN_GRID", 0)
    check_rows_match_solo(tiny_model, {"loop_budget": budgets}, halt_eps=EPS)
    ids, mask = ids_and_left_padding()
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, attention_mask=mask)
    with torch.no_grad():
        batched = tiny_model.generate(ids, loop_budget=torch.tensor(budgets), halt_eps=EPS, **kw)
        for b, budget in enumerate(budgets):
            kw["attention_mask"] = mask[b : b + 1]
            assert torch.equal(
                batched[b], tiny_model.generate(ids[b : b + 1], loop_budget=budget, halt_eps=EPS, **kw)[0]
            )


def test_beam_search_with_rows_sorted_by_budget_reorders_their_layers(tiny_model):
    """Rows given largest budget first keep the prefix layout under beam search: each step's cache layers hold that
    step's rows, and the beams' reordering stays within them. Each row equals its solo beam search."""
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=5, min_new_tokens=5, num_beams=3, do_sample=False)
    with torch.no_grad():
        batched = tiny_model.generate(ids, loop_budget=torch.tensor([L, 1]), **kw)
        for b, budget in enumerate([L, 1]):
            assert torch.equal(batched[b], tiny_model.generate(ids[b : b + 1], loop_budget=budget, **kw)[0])


@pytest.mark.parametrize("fill", ["reuse", "recompute"])
def test_each_row_computes_its_solo_call_with_halting(tiny_model, fill):
    """The state-change rule (the lab's rules: tests/lab/test_halting_rules.py)."""
    tiny_model.config.halt_kv_fill = fill
    out = check_rows_match_solo(tiny_model, {"loop_budget": BUDGETS}, halt_eps=EPS)
    assert out.loop_counts[2].min() < L and out.loop_counts[0].max() == 1  # halting acts inside the row of budget L


@pytest.mark.parametrize(
    "variant",
    [dict(loop_conditioning="timestep"), dict(loop_conditioning="none", block_norm_weight=True)],
    ids=["TMLT", "Base-Loop"],
)
def test_baselines_run_per_row_budgets(variant):
    torch.manual_seed(0)
    model = randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(**variant))).eval()
    check_rows_match_solo(model, {"loop_budget": BUDGETS})


def test_rows_sharing_one_budget_compute_what_one_budget_computes(tiny_model):
    """A list of equal budgets is the single-budget call, bit for bit; so is a tensor of them here."""
    ids, mask = ids_and_left_padding()
    with torch.no_grad():
        one = tiny_model(ids, attention_mask=mask, loop_budget=2).logits
        assert torch.equal(tiny_model(ids, attention_mask=mask, loop_budget=[2, 2, 2]).logits, one)
        assert torch.equal(
            tiny_model(ids, attention_mask=mask, step_schedule=[None, "uniform", [0.5, 0.5]], loop_budget=2).logits,
            one,
        )
        torch.testing.assert_close(
            tiny_model(ids, attention_mask=mask, loop_budget=torch.tensor([2, 2, 2])).logits, one, atol=1e-6, rtol=0
        )


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("halt_eps", [None, EPS])
def test_generate_gives_each_row_its_solo_tokens(tiny_model, cache_implementation, halt_eps):
    """Greedy tokens of each row of a left-padded batch equal that row's own `generate`, with the dynamic and the
    static cache, with and without halting; the cache serves the largest budget's slots."""
    ids, mask = ids_and_left_padding()
    kw = dict(
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        cache_implementation=cache_implementation,
        halt_eps=halt_eps,
        return_dict_in_generate=True,
    )
    knobs = {"loop_budget": torch.tensor([1, 3, L]), "step_schedule": SCHEDULES}
    with torch.no_grad():
        batched = tiny_model.generate(ids, attention_mask=mask, **knobs, **kw)
        for b in range(ids.shape[0]):
            solo = tiny_model.generate(ids[b : b + 1], attention_mask=mask[b : b + 1], **solo_knobs(b, knobs), **kw)
            assert torch.equal(batched.sequences[b], solo.sequences[0]), f"row {b}"
            if halt_eps is not None:
                real = mask[b].bool().tolist() + [True] * 5  # the prompt's real positions, then the generated ones
                assert torch.equal(batched.loop_counts[b, real], solo.loop_counts[0, real])
    assert len(cache_of(batched).loop_key[0]) == 3  # per-row trajectories, one per row


def test_cached_decode_equals_uncached_forward(tiny_model):
    ids, mask = ids_and_left_padding()
    knobs = {"loop_budget": [1, 3, L], "step_schedule": SCHEDULES}
    with torch.no_grad():
        full = tiny_model(ids, attention_mask=mask, use_cache=False, **knobs).logits
        out = tiny_model(ids[:, :4], attention_mask=mask[:, :4], **knobs)
        steps = [out.logits]
        for i in range(4, ids.shape[1]):
            out = tiny_model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=cache_of(out), **knobs)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_a_filled_cache_refuses_other_rows(tiny_model):
    ids, _ = ids_and_left_padding()
    with torch.no_grad():
        cache = cache_of(tiny_model(ids, loop_budget=torch.tensor([1, 2, L])))
        with pytest.raises(ValueError, match=r"filled under per-row trajectories .*this call runs per-row"):
            tiny_model(ids[:, :1], cache=cache, loop_budget=torch.tensor([2, 1, L]))
        with pytest.raises(ValueError, match=r"filled under per-row trajectories .*trajectory \[0.5, 0.5\]"):
            tiny_model(ids[:, :1], cache=cache, loop_budget=2)


@pytest.mark.parametrize("cache_implementation", ["static", None])
def test_compiled_decode_does_not_recompile_when_the_mix_of_budgets_changes(tiny_model, cache_implementation):
    """`model.forward = torch.compile(model.forward)`: per-row budgets as tensors are read outside the graph (one
    graph break: their values become the call's trajectories) and the loop compiles once per largest budget,
    whatever the mix of rows; eager's tokens."""
    ids, mask = ids_and_left_padding()
    mixes = [[1, 2, 4], [4, 1, 1], [2, 4, 2], [4, 4, 4], [1, 2, 2], [2, 1, 2]]
    kw = dict(
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
        attention_mask=mask,
        cache_implementation=cache_implementation,
    )
    dynamo.reset()
    try:
        with torch.no_grad():
            eager = [tiny_model.generate(ids, loop_budget=torch.tensor(m), **kw) for m in mixes]
            counter = CompileCounter()
            tiny_model.forward = torch.compile(tiny_model.forward, backend=counter)
            graphs = []
            with dynamo.config.patch(fail_on_recompile_limit_hit=True):
                for m, expected in zip(mixes, eager):
                    before = counter.frame_count
                    assert torch.equal(tiny_model.generate(ids, loop_budget=torch.tensor(m), **kw), expected), m
                    graphs.append(counter.frame_count - before)
    finally:
        dynamo.reset()
    # graphs for largest budget 4, then none for other mixes of it, then graphs for largest budget 2
    assert graphs[0] > 0 and graphs[1:4] == [0, 0, 0] and graphs[4] > 0 and graphs[5] == 0, graphs


def test_compiled_forward_without_cache_guards_on_the_largest_budget_only(tiny_model):
    """A compiled forward without a cache reads the per-row values once, outside the graph (a graph break), and
    compiles the loop once per largest budget."""
    ids, _ = ids_and_left_padding()
    dynamo.reset()
    try:
        counter = CompileCounter()
        compiled = torch.compile(tiny_model.forward, backend=counter)
        with torch.no_grad():
            frames = []
            for mix in ([1, 2, 4], [4, 1, 2], [4, 4, 4], [2, 1, 1], [1, 1, 2]):
                budgets = torch.tensor(mix)
                torch.testing.assert_close(
                    compiled(ids, loop_budget=budgets, use_cache=False).logits,
                    tiny_model(ids, loop_budget=budgets, use_cache=False).logits,
                    atol=1e-5,
                    rtol=0,
                )
                frames.append(counter.frame_count)
    finally:
        dynamo.reset()
    assert frames[0] == frames[1] == frames[2] and frames[3] > frames[2] and frames[4] == frames[3], frames


def test_a_per_row_budget_in_generation_config_saves_and_reloads(tmp_path):
    """generation_config.loop_budget = [1, 4] was saved, then the folder no longer loaded (issue 55): it reloads,
    and generate gives each row what that row's budget gives alone."""
    from support.hub_helpers import make_model
    from transformers import AutoModelForCausalLM

    model = make_model(seed=0).eval()
    model.generation_config.loop_budget = [1, 4]
    model.save_pretrained(tmp_path / "m")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert again.generation_config.loop_budget == [1, 4]
    ids = torch.randint(3, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rows = again.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        for row, budget in enumerate((1, 4)):
            alone = again.generate(
                ids[row : row + 1], max_new_tokens=4, do_sample=False, pad_token_id=0, loop_budget=budget
            )
            assert torch.equal(rows[row : row + 1], alone), row
