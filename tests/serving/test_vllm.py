"""LoopFormer served by vLLM (loopformer_hf/vllm_model.py) equals `model.generate`.

Run by scripts/test_vllm.sh in .venv-vllm (vLLM's own environment); skipped where vllm is not importable (the main
suite in .venv). Every vLLM engine start costs about a minute here, so one subprocess (this file run as a script,
`drive`) builds one `LLM` per server configuration in sequence and writes what it generated to JSON; the tests
below compare that with `generate` in this process. The subprocess never imports loopformer_hf: vLLM finds the
model through the `vllm.general_plugins` entry point alone, as a user's `LLM(model=CKPT)` would.

The checkpoints are made here: weights drawn with initializer_range 0.1 and the adaLN gates opened (random modulation
weights, bias 0.5), so that the budget, the schedule and each block's gates change the outputs; the LoopFormer one is
then trained for 30 AdamW steps on a synthetic corpus (the variants stay random: each training costs about a minute
on this CPU). Fewer than a few hundred steps leave a model that repeats one token, and more cost minutes.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.vllm

if __name__ != "__main__":
    pytest.importorskip(
        "vllm", reason="vLLM is not installed here: scripts/test_vllm.sh runs these tests in .venv-vllm"
    )

import torch  # noqa: E402

PROMPTS = ["12+7=", "3+4=7;5+", "100+23=123;8+9=17;6", "4"]  # different lengths in one batch
MAX_NEW_TOKENS = 12
HIDDEN, HEADS = 128, 2  # head_dim 64: vLLM's CPU attention refuses 16 and 32 is not in its list either
VARIANTS = {
    # name: config overrides (TMLT with RoPE, Base-Loop with SwiGLU, Base with grouped-query attention: each
    # variant also takes one other code path of the vLLM model)
    "loopformer": dict(loop_conditioning="shortcut", num_hidden_layers=2, num_loops=3),
    "tmlt": dict(loop_conditioning="timestep", num_hidden_layers=2, num_loops=3, position_embedding_type="rope"),
    # transformers' `rope_parameters` reach vLLM's own RoPE: linear scaling of half of each head
    "tmlt_scaled_rope": dict(
        loop_conditioning="timestep",
        num_hidden_layers=2,
        num_loops=3,
        position_embedding_type="rope",
        rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
    ),
    "base_loop": dict(
        loop_conditioning="none", block_norm_weight=True, num_hidden_layers=2, num_loops=3, hidden_act="swiglu"
    ),
    "base": dict(
        loop_conditioning="none",
        block_norm_weight=True,
        num_hidden_layers=6,
        num_loops=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
}
# name -> (checkpoint, --hf-overrides, (loop_budget, step_schedule) that `generate` gets). The loopformer checkpoint's
# generation_config.json says loop_budget=2, step_schedule="coarse_to_fine": job "lf_c2f" uses it as saved.
JOBS = {
    "lf_c2f": ("loopformer", {}, (2, "coarse_to_fine")),
    "lf_M1": ("loopformer", {"loop_budget": 1, "step_schedule": "uniform"}, (1, "uniform")),
    "lf_M2": ("loopformer", {"loop_budget": 2, "step_schedule": "uniform"}, (2, "uniform")),
    "lf_M3": ("loopformer", {"loop_budget": 3, "step_schedule": "uniform"}, (3, "uniform")),
    "tmlt_M2": ("tmlt", {"loop_budget": 2}, (2, "uniform")),
    "tmlt_scaled_rope_M2": ("tmlt_scaled_rope", {"loop_budget": 2}, (2, "uniform")),
    "base_loop_M3": ("base_loop", {}, (3, "uniform")),
    "base_M1": ("base", {}, (1, "uniform")),
    # a repo in the authors' Hub layout (their config keys and weight names): translated on load, as by from_pretrained
    "authors_M2": ("authors", {"loop_budget": 2}, (2, "uniform")),
    # per-request trajectories (PER_REQUEST) next to the server's own, which stays the saved one
    "lf_per_request": ("loopformer", {"max_request_loop_budget": 4}, (2, "coarse_to_fine")),
    # speculative decoding, the draft the same weights at budget 1 (a second folder: write_draft_checkpoint)
    "lf_spec_d1": ("loopformer", {"loop_budget": 3, "step_schedule": "uniform"}, (3, "uniform")),
}
PER_REQUEST_JOB = "lf_per_request"
SPECULATIVE_JOB, DRAFT_BUDGET, DRAFT_TOKENS = "lf_spec_d1", 1, 3
# (prompt, loop_budget, step_schedule, engine step at which it arrives): budgets {1, 2, 4, L=3} under two schedules,
# arriving while the earlier ones decode; None: no extra_args, the server's trajectory
PER_REQUEST = [
    (p, budget, schedule, arrival)
    for arrival, schedule in ((0, "uniform"), (3, "coarse_to_fine"), (6, "fine_to_coarse"))
    for p, budget in enumerate((1, 2, 4, 3))
] + [(0, None, None, 3), (2, None, None, 6)]
# the same long prompt (more than a cache block) in turn under trajectories that differ, each after the previous ended
PREFIX_SEQUENCE = [(2, "uniform"), (3, "uniform"), (2, "coarse_to_fine"), (2, "uniform")]
PREFIX_BLOCK_SIZE = 32  # vLLM's CPU default, 128, is longer than any prompt here: no block would be reused
BAD_REQUESTS = [  # extra_args -> what the refusal must say (each names the value)
    ({"loop_budget": 0}, "`loop_budget` must be an integer >= 1, got 0"),
    ({"loop_budget": 5}, "`loop_budget`=5 exceeds this server's largest per-request loop budget, 4"),
    ({"step_schedule": [0.3, 0.3]}, "`step_schedule` must sum to 1 within 1e-06, got [0.3, 0.3]"),
    ({"loop_budget": "two"}, "`loop_budget` must be an integer >= 1, got 'two'"),
    ({"halt_eps": 0.1}, "halt_eps=0.1 (per-token halting) is not supported"),
]
SAMPLING_JOB = "lf_M3"  # also runs seeded sampling
LLM_KWARGS = dict(
    dtype="float32",
    max_model_len=128,
    enforce_eager=True,
    seed=0,
    # the engine and its worker in this process: no ~30 s import of vLLM in two spawned processes
    distributed_executor_backend="uni",
)
LOGPROB_ATOL = 1e-4


# ---- checkpoints ----------------------------------------------------------------------------------------------------


def _corpus(n=400, seed=0):
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(200), rng.randrange(200)
        rows.append(f"{a}+{b}={a + b};")
    return "".join(rows)


TRAINING_STEPS = {"loopformer": 30}  # the other variants: random weights


def build_checkpoint(path, variant, steps=0, lr=1e-3, initializer_range=0.1, seed=0):
    """A small LoopFormer variant, trained for `steps` AdamW steps on the corpus; saved with its tokenizer."""
    import loopformer_hf
    from looped_training.loopformer.data.tokenizer import train_bpe_tokenizer

    text = _corpus()
    tokenizer = train_bpe_tokenizer([text[i : i + 2000] for i in range(0, len(text), 2000)], 300)
    overrides = dict(VARIANTS[variant])
    config = loopformer_hf.LoopFormerConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        num_attention_heads=overrides.pop("num_attention_heads", HEADS),
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=None,
        bos_token_id=None,
        initializer_range=initializer_range,
        **overrides,
    )
    torch.manual_seed(seed)
    model = loopformer_hf.LoopFormerForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # open the adaLN gates (the reference init leaves them near 0)
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (0.5 if name.endswith("bias") else 0.0))
    ids = torch.tensor(tokenizer(text)["input_ids"])
    window, batch = 32, 8
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = None
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - window, (batch,), generator=g)
        rows = torch.stack([ids[s : s + window] for s in starts.tolist()])
        loss = model(input_ids=rows, labels=rows, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    if variant == "loopformer":
        model.generation_config.loop_budget = 2
        model.generation_config.step_schedule = "coarse_to_fine"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return None if loss is None else loss.item()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_checkpoints")
    paths = {}
    for variant in VARIANTS:
        paths[variant] = str(root / variant)
        build_checkpoint(paths[variant], variant, steps=TRAINING_STEPS.get(variant, 0))
    paths["authors"] = build_authors_checkpoint(root / "authors", tokenizer_from=paths["loopformer"])
    return paths


def build_authors_checkpoint(path, tokenizer_from):
    """A random LoopFormer 2x3 written in the authors' Hub layout (tests/support/reference_oracle.py), with the tokenizer of
    `tokenizer_from`, so that the same prompts run on it."""
    from transformers import AutoTokenizer

    from support.reference_oracle import write_authors_repo

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    write_authors_repo(path, d=HIDDEN, n_head=HEADS, n_layer=2, block=128, loops=3, tokenizer=tokenizer)
    return str(path)


# ---- the vLLM side: one subprocess, one LLM per job -----------------------------------------------------------------


def drive(spec_path, out_path):
    """Build one `LLM` per job of the spec in turn; write greedy tokens and logprobs (and seeded samples)."""
    from vllm import LLM, SamplingParams

    spec = json.load(open(spec_path))
    results = {}
    for name, job in spec["jobs"].items():
        started = time.perf_counter()
        try:
            llm = LLM(model=job["checkpoint"], hf_overrides=job["overrides"], **LLM_KWARGS, **job.get("llm", {}))
        except Exception as error:  # noqa: BLE001 -- recorded for the refusal test
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        setup = time.perf_counter() - started
        prompts = [{"prompt_token_ids": ids} for ids in spec["prompt_ids"]]
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=1, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        result = {
            "setup_s": setup,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [
                [step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs
            ],
        }
        if name == spec["sampling_job"]:

            def sample(seed):
                params = [
                    SamplingParams(temperature=1.0, seed=seed + i, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
                    for i in range(len(prompts))
                ]
                return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

            result["sampled"] = [sample(1234), sample(1234), sample(99)]
            # the same seeded requests in another batch: each alone, in reverse order
            result["sampled_alone"] = [
                list(
                    llm.generate(
                        [prompts[i]],
                        SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False,
                    )[0]
                    .outputs[0]
                    .token_ids
                )
                for i in reversed(range(len(prompts)))
            ][::-1]
        if name == PER_REQUEST_JOB:
            result.update(drive_per_request(llm, spec))
        if "speculative_config" in job.get("llm", {}):  # vLLM's counters of drafted and accepted tokens
            result["spec_decode"] = {
                m.name: m.value
                for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")  # counters, not vectors
            }
        results[name] = result
        del llm
        import gc

        gc.collect()
    json.dump(results, open(out_path, "w"))


def drive_per_request(llm, spec):
    """Per-request trajectories in one engine: PER_REQUEST arriving at their engine steps (continuous batching),
    PREFIX_SEQUENCE one after another, and each of BAD_REQUESTS followed by a good request."""
    from vllm import SamplingParams

    def params(budget=None, schedule=None, **extra):
        knobs = {k: v for k, v in (("loop_budget", budget), ("step_schedule", schedule)) if v is not None}
        return SamplingParams(
            temperature=0.0,
            max_tokens=MAX_NEW_TOKENS,
            logprobs=1,
            ignore_eos=True,
            extra_args={**knobs, **extra} or None,
        )

    def tokens_and_logprobs(output):
        out = output.outputs[0]
        return list(out.token_ids), [step[t].logprob for t, step in zip(out.token_ids, out.logprobs)]

    engine, prompts = llm.llm_engine, [{"prompt_token_ids": ids} for ids in spec["prompt_ids"]]
    finished, in_flight_at_arrival, step = {}, [], 0
    while len(finished) < len(PER_REQUEST):
        for i, (p, budget, schedule, arrival) in enumerate(PER_REQUEST):
            if arrival == step:
                in_flight_at_arrival.append(engine.get_num_unfinished_requests())
                engine.add_request(str(i), prompts[p], params(budget, schedule))
        finished.update((o.request_id, tokens_and_logprobs(o)) for o in engine.step() if o.finished)
        step += 1
    prefix_prompt = {"prompt_token_ids": spec["long_prompt_ids"]}
    prefix = [
        tokens_and_logprobs(llm.generate([prefix_prompt], params(b, s), use_tqdm=False)[0]) for b, s in PREFIX_SEQUENCE
    ]
    refused = []
    for extra_args, _ in BAD_REQUESTS:
        try:
            llm.generate([prompts[0]], SamplingParams(max_tokens=2, extra_args=extra_args), use_tqdm=False)
            refused.append([None, None])
        except Exception as error:  # noqa: BLE001 -- the message is the result
            refused.append(
                [
                    f"{type(error).__name__}: {error}",
                    tokens_and_logprobs(llm.generate([prompts[0]], params(1, "uniform"), use_tqdm=False)[0]),
                ]
            )
    return {
        "per_request": [finished[str(i)] for i in range(len(PER_REQUEST))],
        "in_flight_at_arrival": in_flight_at_arrival,
        "prefix": prefix,
        "refused": refused,
        "prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
    }


def _prompt_ids(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def _long_prompt_ids(checkpoint):
    """More than two cache blocks of PREFIX_BLOCK_SIZE tokens, with room for MAX_NEW_TOKENS in max_model_len."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(checkpoint)(_corpus(seed=1))["input_ids"]
    return ids[: 2 * PREFIX_BLOCK_SIZE + 8]


