"""The benchmark runs as one command (quick mode here) and its JSON carries every ratio.

No timing assertions: the numbers of a smoke run on a shared machine mean nothing.
"""

import json
import math
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPECTED_RATIOS = [
    "train_step_loopformer_over_llama",
    "generate_tokens_per_s_loopformer_over_llama",
    "cached_over_uncached_speedup_short",
    "cached_over_uncached_speedup_long",
] + [f"generate_time_budget_{M}_over_4" for M in range(1, 5)]


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_loopformer", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_quick_benchmark_writes_every_ratio(tmp_path):
    out = tmp_path / "nested" / "bench.json"
    proc = _run("--quick", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())

    assert sorted(report["ratios"]) == sorted(EXPECTED_RATIOS)
    for name, value in report["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
    assert sorted(report["targets"]) == sorted(EXPECTED_RATIOS)
    assert sorted(report["met"]) == sorted(EXPECTED_RATIOS)
    assert all(isinstance(v, bool) for v in report["met"].values())

    config = report["config"]
    assert config["quick"] is True and config["threads"] >= 1 and config["k"] * config["loops"] == 8
    results = report["results"]
    assert results["cached_vs_uncached_short"]["new_tokens"] < results["cached_vs_uncached_long"]["new_tokens"]
    # cached and uncached greedy generation must produce the same tokens (a correctness check, not a timing one)
    assert results["cached_vs_uncached_short"]["same_tokens"] and results["cached_vs_uncached_long"]["same_tokens"]
    assert sorted(results["budget_scaling"]) == ["1", "2", "3", "4"]
    assert [len(t) for t in results["train_step"]["times"].values()] == [config["train_repeats"]] * 2
    # the printed table has one row per ratio, with its value
    for name in ("train step", "cached generate", "cached vs uncached", "generate at M=1 vs M=4"):
        assert name in proc.stdout
    assert f"{report['ratios']['train_step_loopformer_over_llama']:.3f}" in proc.stdout


def test_bad_arguments_are_rejected(tmp_path):
    proc = _run("--quick", "--threads", "0", "--output", str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "--threads must be >= 1, got 0" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_self_speculative_quick_run_is_exact(tmp_path):
    """bench_self_speculative times drafting against plain decoding with identical greedy tokens, and a mixed batch
    [1, L, 1, L, ...] against all rows at L with every row equal to its budget's, and the ideal from measured steps."""
    out = tmp_path / "spec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_self_speculative", "--quick", "--output", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    loops = report["loops"]
    assert sorted({r["d"] for r in report["speculative"]}) == list(range(1, loops))
    for r in report["speculative"]:
        assert r["identical_greedy_tokens"] and 0 <= r["acceptance"] <= 1 and r["drafted"] > 0
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0
    for r in report["mixed"]:
        assert r["each_row_equals_its_budget"]
        # the ideal is the one a step over B/2 rows costing `step_half_over_full` of B rows allows (timing-free check)
        for ideal, half in (
            (r["ideal"], r["step_half_over_full"]),
            (r["prefill_ideal"], r["prefill_half_over_full"]),
            (r["products_ideal"], r["products_half_over_full"]),  # the cap of a step that were its products alone
        ):
            assert half > 0 and math.isclose(ideal, loops / (1 + (loops - 1) * half))
        assert math.isclose(r["share_of_ideal"], r["mixed_over_all_L_throughput"] / r["ideal"])
        assert r["prefill_mixed_over_all_L"] > 0
    assert set(report["step_costs"]) >= {f"forward_M{m}_1_token_ms" for m in range(1, loops + 1)}
    # a verification's products over n + 1 rows, against one row, for each draft length n
    assert all(report["step_costs"][f"products_{n + 1}_rows_over_1"] > 0 for n in (2, 4, 8))
    assert "| batch | decode: mixed / all-L throughput |" in proc.stdout


def test_row_scaling_times_each_half_batch_against_its_full_one(capsys):
    from benchmarks.bench_row_scaling import main

    ratios = main(["--hidden_size", "64", "--threads", "1", "--min_run_time", "0.05"])
    assert set(ratios) == {64, 128, 256} and all(0 < r < 2 for r in ratios.values())
    assert "32/64 = " in capsys.readouterr().out


def test_halting_rows_and_the_report_table(tiny_model, monkeypatch):
    """bench_halting's timed rows carry the m/L + 0.15 bound; report_table prints them and a slot for the rows other
    benchmarks add (static cache, compiled decoding, shared cache)."""
    from benchmarks import bench_halting, format_markdown, report_table, row

    rows = bench_halting.halting_rows(tiny_model, [1e-9], ("reuse",), prompt_len=4, new_tokens=2, repeats=1)
    assert [r["run"] for r in rows] == ["M=1", "M=2", "M=3", "M=4", "eps=1e-09 (reuse)"]
    assert rows[3]["time_ratio"] == 1.0 and rows[4]["mean_loops"] == 4  # a tiny eps halts nothing
    assert all(math.isclose(r["bound"], r["mean_loops"] / 4 + 0.15) for r in rows)
    calls = [r["ops_per_token"] for r in rows]  # fixed budgets: more loop steps, more tensor operations
    assert calls[0] < calls[1] < calls[2] < calls[3] and rows[3]["ops_ratio"] == 1.0
    assert "ATen calls/token" in bench_halting.format_halting(rows)
    monkeypatch.setattr(bench_halting, "tiny_random_model", lambda: tiny_model)
    table_rows = report_table.halting_table_rows([1e-9], prompt_len=4, new_tokens=2, repeats=1, log=lambda s: None)
    timed = [r for r in table_rows if r["measurement"].startswith("generate ms/token")]
    counted = {r["measurement"]: r for r in table_rows if r["measurement"].startswith("ATen calls/token")}
    assert len(timed) == len(counted) == 4 and timed[-1]["target"] == "<= 1.15"
    assert counted["ATen calls/token, M=1, mean loops 1.00: / M=4"]["ratio"] < 1
    table = format_markdown(
        [
            row("x / y", 2.0, 1.0, [1.5, 2.0, 2.5], "<= 1.0", False),
            dict(measurement=report_table.EXTRA_SLOT, slot=True),
        ]
    )
    assert "| x / y | 2 | 1 | 2.000 | 1.500-2.500 | <= 1.0 | NO |" in table
    assert "not measured by this command yet" in table.splitlines()[-1]


def test_gather_rows_time_both_paths_at_mixed_halting_and_restore_the_constants():
    """`bench_halting --gather` (what GATHER_MIN_GRID is set from) times gathered against dense prefill at a halt_eps
    where tokens halt at mixed steps, and leaves the module's thresholds as it found them."""
    from benchmarks import bench_halting
    from loopformer_hf import halting_loopformer

    before = halting_loopformer.GATHER_ACTIVE_FRACTION, halting_loopformer.GATHER_MIN_GRID
    rows = bench_halting.gather_rows([64], [12], repeats=1)
    assert len(rows) == 1 and rows[0]["grid"] == 64 * 12
    assert 1 < rows[0]["mean_loops"] < 4 and rows[0]["gather_over_dense"] > 0
    assert (halting_loopformer.GATHER_ACTIVE_FRACTION, halting_loopformer.GATHER_MIN_GRID) == before
    assert "gathered / dense" in bench_halting.format_gather(rows)


def test_report_table_cache_rows(monkeypatch):
    """The static / compiled rows compare tokens/s on the same prompt and check the sides' tokens agree; the shared
    cache rows hold n/M of the exact cache's bytes. The compiled side is an eager copy here: compiling
    takes minutes on this machine, and the benchmark, not this test, measures it."""
    import copy

    from benchmarks import bench_compile, bench_loopformer, report_table

    monkeypatch.setattr(bench_compile, "compiled_copy", lambda model: copy.deepcopy(model))
    cfg = dict(bench_loopformer.QUICK, gen_vs_llama=3, prompt=4)
    rows = report_table.cache_rows(cfg, 1, 1, log=lambda s: None)
    assert [r["measurement"] for r in rows] == [
        f"cached generate 3 tok at M={m}, tokens/s: {label}"
        for m in (4, 1)
        for label in ("static / dynamic cache", "compiled static / eager dynamic")
    ]
    assert all(r["loopformer"] > 0 and r["baseline"] > 0 for r in rows)
    rows = report_table.shared_cache_rows(cfg, 1, 1, log=lambda s: None)
    assert [(r["measurement"].split(": ")[1], r["target"]) for r in rows] == [
        (f"shared n={n} / exact", f"= {n}/{m}") for m in (4, 8, 12) for n in (1, 2)
    ]
    assert all(r["met"] and r["ratio"] == r["loopformer"] / r["baseline"] for r in rows)


# The authors' interface (models/loopformer.py of github.com/armenjeddi/loopformer: GPTConfig, GPT(config),
# forward(idx, targets, steps) -> (logits, loss, x), configure_optimizers), computed by the independent oracle of
# tests/support/reference_oracle.py: their code cannot be fetched here, so the benchmark's plumbing is checked on this.
STAND_IN_AUTHORS = """
MODEL_TYPE = "{model_type}"

import dataclasses

import torch
import torch.nn.functional as F

from tests.support.reference_oracle import reference_forward, reference_state_dict


@dataclasses.dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False
    intermediate_dim: int = 256


class GPT(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        sd = reference_state_dict(d=config.n_embd, n_layer=config.n_layer, vocab=config.vocab_size,
                                  block=config.block_size, mlp=config.intermediate_dim, model_type=MODEL_TYPE)
        self.names = list(sd)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(v.clone()) for v in sd.values())
        print("number of parameters: (printed, as theirs)")

    def state_dict(self):
        return {name: p.detach() for name, p in zip(self.names, self.weights)}

    def forward(self, idx, targets=None, steps=8):
        trajectory = list(steps) if isinstance(steps, (list, tuple)) else [None] * steps  # TMLT, Base-Loop: a count
        logits = reference_forward(dict(zip(self.names, self.weights)), idx, trajectory, self.config.n_head,
                                   MODEL_TYPE)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return (logits if targets is not None else logits[:, [-1]]), loss, logits

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return torch.optim.AdamW(self.parameters(), lr=learning_rate, betas=betas, weight_decay=weight_decay)
"""


def test_authors_rows_on_a_stand_in_for_their_code(tmp_path):
    """bench_authors builds both models from one set of weights (theirs -> our converter), checks that the logits of
    each of their four model files, the objective's CE terms and the greedy tokens agree, and times the consistency
    train step and generation side by side; a folder without their model file is refused with the path it looked
    for."""
    (tmp_path / "models").mkdir()
    for model_type in ("loopformer", "tmlt", "base_loop", "base"):
        (tmp_path / "models" / f"{model_type}.py").write_text(STAND_IN_AUTHORS.replace("{model_type}", model_type))
    out = tmp_path / "authors.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_authors",
            "--authors_repo",
            str(tmp_path),
            "--quick",
            "--output",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *logits, ce, train, generate = json.loads(out.read_text())["rows"]
    assert [r["measurement"].split(": ")[1] for r in logits] == [
        f"models/{t}.py, converted" for t in ("loopformer", "tmlt", "base_loop", "base")
    ]
    assert all(r["loopformer"] <= 1e-4 and r["met"] for r in logits)
    assert ce["measurement"].startswith("CE of the full and the short") and ce["loopformer"] <= 1e-4 and ce["met"]
    assert "train step" in train["measurement"] and train["loopformer"] > 0 and train["baseline"] > 0
    assert "generate" in generate["measurement"] and "TOKENS DIFFER" not in generate["measurement"]
    assert "| logits, max abs(ours - theirs): models/tmlt.py" in proc.stdout

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_authors",
            "--authors_repo",
            str(tmp_path / "none"),
            "--quick",
            "--output",
            str(tmp_path / "x.json"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and os.path.join(str(tmp_path / "none"), "models", "loopformer.py") in proc.stderr
    assert not (tmp_path / "x.json").exists()
