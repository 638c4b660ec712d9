"""The training script under `accelerate launch --num_processes 2` on CPU (gloo): it runs, and both processes run
the same shortcut trajectory at every micro-batch."""

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not os.path.exists(ACCELERATE), reason="the accelerate launcher is not installed in this env")
def test_two_processes_sample_the_same_trajectory_each_step(tmp_path):
    out = tmp_path / "run"
    # accelerate's --cpu launcher starts one process unless MPI is installed; --multi_gpu starts torchrun, and the
    # script's --use_cpu --ddp_backend gloo makes it a CPU (gloo) data-parallel run.
    cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           "-m", "looped_training.loopformer.train", "--output_dir", str(out), "--variant", "loopformer",
           "--hidden_size", "32", "--num_attention_heads", "2", "--num_loops", "4", "--num_train_problems", "128",
           "--num_eval_problems", "8", "--max_depth", "3", "--per_device_train_batch_size", "4",
           "--gradient_accumulation_steps", "2", "--max_steps", "3", "--use_cpu", "--ddp_backend", "gloo",
           "--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1", "--save_strategy", "no",
           "--log_trajectories", "true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": REPO}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    per_rank = []
    for rank in (0, 1):
        lines = (out / f"shortcut_trajectories_rank{rank}.jsonl").read_text().splitlines()
        per_rank.append([json.loads(line) for line in lines])
    assert len(per_rank[0]) == 6  # 3 optimizer steps x 2 accumulated micro-batches
    assert per_rank[0] == per_rank[1]
    assert len({tuple(r["trajectory"]) for r in per_rank[0]}) > 1  # the sampler does vary over steps
    state = json.loads((out / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "ce_short" in h] == [1, 2, 3]
    assert (out / "model.safetensors").exists()
