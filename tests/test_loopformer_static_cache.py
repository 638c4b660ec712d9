"""The preallocated loop cache (LoopFormerStaticCache) is exact against the dynamic one, and the opt-in
shared cache (cache_sharing="modulo") holds n step slots per block whatever the budget."""

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import StaticCache

from tiny_models import cache_of, randomize_modulation, tiny_loopformer_config
import loopformer_hf
from loopformer_hf import LoopFormerCache, LoopFormerStaticCache
from loopformer_hf.modeling_loopformer import CACHE_FIELD

TRAJECTORIES = [{"loop_budget": M} for M in range(1, 5)] + [{"step_schedule": [0.5, 0.25, 0.125, 0.125]}]
pytestmark = pytest.mark.filterwarnings("ignore:LoopFormer trajectory")


def _model(**overrides):
    """Large random weights, so that greedy tokens vary from step to step and differ between budgets."""
    torch.manual_seed(0)
    config = tiny_loopformer_config(initializer_range=0.3, **overrides)
    return randomize_modulation(loopformer_hf.LoopFormerForCausalLM(config), std=0.3).double().eval()


def assert_logits_match(got, expected):
    """Exact up to float64 round-off. These large random weights make the loop chaotic: in fp32 the round-off of the
    masked (static) and the causal (dynamic) attention paths grows to 1e-2 on logits of 8 after four loop steps,
    while in float64 the two agree to the last bit (measured 0.0). The fp32 bound (1e-5) is checked at
    the default initialisation: test_static_cache_at_default_init_within_1e_5."""
    torch.testing.assert_close(got, expected, atol=1e-9, rtol=0)


@pytest.fixture(scope="module")
def model():
    return _model()


def _prefill_then_decode(model, ids, cache, prompt_len=10, **trajectory):
    out = model(ids[:, :prompt_len], cache=cache, use_cache=True, **trajectory)
    pieces = [out.logits]
    for i in range(prompt_len, ids.shape[1]):
        out = model(ids[:, i : i + 1], cache=cache_of(out), use_cache=True, **trajectory)
        pieces.append(out.logits)
    return torch.cat(pieces, 1), cache_of(out)


@pytest.mark.parametrize("trajectory", TRAJECTORIES)
def test_static_cache_forward_matches_dynamic(model, trajectory):
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    dynamic, _ = _prefill_then_decode(model, ids, LoopFormerCache(), **trajectory)
    cache = LoopFormerStaticCache(model.config, max_cache_len=32)  # sized for the default budget, num_loops = 4
    static, returned = _prefill_then_decode(model, ids, cache, **trajectory)
    assert_logits_match(static, dynamic)
    steps = len(model.config.resolve_trajectory(trajectory.get("loop_budget"), trajectory.get("step_schedule")))
    assert returned is cache and int(cache.get_seq_length()) == 24
    # slots of the steps this trajectory ran were written, the others never allocated
    assert [layer.is_initialized for layer in cache.layers] == [True] * 2 * steps + [False] * 2 * (4 - steps)


@pytest.mark.parametrize("trajectory", TRAJECTORIES)
def test_static_cache_at_default_init_within_1e_5(trajectory):
    torch.manual_seed(0)
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config()).eval()
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    dynamic, _ = _prefill_then_decode(model, ids, LoopFormerCache(), **trajectory)
    static, _ = _prefill_then_decode(model, ids, LoopFormerStaticCache(model.config, max_cache_len=32), **trajectory)
    torch.testing.assert_close(static, dynamic, atol=1e-5, rtol=0)


