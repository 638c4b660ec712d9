"""The published-size benchmark (benchmarks/bench_authors_size.py) runs as one command in its tiny
`--quick` shape without the authors' code (their rows print "not run"), and the checkpoint it measures is in their
layout and loads into the model the reference oracle computes.

No timing assertions: the numbers of a smoke run on a shared machine mean nothing.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import bench_authors_size as bench
from loopformer_hf.authors.weights import strip_wrapper_prefixes
from tests.support.reference_oracle import reference_forward, reference_state_dict

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_authors_size", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_checkpoint_is_in_their_layout_and_loads_as_the_oracle_computes(tmp_path):
    cfg = bench.QUICK
    params = bench.write_reference_checkpoint(cfg, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert sorted(config) == ["architectures", "auto_map", "dtype", "model_type", "transformers_version"]  # no sizes
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert all(k.startswith("gpt.") for k in saved) and "gpt.lm_head.weight" not in saved
    assert {t.dtype for t in saved.values()} == {torch.bfloat16} and params == sum(t.numel() for t in saved.values())
    oracle_names = reference_state_dict(
        d=cfg["n_embd"],
        n_layer=cfg["n_layer"],
        vocab=cfg["vocab_size"],
        block=cfg["block_size"],
        mlp=cfg["intermediate_dim"],
    )
    sd = strip_wrapper_prefixes(saved)
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        k: tuple(v.shape) for k, v in oracle_names.items() if k != "lm_head.weight"
    }

    model = bench.load_ours(str(tmp_path))
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config.num_loops == cfg["loops"]
    assert model.config.num_attention_heads == cfg["n_head"]  # from the configuration class's source
    model = bench.load_ours(str(tmp_path), torch.float32)
    sd = {k: v.float() for k, v in sd.items()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    ids = torch.randint(0, cfg["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    for M in bench.BUDGETS:
        with torch.inference_mode():
            ours = model(ids, loop_budget=M, use_cache=False).logits
        expected = reference_forward(sd, ids, [1.0 / M] * M, n_head=cfg["n_head"])
        assert (ours - expected).abs().max().item() < 1e-4, M


def test_quick_run_without_the_authors_code(tmp_path):
    out = tmp_path / "nested" / "published.json"
    proc = _run("--quick", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["quick"] is True and report["authors_repo"] is None
    assert report["config"]["llama_layers"] == 24 and report["params"]["ours"] == report["checkpoint_params"]
    weights = report["matmul_weights_per_token"]
    assert abs(weights["llama"] / weights["ours_at_L"] - 1) < 0.01  # iso-FLOP

    assert sorted(report["load"]) == ["ours", "ours_fp32"]  # no "theirs" without their code
    (ours,), (ours_fp32,) = report["load"]["ours"], report["load"]["ours_fp32"]
    assert ours["dtype"] == "torch.bfloat16" and ours_fp32["dtype"] == "torch.float32"
    for r in (ours, ours_fp32):
        assert r["seconds"] > 0 and r["peak_rss_mib"] >= r["rss_before_mib"] > 0
    for M in bench.BUDGETS:
        entry = report["generate"][str(M)]
        assert entry["ours_tokens_per_s"] > 0 and math.isfinite(entry["ours_over_llama"])
        assert "theirs_tokens_per_s" not in entry
    assert report["train"]["ours_s"] > 0 and report["train"]["llama_s"] > 0

    table = proc.stdout[proc.stdout.index("| measurement") :]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]  # less the header
    assert len(rows) == len(report["table"]) == 8 + 4 + 1
    assert all("| not run |" in line for line in rows[:12])  # every load and generate row has a theirs cell
    assert rows[-1].startswith("| train step s") and f"{report['train']['ours_over_llama']:.2f} |" in rows[-1]


def test_bad_arguments_are_rejected(tmp_path):
    proc = _run("--quick", "--threads", "0", "--output", str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "--threads must be >= 1, got 0" in proc.stderr
    proc = _run("--quick", "--authors_repo", str(tmp_path / "none"), "--output", str(tmp_path / "x.json"))
    assert proc.returncode == 2 and os.path.join(str(tmp_path / "none"), "models", "loopformer.py") in proc.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_the_published_size_file_is_byte_exact_and_loads_from_a_config_that_states_no_sizes(tmp_path):
    """The FineWeb300K shape: model.safetensors of exactly 556,342,528 bytes (the published file's size), 278,169,600
    bf16 parameters, loaded from a config.json without a size (the public traces' 296-byte config)."""
    cfg = bench.FULL
    params = bench.write_reference_checkpoint(cfg, str(tmp_path))
    assert (tmp_path / "model.safetensors").stat().st_size == 556_342_528 and params == 278_169_600
    model = bench.load_ours(str(tmp_path))
    assert (
        model.config.num_hidden_layers,
        model.config.hidden_size,
        model.config.intermediate_size,
        model.config.num_attention_heads,
        model.config.num_loops,
    ) == (3, 2048, 5120, 32, 8)
    assert model.dtype == torch.bfloat16 and model.num_parameters() == params
