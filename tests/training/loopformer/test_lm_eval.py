"""lm-evaluation-harness on a local log-likelihood task (YAML + JSON-lines written here), with the loop budget chosen
on the command line: the stock `hf` model through model_args (default_loop_budget) with trust_remote_code, and the
package's registered `loopformer` model (loop_budget / step_schedule). Scores are checked against the perplexity
computed directly at that budget, and they differ by budget."""

import glob
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.hub_helpers import REPO_ROOT, save_checkpoint
from support.tiny_data import LM_EVAL_TASK_YAML as TASK_YAML

pytest.importorskip("lm_eval", reason="lm-eval is an optional extra (pip install 'lm-eval==0.4.13')")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    model, tokenizer = save_checkpoint(root / "model", seed=0)
    words = "the cat sat on the mat and the dog sat on the log".split()
    rng = random.Random(0)
    docs = [
        {"context": " ".join(rng.choice(words) for _ in range(5)), "continuation": " " + rng.choice(words)}
        for _ in range(10)
    ]
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "data.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tasks / "tiny_loglik.yaml").write_text(TASK_YAML.format(data=tasks / "data.jsonl"))
    return root, model, tokenizer, docs


def expected_perplexity(model, tokenizer, docs, **depth):
    """exp(-mean log p(continuation | context)), as lm-eval's loglikelihood `perplexity` aggregates it."""
    total = []
    with torch.no_grad():
        for doc in docs:
            ctx = tokenizer(doc["context"], add_special_tokens=False)["input_ids"]
            whole = tokenizer(doc["context"] + doc["continuation"], add_special_tokens=False)["input_ids"]
            cont = whole[len(ctx) :]
            logits = model(torch.tensor([whole[:-1]]), **depth).logits[0, len(ctx) - 1 :]
            logprobs = torch.log_softmax(logits.float(), -1)
            total.append(float(logprobs[torch.arange(len(cont)), torch.tensor(cont)].sum()))
    return math.exp(-sum(total) / len(total))


def start_lm_eval(root, command, model, model_args, tag):
    out = root / f"out_{tag}"
    cmd = command + [
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        "tiny_loglik",
        "--include_path",
        str(root / "tasks"),
        "--device",
        "cpu",
        "--batch_size",
        "4",
        "--output_path",
        str(out),
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HOME": str(root / f"hf_home_{tag}"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def finish_lm_eval(started):
    """Wait for a started run and return its perplexity."""
    proc, out = started
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())["results"]["tiny_loglik"]["perplexity,none"]


def lm_eval_command():
    script = Path(sys.executable).with_name("lm_eval")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lm_eval"]


def test_lm_eval_scores_follow_the_budget_from_the_command_line(setup):
    root, model, tokenizer, docs = setup
    want = {m: expected_perplexity(model, tokenizer, docs, loop_budget=m) for m in (1, 4)}
    assert abs(want[1] - want[4]) / want[4] > 1e-3  # the budget matters for this model
    # both runs start at once (each is mostly interpreter start-up): the stock `lm_eval --model hf` with remote
    # code and the budget through the config default, and the package's registered model class with loop_budget
    hf = start_lm_eval(
        root,
        lm_eval_command(),
        "hf",
        f"pretrained={root / 'model'},trust_remote_code=True,default_loop_budget=1",
        "hf1",
    )
    lf = start_lm_eval(
        root,
        [sys.executable, "-m", "looped_training.loopformer.lm_eval"],
        "loopformer",
        f"pretrained={root / 'model'},loop_budget=4",
        "lf4",
    )
    hf_m1, lf_m4 = finish_lm_eval(hf), finish_lm_eval(lf)
    assert hf_m1 == pytest.approx(want[1], rel=1e-4)
    assert lf_m4 == pytest.approx(want[4], rel=1e-4)
    assert hf_m1 != pytest.approx(lf_m4, rel=1e-3)


@pytest.mark.slow
def test_lm_eval_both_routes_at_every_setting(setup):
    root, model, tokenizer, docs = setup
    schedule = [0.5, 0.25, 0.25]
    want4 = expected_perplexity(model, tokenizer, docs, loop_budget=4)
    want_s = expected_perplexity(model, tokenizer, docs, step_schedule=schedule)
    hf = start_lm_eval(
        root,
        lm_eval_command(),
        "hf",
        f"pretrained={root / 'model'},trust_remote_code=True,default_loop_budget=4",
        "hf4",
    )
    lf = start_lm_eval(
        root,
        [sys.executable, "-m", "looped_training.loopformer.lm_eval"],
        "loopformer",
        f"pretrained={root / 'model'},step_schedule=0.5:0.25:0.25",
        "lfs",
    )
    hf_m4, lf_s = finish_lm_eval(hf), finish_lm_eval(lf)
    assert hf_m4 == pytest.approx(want4, rel=1e-4)
    assert lf_s == pytest.approx(want_s, rel=1e-4)


def test_step_schedule_model_arg_parsing():
    from looped_training.loopformer.lm_eval import parse_step_schedule

    assert parse_step_schedule("0.5:0.25:0.25") == [0.5, 0.25, 0.25]
    assert parse_step_schedule("coarse_to_fine") == "coarse_to_fine"
    assert parse_step_schedule(None) is None
    with pytest.raises(ValueError, match="colon-separated"):
        parse_step_schedule("0.5:x")
