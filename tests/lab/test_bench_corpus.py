"""The real-corpus benchmarks (issue 62) run as one command each at toy size and write what the docs read."""

import json
import math
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(module, *args):
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )


def test_corpus_benchmark_measures_both_sizes_side_by_side(tmp_path):
    out = tmp_path / "corpus.json"
    proc = _run(
        "benchmarks.bench_corpus", "--sizes_mb", "1", "2", "--train_steps", "3", "--quick", "--output", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert sorted(runs) == ["1", "2"]
    for run in runs.values():
        assert run["prepare"]["tokens"] > 0
        for step in ("prepare", "train"):
            for key in ("peak_rss_mib", "peak_anon_mib"):
                assert math.isfinite(run[step][key]) and run[step][key] > 0, (step, key, run[step])
        assert run["train"]["steps_per_s_after_first"] > 0
    # the larger corpus has about twice the tokens: the same text machinery measured both
    assert 1.5 < runs["2"]["prepare"]["tokens"] / runs["1"]["prepare"]["tokens"] < 2.5
    assert "| train peak RSS, large - small (MiB) |" in proc.stdout


def test_corpus_benchmark_answers_a_mistake_in_one_line():
    proc = _run("benchmarks.bench_corpus", "--sizes_mb", "200", "5")
    assert proc.returncode == 2
    assert "--sizes_mb 200 5" in proc.stderr.strip().splitlines()[-1]


def test_step_rate_benchmark_runs_the_preset_step_at_toy_size():
    proc = _run("benchmarks.bench_step_rate", "--tiny", "--steps", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.rindex("{\n") :])
    assert result["shape"] == "tiny" and result["seconds_per_step"] > 0
    assert result["projected_gpu_hours"] == pytest.approx(50_000 * result["seconds_per_step"] * 8 / 3600)


@pytest.mark.slow  # six commands, each in its own process (~3.5 min on 2 busy cores); the default run has one part
def test_corpus_memory_benchmark_measures_every_dimension_side_by_side(tmp_path):
    out = tmp_path / "memory.json"
    proc = _run(
        "benchmarks.bench_corpus_memory", "--sizes_mb", "1", "2", "--document_mb", "1", "2", "--train_steps", "2",
        "--output", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["run"] for r in rows] == [
        "prepare --num_proc 2", "prepare, one document", "2 steps of --streaming training"
    ]  # fmt: skip
    for r in rows:
        # the process tree's private memory: at least the interpreter and its imports, in each process
        assert 100 < r["small_mib"] < 20_000 and 100 < r["large_mib"] < 20_000, r
    assert rows[0]["small_mib"] > rows[1]["small_mib"]  # --num_proc 2: its workers are counted too


def test_corpus_memory_benchmark_measures_one_long_document_against_a_short_one(tmp_path):
    out = tmp_path / "memory.json"
    proc = _run(
        "benchmarks.bench_corpus_memory", "--only", "document", "--document_mb", "1", "2", "--output", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["run"] == "prepare, one document" and 100 < row["small_mib"] < 20_000, row
    assert row["growth_mib"] == pytest.approx(row["large_mib"] - row["small_mib"])
    assert "| prepare, one document | 1 MB | 2 MB |" in proc.stdout


def test_corpus_memory_benchmark_answers_a_mistake_in_one_line():
    proc = _run("benchmarks.bench_corpus_memory", "--document_mb", "60", "5")
    assert proc.returncode == 2
    assert "--document_mb 60 5" in proc.stderr.strip().splitlines()[-1]
