"""benchmarks/bench_fprm_batching.py on a tiny untrained 4x4 FPRM: it runs every mode, finds continuous batching
equal to per-sample halting per puzzle, and writes its ratios."""

import json

from support.tiny_models import tiny_fprm

from benchmarks.bench_fprm_batching import main


def test_the_benchmark_runs_every_mode_and_writes_its_ratios(tmp_path):
    tiny_fprm(seed=3, vocab_size=6).save_pretrained(tmp_path / "model")
    out = tmp_path / "batching.json"
    argv = ["--model", str(tmp_path), "--num_puzzles", "24", "--batch_size", "8", "--max_loops", "12"]
    main([*argv, "--calibration", "8", "--output", str(out)])
    record = json.loads(out.read_text())
    assert record["continuous_equals_sample_per_puzzle"] is True
    assert {"batch", "sample", "continuous"} <= set(record["modes"])
    tau = record["matched_halt_eps"]
    assert f"continuous, τ {tau:g} / batch" in record["ratios"]
    assert record["modes"]["batch"]["rows_per_step"] >= record["modes"]["sample"]["rows_per_step"]


def test_the_default_output_is_not_the_tracked_results_file():
    import os

    from benchmarks import bench_fprm_batching

    assert os.path.relpath(bench_fprm_batching.RESULT, bench_fprm_batching.ROOT) == os.path.join(
        "outputs", "bench-fprm-batching", "fprm_batching.json"
    )
