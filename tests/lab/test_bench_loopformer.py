"""`bench_loopformer --against REV`: another revision's loopformer_hf, from a temporary git worktree under another
module name, decodes the same weights to the same tokens as this tree's, and the report carries both speeds and their
ratio. Run against HEAD (any history will do) with a tiny model and a few tokens; no timing assertions."""

import json
import math
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

import loopformer_hf
from benchmarks import bench_loopformer

pytestmark = pytest.mark.skipif(
    subprocess.run(
        ["git", "-C", bench_loopformer.REPO_ROOT, "rev-parse", "HEAD:loopformer_hf/__init__.py"], capture_output=True
    ).returncode
    != 0,
    reason="needs a git checkout whose HEAD has loopformer_hf",
)


def worktrees():
    return bench_loopformer.git("worktree", "list", "--porcelain").stdout


def test_against_head_writes_both_speeds(tmp_path, capsys):
    out = tmp_path / "against.json"
    threads = torch.get_num_threads()
    try:
        args = ["--against", "HEAD", "--quick", "--new_tokens", "3", "--repeats", "2", "--output", str(out)]
        assert bench_loopformer.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    head = bench_loopformer.git("rev-parse", "HEAD").stdout.strip()
    assert report["against"] == "HEAD" and report["old"] == head[:10] and report["new"].startswith(head[:10])
    result = report["result"]
    assert result["identical_tokens"] is True and result["new_tokens"] == 3 and result["batch"] == 1
    for side in ("old", "new"):
        assert len(result["times"][side]) == 2
        assert result["tokens_per_s"][side] == pytest.approx(3 / result["time_s"][side])
    assert math.isfinite(result["ratio_new_over_old_time"]) and result["ratio_new_over_old_time"] > 0
    assert report["config"]["clock"] == "time.process_time"
    assert "identical tokens: yes" in capsys.readouterr().out
    assert "loopformer_against_" not in worktrees()  # the temporary worktree is gone


def test_old_package_is_another_module_and_leaves_ours_registered():
    before = worktrees()
    with bench_loopformer.package_at(bench_loopformer.git("rev-parse", "HEAD").stdout.strip()) as old:
        assert old.__name__.startswith("loopformer_hf_at_") and old is not loopformer_hf
        assert old.LoopFormerForCausalLM is not loopformer_hf.LoopFormerForCausalLM
        assert "loopformer_against_" in worktrees()
    assert AutoModelForCausalLM._model_mapping[loopformer_hf.LoopFormerConfig] is loopformer_hf.LoopFormerForCausalLM
    assert worktrees() == before


def test_different_tokens_are_refused():
    cfg = dict(bench_loopformer.QUICK, gen_long=3, seq=0)
    old, new = (bench_loopformer.build_loopformer(cfg, "rope", seed=s).eval() for s in (0, 1))
    prompt = torch.randint(3, cfg["vocab"], (1, cfg["prompt"]), generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError, match="old and new decode differently"):
        bench_loopformer.decode_against(old, new, prompt, 3, repeats=1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--against", "no-such-revision-65"], "--against: unknown git revision 'no-such-revision-65'"),
        (["--new_tokens", "3"], "--new_tokens only applies with --against"),
        (["--against", "HEAD", "--new_tokens", "0"], "--new_tokens must be >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line_before_any_work(argv, message, capsys):
    try:
        rc = bench_loopformer.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        rc = exit_.code
    assert rc == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
