"""A KV cache that is right across loops (one slot per (loop step, block))."""

import pytest
import torch
from support.instruments import CountOps
from support.tiny_data import left_padded
from support.tiny_models import cache_of, randomize_modulation, tiny_loopformer_config
from transformers import DynamicCache, StaticCache

import loopformer_hf
from loopformer_hf import LoopFormerCache, LoopFormerStaticCache
from loopformer_hf.modeling_loopformer import CACHE_FIELD

pytestmark = pytest.mark.filterwarnings("ignore:LoopFormer trajectory")

SCHEDULES = [(M, None) for M in range(1, 5)] + [(None, [0.5, 0.25, 0.125, 0.125]), (None, "coarse_to_fine")]


@pytest.mark.filterwarnings("ignore:LoopFormer trajectory")
@pytest.mark.parametrize("budget,schedule", SCHEDULES)
def test_prefill_plus_decode_equals_uncached_forward(tiny_model, budget, schedule):
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (2, 30))
    full = tiny_model(ids, loop_budget=budget, step_schedule=schedule, use_cache=False).logits
    out = tiny_model(ids[:, :10], loop_budget=budget, step_schedule=schedule, use_cache=True)
    cache, pieces = cache_of(out), [out.logits]
    for i in range(10, 30):  # 20 single-token decode steps
        out = tiny_model(ids[:, i : i + 1], cache=cache, loop_budget=budget, step_schedule=schedule, use_cache=True)
        cache = cache_of(out)
        pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)
    steps = len(tiny_model.config.resolve_trajectory(budget, schedule))
    assert len(cache.layers) == steps * tiny_model.config.num_hidden_layers


def test_past_key_values_name_is_accepted(tiny_model):
    """transformers <= 5.23 passes the cache as `past_key_values`; it must not be ignored."""
    ids = torch.randint(3, 97, (1, 12))
    full = tiny_model(ids, use_cache=False).logits
    out = tiny_model(ids[:, :8], use_cache=True)
    step = tiny_model(ids[:, 8:], past_key_values=cache_of(out), use_cache=True)
    torch.testing.assert_close(step.logits, full[:, 8:], atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:LoopFormer trajectory")
@pytest.mark.parametrize("kwargs", [{"loop_budget": 1}, {"loop_budget": 3}, {"step_schedule": [0.5, 0.25, 0.25]}, {}])
def test_greedy_generate_with_and_without_cache_agree(tiny_model, kwargs):
    ids = torch.randint(3, 97, (2, 6))
    cached = tiny_model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, **kwargs)
    uncached = tiny_model.generate(
        ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, use_cache=False, **kwargs
    )
    assert cached.shape == (2, 26)
    assert torch.equal(cached, uncached)


def test_generate_grows_the_cache_generate_built(tiny_model):
    """generate() builds DynamicCache(config) with num_hidden_layers slots; budget 4 needs 4 x 2 slots."""
    seen = []
    hook = tiny_model.model.register_forward_pre_hook(
        lambda mod, args, kw: seen.append(kw.get(CACHE_FIELD)), with_kwargs=True
    )
    try:
        tiny_model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=3, do_sample=False, loop_budget=4)
    finally:
        hook.remove()
    assert len(seen) == 3
    assert isinstance(seen[0], LoopFormerCache)  # built through generate's cache hook, not swapped in forward
    assert seen[0] is seen[1] is seen[2]  # decode steps reuse the cache the prefill filled
    assert len(seen[2].layers) == 4 * 2


@pytest.mark.parametrize("sdpa", [True, False])
def test_left_padded_batch_generates_like_each_prompt_alone(tiny_config, sdpa):
    torch.manual_seed(0)
    impl = "sdpa" if sdpa else "eager"
    model = randomize_modulation(
        loopformer_hf.LoopFormerForCausalLM._from_config(tiny_config, attn_implementation=impl)
    )
    model.eval()
    prompts = [torch.randint(3, 97, (n,)) for n in (3, 9, 6)]
    ids, mask = left_padded(prompts, tiny_config.pad_token_id)
    width = ids.shape[1]
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, step_schedule=[0.5, 0.25, 0.25], pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, **kw)
    for row, p in enumerate(prompts):
        alone = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **kw)
        assert torch.equal(batched[row, width:], alone[0, len(p) :]), f"prompt {row} differs when batched"


