"""Tensor parallelism as for Llama: `LoopFormerForCausalLM.from_pretrained(path, tp_plan="auto")` under torchrun with
2 processes on CPU (gloo) splits each block's attention heads and MLP columns across the ranks (the config's
`base_model_tp_plan`; the lm_head's columns, gathered), and computes what one process computes: the logits at every
loop budget, greedy generation with the cache, and generation with per-token halting. Both layouts: LoopFormer
(learned positions, GELU, adaLN) and Base-Loop with RoPE, SwiGLU and grouped-query attention.

Run as a script, this file is the worker that torchrun starts."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import REPO_ROOT, TESTS_DIR

IDS = [[3, 4, 5, 6, 7, 8, 9]]
BUDGETS = (1, 2, 4)  # on the 1/4 grid of num_loops=4
GENERATE = dict(max_new_tokens=8, do_sample=False)
VARIANTS = {
    "loopformer": {},
    "base_loop": dict(
        loop_conditioning="none",
        block_norm_weight=True,
        position_embedding_type="rope",
        hidden_act="swiglu",
        num_key_value_heads=2,
    ),
}


def run(model):
    """What both sides compare: logits per budget, greedy tokens with the cache, tokens with halting."""
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits = {budget: model(ids, loop_budget=budget).logits.tolist() for budget in BUDGETS}
    return {
        "logits": logits,
        "greedy": model.generate(ids, loop_budget=2, **GENERATE).tolist(),
        "halting": model.generate(ids, halt_eps=0.3, **GENERATE).tolist(),
    }


def worker(checkpoint, out):
    from loopformer_hf import LoopFormerForCausalLM

    model = LoopFormerForCausalLM.from_pretrained(checkpoint, tp_plan="auto").eval()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    result = {"rank": int(os.environ["RANK"]), "q_proj_local_rows": q_proj.to_local().shape[0], **run(model)}
    Path(out).with_suffix(f".{result['rank']}.json").write_text(json.dumps(result))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_with_tp_plan_auto_compute_what_one_process_computes(tmp_path, variant):
    from loopformer_hf import LoopFormerForCausalLM
    from support.tiny_models import randomize_modulation, tiny_loopformer_config

    torch.manual_seed(0)
    model = randomize_modulation(LoopFormerForCausalLM(tiny_loopformer_config(**VARIANTS[variant]))).eval()
    model.save_pretrained(tmp_path / "ckpt")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            __file__,
            str(tmp_path / "ckpt"),
            str(tmp_path / "out"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = run(model)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert got["q_proj_local_rows"] == model.config.hidden_size // 2  # each rank holds half of the heads
        for budget in BUDGETS:
            torch.testing.assert_close(
                torch.tensor(got["logits"][str(budget)]), torch.tensor(expected["logits"][budget]), atol=1e-5, rtol=0
            )
        assert got["greedy"] == expected["greedy"] and got["halting"] == expected["halting"]


if __name__ == "__main__":
    worker(*sys.argv[1:])