@pytest.fixture(scope="session")
def halting_checkpoint(checkpoints, tmp_path_factory):
    """The loopformer checkpoint with per-token halting (halt_eps) in its generation_config.json."""
    import shutil

    path = tmp_path_factory.mktemp("vllm_halting") / "loopformer_halt"
    shutil.copytree(checkpoints["loopformer"], path)
    config = json.loads((path / "generation_config.json").read_text())
    config["halt_eps"] = 0.05
    (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def vllm_results(checkpoints, halting_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_run")
    jobs = {
        name: {"checkpoint": checkpoints[ckpt], "overrides": overrides} for name, (ckpt, overrides, _) in JOBS.items()
    }
    jobs["halt_eps_refused"] = {"checkpoint": halting_checkpoint, "overrides": {}}
    jobs["bad_budget_refused"] = {"checkpoint": checkpoints["loopformer"], "overrides": {"loop_budget": 0}}
    jobs[PER_REQUEST_JOB]["llm"] = {"block_size": PREFIX_BLOCK_SIZE}
    from loopformer_hf.vllm_plugin import write_draft_checkpoint

    draft = write_draft_checkpoint(checkpoints["loopformer"], str(root / "draft"), DRAFT_BUDGET)
    jobs[SPECULATIVE_JOB]["llm"] = {
        "speculative_config": {"method": "draft_model", "model": draft, "num_speculative_tokens": DRAFT_TOKENS},
        "disable_log_stats": False,  # the spec-decode counters
    }
    spec = {
        "jobs": jobs,
        "prompt_ids": _prompt_ids(checkpoints["loopformer"]),
        "sampling_job": SAMPLING_JOB,
        "long_prompt_ids": _long_prompt_ids(checkpoints["loopformer"]),
    }
    (root / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("PYTHONPATH", None)  # the subprocess finds loopformer_hf only as vLLM does: through the installed plugin
    proc = subprocess.run(
        [sys.executable, __file__, "drive", str(root / "spec.json"), str(root / "out.json")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    (root / "drive.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads((root / "out.json").read_text())


# ---- the transformers side --------------------------------------------------------------------------------------

_REFERENCE = {}


def reference(checkpoint, loop_budget, step_schedule):
    """`generate` on the left-padded batch of PROMPTS: (new tokens per row, their log-probabilities)."""
    key = (checkpoint, loop_budget, step_schedule)
    if key not in _REFERENCE:
        import loopformer_hf  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            loop_budget=loop_budget,
            step_schedule=step_schedule,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = out.sequences[:, enc["input_ids"].shape[1] :]
        logprobs = torch.stack([torch.log_softmax(step.float(), -1) for step in out.logits], 1)
        chosen = logprobs.gather(-1, new[..., None])[..., 0]
        _REFERENCE[key] = (new.tolist(), chosen.tolist())
    return _REFERENCE[key]


def reference_solo(checkpoint, prompt_ids, loop_budget, step_schedule):
    """`generate` on one prompt alone: (new tokens, their log-probabilities)."""
    key = (checkpoint, tuple(prompt_ids), loop_budget, step_schedule)
    if key not in _REFERENCE:
        import loopformer_hf  # noqa: F401
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        ids = torch.tensor([prompt_ids])
        out = model.generate(
            ids,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            loop_budget=loop_budget,
            step_schedule=step_schedule,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=model.config.pad_token_id,
        )
        new = out.sequences[0, ids.shape[1] :]
        logprobs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])
        _REFERENCE[key] = (new.tolist(), logprobs.gather(-1, new[:, None])[:, 0].tolist())
    return _REFERENCE[key]


# ---- tests -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("job", list(JOBS))
def test_greedy_tokens_equal_generate(job, vllm_results, checkpoints):
    ckpt, _, (budget, schedule) = JOBS[job]
    tokens, _ = reference(checkpoints[ckpt], budget, schedule)
    assert "error" not in vllm_results[job], vllm_results[job]
    assert vllm_results[job]["tokens"] == tokens


@pytest.mark.parametrize("job", list(JOBS))
def test_logprobs_match_generate(job, vllm_results, checkpoints):
    ckpt, _, (budget, schedule) = JOBS[job]
    _, logprobs = reference(checkpoints[ckpt], budget, schedule)
    got = torch.tensor(vllm_results[job]["logprobs"], dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)


def test_a_shallow_draft_of_the_same_weights_speculates_exactly(vllm_results):
    """vLLM's draft_model speculative decoding with the checkpoint at budget 1 as the draft of itself at L=3: the
    tokens and log-probabilities equal `generate` at 3 (the parametrized tests above run this job too); the draft ran
    at its own budget (some drafts rejected: a draft at 3 would be accepted whole)."""
    counters = vllm_results[SPECULATIVE_JOB]["spec_decode"]
    drafted, accepted = counters["vllm:spec_decode_num_draft_tokens"], counters["vllm:spec_decode_num_accepted_tokens"]
    assert drafted >= len(PROMPTS) * DRAFT_TOKENS and 0 < accepted < drafted, counters


def test_budgets_and_schedules_change_the_outputs(vllm_results):
    """Every trajectory's log-probabilities differ from every other's by far more than LOGPROB_ATOL: the equality
    tests tell the budgets and schedules apart (a model whose loop did nothing would fail here)."""
    jobs = ("lf_M1", "lf_M2", "lf_M3", "lf_c2f")
    for i, a in enumerate(jobs):
        for b in jobs[i + 1 :]:
            gap = (torch.tensor(vllm_results[a]["logprobs"]) - torch.tensor(vllm_results[b]["logprobs"])).abs().max()
            assert gap > 100 * LOGPROB_ATOL, (a, b, float(gap))


def test_seeded_sampling_is_reproducible(vllm_results):
    first, again, other_seed = vllm_results[SAMPLING_JOB]["sampled"]
    assert first == again
    assert first == vllm_results[SAMPLING_JOB]["sampled_alone"]  # whatever else is in the batch
    assert first != other_seed
    assert first != vllm_results[SAMPLING_JOB]["tokens"]  # it did sample


def test_halt_eps_and_bad_budgets_are_refused_with_a_message(vllm_results):
    assert "halt_eps=0.05" in vllm_results["halt_eps_refused"]["error"]
    assert "per-token halting" in vllm_results["halt_eps_refused"]["error"]
    assert "`loop_budget` must be an integer >= 1, got 0" in vllm_results["bad_budget_refused"]["error"]


def _assert_matches(got, expected):
    assert got[0] == expected[0]
    torch.testing.assert_close(
        torch.tensor(got[1], dtype=torch.float64),
        torch.tensor(expected[1], dtype=torch.float64),
        atol=LOGPROB_ATOL,
        rtol=0,
    )


def test_per_request_trajectories_equal_generate(vllm_results, checkpoints):
    """Requests at budgets {1, 2, 4, L} under three schedules (and the server's own) in one engine, arriving while
    others decode: each one's greedy tokens and log-probabilities are `generate`'s for its prompt alone."""
    result, ckpt = vllm_results[PER_REQUEST_JOB], checkpoints["loopformer"]
    prompt_ids = _prompt_ids(ckpt)
    assert min(result["in_flight_at_arrival"][len(PROMPTS) :]) > 0  # later arrivals joined a running batch
    for (p, budget, schedule, _), got in zip(PER_REQUEST, result["per_request"]):
        budget, schedule = budget or 2, schedule or "coarse_to_fine"
        _assert_matches(got, reference_solo(ckpt, prompt_ids[p], budget, schedule))
        # another budget's log-probabilities are far off: the match tells the trajectories apart
        other = reference_solo(ckpt, prompt_ids[p], 3 if budget == 1 else 1, "uniform")
        assert (torch.tensor(got[1]) - torch.tensor(other[1])).abs().max() > 100 * LOGPROB_ATOL


def test_prefix_cache_never_serves_another_trajectory(vllm_results, checkpoints):
    """One long prompt (more than two cache blocks) at budget 2, then L, then under another schedule, then at 2
    again: every run is `generate`'s, though vLLM keys its cached blocks by token ids alone."""
    result, ckpt = vllm_results[PER_REQUEST_JOB], checkpoints["loopformer"]
    long_prompt = _long_prompt_ids(ckpt)
    assert len(long_prompt) > 2 * PREFIX_BLOCK_SIZE
    for (budget, schedule), got in zip(PREFIX_SEQUENCE, result["prefix"]):
        _assert_matches(got, reference_solo(ckpt, long_prompt, budget, schedule))
    assert result["prefix_caching"] is False  # how: the plugin turns vLLM's prefix cache off


def test_bad_request_knobs_fail_that_request_at_admission(vllm_results, checkpoints):
    """Each bad value fails its own request with a message naming it; the engine serves the next request exactly."""
    result, ckpt = vllm_results[PER_REQUEST_JOB], checkpoints["loopformer"]
    expected = reference_solo(ckpt, _prompt_ids(ckpt)[0], 1, "uniform")
    for (extra_args, message), (error, after) in zip(BAD_REQUESTS, result["refused"]):
        assert error is not None and message in error, (extra_args, error)
        _assert_matches(after, expected)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"loop_budget": 0}, "`loop_budget` must be an integer >= 1, got 0"),
        ({"loop_budget": 99}, "`loop_budget`=99 exceeds the largest loop budget"),
        ({"loop_budget": "two"}, "`loop_budget` must be an integer >= 1, got 'two'"),
        ({"step_schedule": [0.3, 0.3]}, "`step_schedule` must sum to 1"),
        ({"halt_eps": 0.1}, "halt_eps=0.1 (per-token halting) is not supported"),
    ],
)
def test_bad_overrides_are_refused_where_the_model_config_is_built(checkpoints, overrides, message):
    """The plugin's config hook runs where vLLM builds its ModelConfig: in the user's process (API server, `LLM`),
    so the message reaches the user, not only the engine core's log."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=checkpoints["loopformer"], hf_overrides=overrides, dtype="float32", max_model_len=128)
    with pytest.raises(Exception, match=re.escape(message)):
        args.create_model_config()
    EngineArgs(
        model=checkpoints["loopformer"], hf_overrides={"loop_budget": 2}, dtype="float32", max_model_len=128
    ).create_model_config()  # a good one passes


def test_server_trajectory_reads_overrides_then_generation_config_then_config(checkpoints):
    import loopformer_hf  # noqa: F401
    from transformers import AutoConfig

    from loopformer_hf.vllm_model import server_trajectory

    config = AutoConfig.from_pretrained(checkpoints["loopformer"])
    assert server_trajectory(config) == (1 / 3,) * 3  # config defaults: num_loops, uniform
    saved = {"loop_budget": 2, "step_schedule": "coarse_to_fine"}
    assert server_trajectory(config, saved) == config.resolve_trajectory(2, "coarse_to_fine")
    config.loop_budget = 1  # what --hf-overrides '{"loop_budget": 1}' sets
    assert server_trajectory(config, saved) == config.resolve_trajectory(1, "coarse_to_fine")
    config.step_schedule = [0.5, 0.25, 0.25]
    with pytest.raises(ValueError, match="disagrees with `step_schedule` of length 3"):
        server_trajectory(config, saved)
    tmlt = AutoConfig.from_pretrained(checkpoints["tmlt"])
    with pytest.raises(ValueError, match="needs loop_conditioning='shortcut'"):
        server_trajectory(tmlt, {"step_schedule": "coarse_to_fine", "loop_budget": 2})


def test_request_knobs_resolve_over_the_servers(checkpoints):
    """A request's knob replaces the server's; one it leaves out is the server's (a preset name), as `generate` takes
    its generation config's. Budgets above `max_request_loop_budget` (default: num_loops) are refused."""
    import loopformer_hf  # noqa: F401
    from transformers import AutoConfig

    from loopformer_hf.vllm_plugin import max_request_loop_budget, request_trajectory

    config = AutoConfig.from_pretrained(checkpoints["loopformer"])
    saved = {"loop_budget": 2, "step_schedule": "coarse_to_fine"}  # the checkpoint's generation_config.json
    assert request_trajectory(config, saved, {}) is None and request_trajectory(config, saved, {"seed": 1}) is None
    assert request_trajectory(config, saved, {"loop_budget": 3}) == config.resolve_trajectory(3, "coarse_to_fine")
    assert request_trajectory(config, saved, {"step_schedule": "uniform"}) == (0.5, 0.5)
    assert request_trajectory(config, saved, {"step_schedule": [0.25, 0.75]}) == (0.25, 0.75)
    assert max_request_loop_budget(config, saved) == 3
    with pytest.raises(ValueError, match="`loop_budget`=4 exceeds this server's largest per-request loop budget, 3"):
        request_trajectory(config, saved, {"loop_budget": 4})
    config.max_request_loop_budget = 4  # --hf-overrides '{"max_request_loop_budget": 4}'
    assert len(request_trajectory(config, saved, {"loop_budget": 4})) == 4