@pytest.mark.parametrize(
    "first,second",
    [({"loop_budget": 2}, {"loop_budget": 4}), ({"step_schedule": [0.75, 0.25]}, {"step_schedule": [0.5, 0.5]})],
)
def test_reusing_a_cache_under_another_trajectory_raises(tiny_model, first, second):
    ids = torch.randint(3, 97, (1, 8))
    out = tiny_model(ids, use_cache=True, **first)
    with pytest.raises(ValueError, match="cache was filled under trajectory"):
        tiny_model(ids[:, :1], cache=cache_of(out), use_cache=True, **second)
    # the same trajectory still works with that cache
    tiny_model(ids[:, :1], cache=cache_of(out), use_cache=True, **first)


def test_foreign_cache_without_trajectory_record_raises(tiny_model):
    cache = DynamicCache()
    k = torch.zeros(1, 4, 3, 16)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="unknown trajectory"):
        tiny_model(torch.randint(3, 97, (1, 1)), cache=cache, use_cache=True)


def test_user_supplied_empty_cache_is_filled_in_place(tiny_model):
    cache = LoopFormerCache()
    out = tiny_model(torch.randint(3, 97, (1, 5)), cache=cache, use_cache=True, loop_budget=2)
    assert cache_of(out) is cache and cache.get_seq_length() == 5 and len(cache.layers) == 4
    assert cache.loop_key == ((0.5, 0.5), None)


@pytest.mark.parametrize("with_config", [True, False])
def test_a_plain_dynamic_cache_is_filled_in_place(tiny_model, with_config):
    """A plain DynamicCache (`DynamicCache(config)` has num_hidden_layers layers that never grow) gets the layers it
    lacks, one per (loop step, block), and is filled in place."""
    ids = torch.randint(3, 97, (1, 6))
    full = tiny_model(ids, use_cache=False).logits
    cache = DynamicCache(config=tiny_model.config) if with_config else DynamicCache()
    out = tiny_model(ids[:, :5], cache=cache, use_cache=True)
    assert cache_of(out) is cache and len(cache.layers) == 4 * 2
    step = tiny_model(ids[:, 5:], cache=cache_of(out), use_cache=True)
    torch.testing.assert_close(step.logits, full[:, 5:], atol=1e-5, rtol=0)


def test_an_empty_cache_of_another_kind_is_refused(tiny_model):
    cache = StaticCache(config=tiny_model.config, max_cache_len=16)
    with pytest.raises(ValueError, match="StaticCache holds 2 layers, but .* needs 8 .*LoopFormerStaticCache"):
        tiny_model(torch.randint(3, 97, (1, 4)), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="must be a transformers Cache instance, got tuple"):
        tiny_model(torch.randint(3, 97, (1, 4)), cache=(), use_cache=True)


def test_a_cached_decode_step_dispatches_fewer_ops_than_the_iso_flop_llama():
    """At decode, time goes to per-op overhead more than to FLOPs: the loop's adaLN vectors are computed once per
    generation (not per token and block), so k blocks looped L times issue fewer tensor ops than a Llama of k·L
    layers with the same widths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    looped = loopformer_hf.LoopFormerForCausalLM(
        tiny_loopformer_config(hidden_act="swiglu", attn_implementation="sdpa")
    ).eval()
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=128,
            num_hidden_layers=looped.config.num_hidden_layers * looped.config.num_loops,
            pad_token_id=0,
            attn_implementation="sdpa",
        )
    ).eval()
    ids = torch.randint(3, 97, (1, 9))
    counts = {}
    for name, model in (("looped", looped), ("llama", llama)):
        with torch.no_grad():
            cache = cache_of(model(ids[:, :8], attention_mask=torch.ones(1, 8, dtype=torch.long), use_cache=True))
            with CountOps() as ops:
                model(
                    ids[:, 8:],
                    attention_mask=torch.ones(1, 9, dtype=torch.long),
                    use_cache=True,
                    **{CACHE_FIELD: cache},
                )
        counts[name] = ops.count
    assert 0 < counts["looped"] < counts["llama"], counts


def test_a_cache_built_with_the_config_is_filled_per_loop_step(tiny_model):
    """`LoopFormerCache(config=model.config)`, built as one builds `DynamicCache(config=...)`, still gets one slot per
    (loop step, block) instead of the config's one layer per block."""
    ids = torch.randint(3, 97, (1, 10))
    cache = LoopFormerCache(config=tiny_model.config)
    tiny_model(ids[:, :6], cache=cache, use_cache=True)
    step = tiny_model(ids[:, 6:], cache=cache, use_cache=True)
    full = tiny_model(ids, use_cache=False)
    torch.testing.assert_close(step.logits, full.logits[:, 6:], atol=1e-5, rtol=0)
    assert len(cache.layers) == tiny_model.config.num_loops * tiny_model.config.num_hidden_layers