@pytest.mark.parametrize("trajectory", TRAJECTORIES)
def test_generate_static_matches_dynamic(model, trajectory):
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True,
              **trajectory)
    seen = []
    hook = model.model.register_forward_pre_hook(lambda mod, a, k: seen.append(k.get(CACHE_FIELD)), with_kwargs=True)
    try:
        static = model.generate(ids, cache_implementation="static", **kw)
    finally:
        hook.remove()
    dynamic = model.generate(ids, **kw)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert_logits_match(torch.stack(static.logits), torch.stack(dynamic.logits))
    steps = len(model.config.resolve_trajectory(trajectory.get("loop_budget"), trajectory.get("step_schedule")))
    assert isinstance(seen[0], LoopFormerStaticCache) and all(c is seen[0] for c in seen)
    assert len(seen[0].layers) == steps * 2  # budget x k slots of max_length - 1 = 17 tokens (or a previous call's)
    assert seen[0].layers[0].keys.shape[2] >= 17


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_left_padded_batch_static_matches_dynamic(attn):
    torch.manual_seed(0)
    config = tiny_loopformer_config(initializer_range=0.3)
    model = randomize_modulation(
        loopformer_hf.LoopFormerForCausalLM._from_config(config, attn_implementation=attn), std=0.3
    ).double().eval()
    prompts = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.full((3, width), config.pad_token_id)
    mask = torch.zeros((3, width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, step_schedule=[0.5, 0.25, 0.25],
              return_dict_in_generate=True, output_logits=True, attention_mask=mask)
    static = model.generate(ids, cache_implementation="static", **kw)
    dynamic = model.generate(ids, **kw)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert_logits_match(torch.stack(static.logits), torch.stack(dynamic.logits))
    assert len(set(static.sequences[:, width:].flatten().tolist())) > 3  # tokens vary: the comparison has teeth


def test_static_cache_refuses_what_it_cannot_hold(model):
    cache = LoopFormerStaticCache(model.config, max_cache_len=8, max_loop_budget=2)
    with pytest.raises(ValueError, match="holds 4 slots, but trajectory .* needs 6 .*max_loop_budget=3"):
        model(torch.randint(3, 97, (1, 4)), cache=cache, use_cache=True, loop_budget=3)
    model(torch.randint(3, 97, (1, 6)), cache=cache, use_cache=True, loop_budget=2)
    with pytest.raises(ValueError, match="max_cache_len=8 tokens; it has 6 and this call adds 3"):
        model(torch.randint(3, 97, (1, 3)), cache=cache, use_cache=True, loop_budget=2)
    with pytest.raises(ValueError, match="cache was filled under trajectory \\[0.5, 0.5\\]"):
        model(torch.randint(3, 97, (1, 1)), cache=cache, use_cache=True, loop_budget=1)
    cache.reset()  # an emptied cache takes a new trajectory
    model(torch.randint(3, 97, (1, 2)), cache=cache, use_cache=True, loop_budget=1)
    assert cache.spec.trajectory == (1.0,) and int(cache.get_seq_length()) == 2
    for bad in ({"max_cache_len": 0}, {"max_cache_len": 8, "max_loop_budget": 0}):
        with pytest.raises(ValueError, match="must be"):
            LoopFormerStaticCache(model.config, **bad)


def test_plain_static_cache_is_refused_with_the_looped_alternative(model):
    with pytest.raises(ValueError, match="needs 8 cache slots .* got an empty StaticCache.*LoopFormerStaticCache"):
        model(torch.randint(3, 97, (1, 4)), cache=StaticCache(config=model.config, max_cache_len=16), use_cache=True)


# ---- cache sharing (approximation) -----------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["dynamic", "static"])
def test_shared_cache_holds_n_step_slots_and_is_exact_within_a_call(storage):
    model = _model(cache_sharing="modulo", cache_share_n=2)
    exact = _model()
    ids = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(3))

    def new_cache(m):
        return LoopFormerCache() if storage == "dynamic" else LoopFormerStaticCache(m.config, max_cache_len=20)

    # one call (the prompt) attends within itself: exact
    prompt = model(ids, cache=new_cache(model), use_cache=True, loop_budget=4)
    assert_logits_match(prompt.logits, exact(ids, use_cache=False, loop_budget=4).logits)
    assert len(cache_of(prompt).layers) == 2 * 2  # n x k slots for budget 4 (the exact cache has 4 x 2)
    # budget <= n never wraps: decoding is exact
    shared_2, _ = _prefill_then_decode(model, ids, new_cache(model), loop_budget=2)
    exact_2, _ = _prefill_then_decode(exact, ids, LoopFormerCache(), loop_budget=2)
    assert_logits_match(shared_2, exact_2)
    # budget 4 > n: decode steps read earlier tokens' later steps; an approximation, equal in both storages
    shared_4, cache = _prefill_then_decode(model, ids, new_cache(model), loop_budget=4)
    exact_4, _ = _prefill_then_decode(exact, ids, LoopFormerCache(), loop_budget=4)
    assert not torch.allclose(shared_4[:, 10:], exact_4[:, 10:], atol=1e-3)
    assert_logits_match(shared_4[:, :10], exact_4[:, :10])
    assert int(cache.get_seq_length()) == 20 and cache.spec.share_n == 2
    other, _ = _prefill_then_decode(model, ids, LoopFormerCache() if storage == "static" else
                                    LoopFormerStaticCache(model.config, max_cache_len=20), loop_budget=4)
    assert_logits_match(other, shared_4)


def test_shared_cache_from_generate_and_refused_under_exact_config():
    model = _model(cache_sharing="modulo", cache_share_n=2)
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, loop_budget=4, return_dict_in_generate=True)
    assert isinstance(cache_of(out), LoopFormerCache) and len(cache_of(out).layers) == 2 * 2
    static = model.generate(ids, max_new_tokens=4, do_sample=False, loop_budget=4, cache_implementation="static",
                            return_dict_in_generate=True)
    assert len(cache_of(static).layers) == 2 * 2 and torch.equal(static.sequences, out.sequences)
    model.config.cache_sharing = "none"  # the filled cache records its sharing: the exact model refuses it
    with pytest.raises(ValueError, match="cache shared modulo 2.* but this call runs trajectory"):
        model(ids[:, :1], cache=cache_of(out), use_cache=True, loop_budget=4)


@pytest.mark.parametrize("field,value", [("cache_sharing", "latest"), ("cache_share_n", 0)])
def test_cache_sharing_fields_are_validated(field, value):
    with pytest.raises(StrictDataclassError, match=field):
        tiny_loopformer_config(**{field: value})


@pytest.mark.parametrize("fill", ["reuse", "recompute"])
def test_halting_generate_with_a_static_cache_matches_the_dynamic_cache(tiny_model, fill):
    """Per-token halting writes the skipped slots in place in a static cache and defers them in the dynamic one;
    tokens, logits and loop counts agree, left-padded batch included."""
    tiny_model.config.halt_kv_fill = fill
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    runs = [tiny_model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, halt_eps=0.5,
                                return_dict_in_generate=True, output_logits=True, **kwargs)
            for kwargs in ({}, {"cache_implementation": "static"})]
    dynamic, static = runs
    assert len(set(dynamic.loop_counts[:, 6:].flatten().tolist())) > 1  # generated tokens halt at different steps
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.loop_counts, dynamic.loop_counts)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=0)