def test_per_request_knobs_are_refused_where_the_server_cannot_run_them(checkpoints):
    """Where the model cannot honour them (Model Runner V2, CUDA graphs: see `per_request_refusal`), per-request
    knobs fail at admission through V2's own validator, with the reason; requests without them pass."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    from loopformer_hf.vllm_plugin import LoopFormerServing, bind_processor
    from loopformer_hf.vllm_requests import LoopFormerRequestRefusal

    model_config = EngineArgs(
        model=checkpoints["loopformer"], dtype="float32", max_model_len=128
    ).create_model_config()
    # what the config hook installs on such a server: the refusing processor, bound to the server it refuses for
    serving = LoopFormerServing.build(
        model_config.hf_config, model_config.try_get_generation_config(), "start it with VLLM_USE_V2_MODEL_RUNNER=0"
    )
    (processor,) = bind_processor(["loopformer_hf.vllm_requests:LoopFormerRequestTrajectories"], serving)
    assert issubclass(processor, LoopFormerRequestRefusal) and processor.serving is serving
    validate = build_custom_logits_processors_params_validator([processor])
    # VLLMValidationError: vLLM's front-end answers it with HTTP 400
    with pytest.raises(VLLMValidationError, match="not served here: start it with VLLM_USE_V2_MODEL_RUNNER=0"):
        validate(SamplingParams(extra_args={"loop_budget": 2}))
    with pytest.raises(VLLMValidationError, match="got 0"):  # a bad value still names itself
        validate(SamplingParams(extra_args={"loop_budget": 0}))
    validate(SamplingParams())


def _engine_config(checkpoint, **overrides):
    """The `VllmConfig` of an engine (the plugin's config hook has run on it), as `LLM(...)` builds it."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=checkpoint, hf_overrides=overrides, dtype="float32", max_model_len=128, enforce_eager=True)
    return args.create_engine_config()


def test_each_engine_admits_requests_by_its_own_server(checkpoints):
    """Two servers built in one process (largest per-request budgets 4 and 3): each admits by its own config, the
    first after the second was built, as vLLM's front-end validates (`validate_logits_processors_parameters` on its
    model config's processors); and the server travels with the engine's config to a spawned engine core (pickled)."""
    import pickle

    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    deep = _engine_config(checkpoints["loopformer"], max_request_loop_budget=4)
    shallow = _engine_config(checkpoints["loopformer"])
    four = SamplingParams(extra_args={"loop_budget": 4})
    validate_logits_processors_parameters(deep.model_config.logits_processors, four)
    with pytest.raises(VLLMValidationError, match="largest per-request loop budget, 3"):
        validate_logits_processors_parameters(shallow.model_config.logits_processors, four)
    spawned = pickle.loads(pickle.dumps(deep))
    (processor,) = spawned.model_config.logits_processors
    assert (
        processor.serving.max_budget == 4
        and processor.serving.loop == deep.model_config.logits_processors[0].serving.loop
    )
    validate_logits_processors_parameters(spawned.model_config.logits_processors, four)


def test_each_request_resolves_once_in_its_engines_worker(checkpoints, monkeypatch):
    """In the worker a request's knobs resolve once, when it joins the batch, into an immutable `RequestLoop`; the
    model finds its engine's rows through that engine's forward context (another engine in the process sees none),
    and the per-forward `LoopPlan` maps tokens to those rows without resolving again."""
    import loopformer_hf
    from vllm import SamplingParams
    from vllm.forward_context import set_forward_context
    from vllm.v1.sample.logits_processor import BatchUpdate

    from loopformer_hf.vllm_plugin import RequestLoop
    from loopformer_hf.vllm_requests import LoopPlan, batch_request_loops

    engines = [_engine_config(checkpoints["loopformer"], max_request_loop_budget=4) for _ in range(2)]
    processors = [config.model_config.logits_processors[0](config, torch.device("cpu"), False) for config in engines]
    resolved = []
    resolve = loopformer_hf.LoopFormerConfig.resolve_trajectory
    monkeypatch.setattr(
        loopformer_hf.LoopFormerConfig, "resolve_trajectory", lambda *a: resolved.append(a[1:]) or resolve(*a)
    )
    params = SamplingParams(extra_args={"loop_budget": 4, "step_schedule": "uniform"})
    processors[0].update_state(BatchUpdate(batch_size=2, removed=[], added=[(1, params, [5, 6], [])], moved=[]))
    expected = RequestLoop((0.25,) * 4, 4)
    assert resolved == [(4, "uniform")] and processors[0].rows == {1: expected}
    with set_forward_context(None, engines[1]):
        assert batch_request_loops() == {}
    server = processors[0].serving.loop
    for _ in range(3):  # three forwards of the same batch
        processors[0].update_state(None)
        with set_forward_context(None, engines[0]):
            rows = batch_request_loops()
        plan = LoopPlan.build(server, rows, [0, 2, 4], 4, torch.device("cpu"))
        assert plan.trajectories == [server.trajectory, expected.trajectory] and len(plan.steps) == 4
    assert len(resolved) == 1


def test_no_module_level_registry():
    """What a request runs reaches the model through vLLM's per-engine objects only: no module of the vLLM side
    defines a mutable container at its top level (a registry of configs, processors or requests that every engine of
    the process would share)."""
    import ast
    import inspect
    from collections.abc import MutableMapping, MutableSequence, MutableSet

    from loopformer_hf import vllm_model, vllm_plugin, vllm_requests

    for module in (vllm_plugin, vllm_requests, vllm_model):
        tree = ast.parse(inspect.getsource(module))
        assigned = [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
        assigned += [node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)]
        assert "logger" in assigned or module is vllm_model  # the check sees the module's own assignments
        containers = (MutableMapping, MutableSequence, MutableSet)
        mutable = [
            name for name in assigned if not name.startswith("__") and isinstance(vars(module)[name], containers)
        ]
        assert mutable == [], (module.__name__, mutable)


def test_plugin_registers_the_architectures_of_saved_checkpoints(checkpoints):
    from vllm import ModelRegistry

    from loopformer_hf.vllm_plugin import VLLM_ARCHITECTURES, register

    register()
    register()  # vLLM may call it more than once
    saved = json.load(open(os.path.join(checkpoints["loopformer"], "config.json")))["architectures"]
    assert set(saved) <= set(VLLM_ARCHITECTURES) <= set(ModelRegistry.get_supported_archs())


def serve_command():
    """`vllm serve`; with vllm-cpu 0.32.0 the same server as a module: its `vllm` command looks up the version of a
    distribution named "vllm", which vllm-cpu is not (PackageNotFoundError before anything starts)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve"]
    except importlib.metadata.PackageNotFoundError:
        return [
            sys.executable,
            "-W",
            "ignore::DeprecationWarning",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
        ]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body, timeout):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_openai_server_answers_completions(checkpoints, tmp_path):
    """`vllm serve CKPT --hf-overrides ...` (see `serve_command`) on 127.0.0.1: /v1/completions gives `generate`'s
    greedy text, at the server's trajectory and at one a request asks through `vllm_xargs` (the OpenAI client's
    `extra_body`); a bad `vllm_xargs` value is a 400 naming it. Bounded: at most 600 s for the server to come up,
    60 s per request, then it is stopped."""
    from transformers import AutoTokenizer

    ckpt, port = checkpoints["loopformer"], _free_port()
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("PYTHONPATH", None)
    server = subprocess.Popen(
        [
            *serve_command(),
            ckpt,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--enforce-eager",
            "--served-model-name",
            "loopformer",
            "--hf-overrides",
            json.dumps({"loop_budget": 3, "step_schedule": "uniform"}),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "server did not come up in 600 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        answer = _post(
            f"http://127.0.0.1:{port}/v1/completions",
            {
                "model": "loopformer",
                "prompt": PROMPTS[:2],
                "max_tokens": MAX_NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        per_request = _per_request_over_http(port)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    tokens, _ = reference(ckpt, 3, "uniform")
    texts = [choice["text"] for choice in sorted(answer["choices"], key=lambda c: c["index"])]
    # the batch of two: generate's rows 0 and 1 (its batch of four pads them further; greedy tokens do not move)
    assert texts == [tokenizer.decode(t) for t in tokens[:2]]
    assert answer["usage"]["completion_tokens"] == 2 * MAX_NEW_TOKENS
    # per request (vllm_xargs): a bad value is a 400 naming it; the server then answers with that trajectory
    status, message = per_request["refused"]
    assert status == 400 and "`loop_budget` must be an integer >= 1, got 0" in message, (status, message)
    expected, _ = reference_solo(ckpt, tokenizer(PROMPTS[0])["input_ids"], *SERVED_REQUEST)
    assert per_request["text"] == tokenizer.decode(expected)


SERVED_REQUEST = (2, "coarse_to_fine")  # the trajectory a request asks the server (budget 3, uniform) for


def _per_request_over_http(port):
    """A bad `vllm_xargs` (urllib: its HTTP status and message), then a good one through the OpenAI client, as
    docs/serving.md shows it."""
    import urllib.error

    from openai import OpenAI

    try:
        _post(
            f"http://127.0.0.1:{port}/v1/completions",
            {"model": "loopformer", "prompt": PROMPTS[0], "max_tokens": 2, "vllm_xargs": {"loop_budget": 0}},
            timeout=60,
        )
        refused = (200, "")
    except urllib.error.HTTPError as error:
        refused = (error.code, error.read().decode())
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60)
    completion = client.completions.create(
        model="loopformer",
        prompt=PROMPTS[0],
        max_tokens=MAX_NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "vllm_xargs": dict(zip(("loop_budget", "step_schedule"), SERVED_REQUEST))},
    )
    return {"refused": refused, "text": completion.choices[0].text}


if __name__ == "__main__" and sys.argv[1:2] == ["drive"]:
    drive(sys.argv[2], sys.argv[3])