@pytest.mark.parametrize("where", ["config", "kwarg"])
def test_a_cache_passed_in_is_filled_even_with_use_cache_false(tiny_model, where):
    """As Llama: `use_cache` only decides whether to start a cache. A cache the caller passes is filled and read
    (it was ignored with `config.use_cache=False`, common after checkpointed fine-tuning: decoding then gave the
    logits of the new token alone)."""
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    kw = {} if where == "config" else dict(use_cache=False)
    if where == "config":
        tiny_model.config.use_cache = False
    cache = LoopFormerCache()
    with torch.no_grad():
        tiny_model(ids[:, :4], cache=cache, **kw)
        step = tiny_model(ids[:, 4:], cache=cache, **kw).logits[0, -1]
        full = tiny_model(ids).logits[0, -1]
    assert cache.get_seq_length() == 5
    torch.testing.assert_close(step, full, rtol=0, atol=1e-5)


def test_an_offloading_cache_keeps_offloading_when_replaced(tiny_model, monkeypatch):
    """`generate(cache_implementation="offloaded")` builds `DynamicCache(offloading=True)`; the LoopFormer cache that
    replaces it offloads too, instead of silently not."""
    from transformers import GenerationConfig
    from transformers.generation import GenerationMixin

    monkeypatch.setattr(GenerationMixin, "_prepare_cache_for_generation", lambda *args, **kwargs: None)
    kwargs = {CACHE_FIELD: DynamicCache(offloading=True, offload_only_non_sliding=True)}
    tiny_model._prepare_cache_for_generation(GenerationConfig(), kwargs)
    assert type(kwargs[CACHE_FIELD]) is LoopFormerCache
    assert kwargs[CACHE_FIELD].offloading and kwargs[CACHE_FIELD].only_non_sliding


def test_a_request_is_resolved_once_and_the_decode_steps_reuse_it(tiny_model, monkeypatch):
    """A (budget, schedule) request is resolved and checked once and remembered by the model: the decode steps of a
    `generate` call (and later calls with the same request) do not validate the budget and schedule again."""
    resolved = []
    resolve = type(tiny_model.config).resolve_trajectory
    monkeypatch.setattr(
        type(tiny_model.config),
        "resolve_trajectory",
        lambda self, *a, **k: resolved.append(a) or resolve(self, *a, **k),
    )
    ids = torch.randint(3, 97, (2, 5))
    kw = dict(
        max_new_tokens=6, do_sample=False, loop_budget=2, step_schedule=[0.75, 0.25], return_dict_in_generate=True
    )
    out = tiny_model.generate(ids, halt_eps=0.5, **kw)
    assert cache_of(out).loop_key == ((0.75, 0.25), 0.5)
    assert len(resolved) == 1  # the prefill's; none by the 5 decode steps
    tiny_model.generate(ids, **kw)
    assert len(resolved) == 1  # remembered
    resolved.clear()
    # per-row budgets for rows repeated by num_return_sequences, into a preallocated cache: the cache hook sizes it,
    # the prefill resolves, the decode steps reuse
    out = tiny_model.generate(
        ids,
        max_new_tokens=3,
        do_sample=True,
        num_return_sequences=2,
        loop_budget=[1, 2, 2, 1],
        cache_implementation="static",
        return_dict_in_generate=True,
    )
    assert len(resolved) == 2 * 4
    assert cache_of(out).loop_key == (((1.0,), (0.5, 0.5), (0.5, 0.5), (1.0,)), None)


# ---- the preallocated cache ------------------------------------------------------------------------------------------
# The preallocated loop cache (LoopFormerStaticCache) is exact against the dynamic one (the lab's shared cache:
# tests/lab/test_cache_sharing.py).

