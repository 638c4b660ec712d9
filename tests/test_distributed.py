"""2-process DDP on CPU (gloo) through `accelerate launch` with the shipped looped_training/configs/accelerate/ddp.yaml: each rank
trains on different data at changing loop budgets with the shortcut-consistency objective (both trajectories in the
one forward DDP wraps); every step's gradients equal a single-process run's average over the two ranks' batches, and
the parameters stay identical across ranks (and moved).

Run as a script, this file is the training worker that `accelerate launch` starts."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from _hub_helpers import REPO_ROOT, make_model

CONFIGS = REPO_ROOT / "looped_training" / "configs" / "accelerate"
BUDGETS = [1, 4, 2]
SHORT = [0.5, 0.25, 0.25]  # the short trajectory of the consistency objective


def _batch(generator, vocab_size):
    return torch.randint(0, vocab_size, (2, 16), generator=generator)


def _loss(model, ids, budget):
    return model(input_ids=ids, labels=ids, loop_budget=budget, short_step_schedule=SHORT).loss


def _flat_grads(model):
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(out_dir):
    import torch.distributed as dist
    from accelerate import Accelerator

    torch.set_num_threads(1)
    accelerator = Accelerator()
    model = make_model(seed=0).train()  # same seed: identical start on every rank (DDP also broadcasts it)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.Generator().manual_seed(1000 + accelerator.process_index)  # different batches per rank
    losses, grads = [], []
    for budget in BUDGETS:
        ids = _batch(data, accelerator.unwrap_model(model).config.vocab_size)
        loss = _loss(model, ids, budget)
        accelerator.backward(loss)
        grads.append(_flat_grads(accelerator.unwrap_model(model)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    flat = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    torch.save({"params": flat, "grads": grads, "losses": losses, "world": accelerator.num_processes,
                "backend": dist.get_backend(), "type": str(accelerator.distributed_type)},
               Path(out_dir) / f"rank{accelerator.process_index}.pt")


def test_configs_are_valid_and_fsdp_wraps_the_shared_blocks():
    from loopformer_hf import LoopFormerForCausalLM

    ddp, fsdp, ds = (yaml.safe_load((CONFIGS / f"{n}.yaml").read_text()) for n in ("ddp", "fsdp", "deepspeed"))
    assert ddp["distributed_type"] == "MULTI_GPU"
    assert fsdp["distributed_type"] == "FSDP" and ds["distributed_type"] == "DEEPSPEED"
    assert fsdp["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] in LoopFormerForCausalLM._no_split_modules
    # every class named for wrapping exists in the model, so the policy wraps the shared blocks
    model = make_model()
    blocks = [m for m in model.modules() if type(m).__name__ in LoopFormerForCausalLM._no_split_modules]
    assert len(blocks) == model.config.num_hidden_layers
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.dataclasses import get_module_class_from_name

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[fsdp["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]],
    )
    assert plugin.transformer_cls_names_to_wrap == ["LoopFormerBlock"]
    assert get_module_class_from_name(model, "LoopFormerBlock") is type(blocks[0])


def test_two_process_ddp_on_cpu_keeps_parameters_identical(tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "ddp.yaml"),
           "--num_processes", "2", "--main_process_port", str(_free_port()), __file__, str(tmp_path)]
    # The config's MULTI_GPU makes `accelerate launch` start one process per rank through torchrun;
    # ACCELERATE_USE_CPU makes each rank join a gloo group on CPU (accelerate's `--cpu` flag would run one process).
    # the ranks import this checkout's packages (not an installed copy) and this file's helpers
    path = os.pathsep.join([str(Path(__file__).parent), str(REPO_ROOT)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": path}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0["world"] == r1["world"] == 2 and r0["backend"] == "gloo" and r0["type"] == "DistributedType.MULTI_CPU"
    assert r0["losses"] != r1["losses"]  # different data on each rank ...
    assert torch.equal(r0["params"], r1["params"])  # ... yet identical parameters: gradients were all-reduced
    start = torch.cat([p.detach().flatten() for p in make_model(seed=0).parameters()])
    assert not torch.allclose(r0["params"], start)  # and training moved them

    # One process replays the run: each step's gradient is the mean of the two ranks' batch gradients (DDP's
    # all-reduce), and the whole objective, short trajectory included, must have been inside the synced forward.
    model = make_model(seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [torch.Generator().manual_seed(1000 + rank) for rank in (0, 1)]
    for step, budget in enumerate(BUDGETS):
        per_rank = []
        for rank in (0, 1):
            model.zero_grad()
            _loss(model, _batch(data[rank], model.config.vocab_size), budget).backward()
            per_rank.append(_flat_grads(model))
        expected = (per_rank[0] + per_rank[1]) / 2
        for r in (r0, r1):
            torch.testing.assert_close(r["grads"][step], expected, rtol=1e-4, atol=1e-6)
        offset = 0
        for p in model.parameters():
            p.grad = expected[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
    final = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(r0["params"], final, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    worker(sys.argv[1])