TRAJECTORIES = [{"loop_budget": M} for M in range(1, 5)] + [{"step_schedule": [0.5, 0.25, 0.125, 0.125]}]


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
    kw = dict(
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **trajectory,
    )
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
    model = (
        randomize_modulation(
            loopformer_hf.LoopFormerForCausalLM._from_config(config, attn_implementation=attn), std=0.3
        )
        .double()
        .eval()
    )
    prompts = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 6)]
    ids, mask = left_padded(prompts, config.pad_token_id)
    width = ids.shape[1]
    kw = dict(
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        step_schedule=[0.5, 0.25, 0.25],
        return_dict_in_generate=True,
        output_logits=True,
        attention_mask=mask,
    )
    static = model.generate(ids, cache_implementation="static", **kw)
    dynamic = model.generate(ids, **kw)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert_logits_match(torch.stack(static.logits), torch.stack(dynamic.logits))
    assert len(set(static.sequences[:, width:].flatten().tolist())) > 3  # tokens vary: the comparison has teeth


def test_static_cache_refuses_what_it_cannot_hold(model):
    cache = LoopFormerStaticCache(model.config, max_cache_len=8, max_loop_budget=2)
    with pytest.raises(ValueError, match="holds 4 layers, but trajectory .* needs 6 .*max_loop_budget=3"):
        model(torch.randint(3, 97, (1, 4)), cache=cache, use_cache=True, loop_budget=3)
    model(torch.randint(3, 97, (1, 6)), cache=cache, use_cache=True, loop_budget=2)
    with pytest.raises(ValueError, match="max_cache_len=8 tokens; it has 6 and this call adds 3"):
        model(torch.randint(3, 97, (1, 3)), cache=cache, use_cache=True, loop_budget=2)
    with pytest.raises(ValueError, match="cache was filled under trajectory \\[0.5, 0.5\\]"):
        model(torch.randint(3, 97, (1, 1)), cache=cache, use_cache=True, loop_budget=1)
    cache.reset()  # an emptied cache takes a new trajectory
    model(torch.randint(3, 97, (1, 2)), cache=cache, use_cache=True, loop_budget=1)
    assert cache.loop_key == ((1.0,), None) and int(cache.get_seq_length()) == 2
    for bad in ({"max_cache_len": 0}, {"max_cache_len": 8, "max_loop_budget": 0}):
        with pytest.raises(ValueError, match="must be"):
            LoopFormerStaticCache(model.config, **bad)


def test_plain_static_cache_is_refused_with_the_looped_alternative(model):
    with pytest.raises(ValueError, match="StaticCache holds 2 layers, but .* needs 8 .*LoopFormerStaticCache"):
        model(torch.randint(3, 97, (1, 4)), cache=StaticCache(config=model.config, max_cache_len=16), use_cache=True)


def test_a_saved_config_with_the_removed_cache_sharing_fields_loads_with_a_warning_naming_the_lab(tmp_path, caplog):
    """`cache_sharing`/`cache_share_n` were config fields until the shared cache moved to the lab: a config.json that
    says "none" (every saved one but the lab's) loads silently to the same model; "modulo" loads too (the model runs
    the exact cache), with a warning naming the lab's cache object."""
    import json
    import logging
    import warnings

    config = tiny_loopformer_config()
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for sharing in ("none", "modulo"):
        (tmp_path / "config.json").write_text(json.dumps({**saved, "cache_sharing": sharing, "cache_share_n": 2}))
        caplog.clear()
        with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
            warnings.simplefilter("error")
            loaded = loopformer_hf.LoopFormerConfig.from_pretrained(tmp_path)
        assert loaded.to_dict() == config.to_dict() and not hasattr(loaded, "cache_sharing")
        said = [r.getMessage() for r in caplog.records if "cache_sharing" in r.getMessage()]
        if sharing == "modulo":
            assert said and "ModuloSharedCache" in said[0] and "ignored" in said[0], said
        else:
            assert not said, said


@pytest.mark.parametrize("fill", ["reuse", "recompute"])
def test_halting_generate_with_a_static_cache_matches_the_dynamic_cache(tiny_model, fill):
    """Per-token halting writes the skipped slots in place in a static cache and defers them in the dynamic one;
    tokens, logits and loop counts agree, left-padded batch included."""
    tiny_model.config.halt_kv_fill = fill
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    runs = [
        tiny_model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            halt_eps=0.5,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
        for kwargs in ({}, {"cache_implementation": "static"})
    ]
    dynamic, static = runs
    assert len(set(dynamic.loop_counts[:, 6:].flatten().tolist())) > 1  # generated tokens halt at different steps
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.loop_counts, dynamic.loop_counts)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=0)
