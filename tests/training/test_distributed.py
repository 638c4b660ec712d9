"""2-process data parallelism on CPU (gloo) through `accelerate launch` with the shipped configs in
training/configs/accelerate/: each rank trains on different data at changing loop budgets with the
shortcut-consistency objective (both trajectories in the one forward the wrapper sees); every step's gradients equal
a single-process run's average over the two ranks' batches, and the parameters stay identical across ranks (and
moved).

- ddp.yaml: accelerate's DDP (MULTI_CPU with ACCELERATE_USE_CPU).
- fsdp.yaml: on CPU accelerate 1.15 enables FSDP only for GPU-like distributed types and would silently run DDP, so
  the worker shards the model itself with torch's FSDP2 `fully_shard`, as the config asks accelerate to (each class
  named in `fsdp_transformer_layer_cls_to_wrap` its own unit, the rest the root unit, `reshard_after_forward`).
- The training script itself (`-m looped_training.loopformer.train`) under ddp.yaml: no `find_unused_parameters`
  warning, the same trajectory on both ranks, and the same parameters as one process given the same global batch.

Run as a script, this file is the training worker that `accelerate launch` starts."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from support.hub_helpers import CORPUS, make_model
from loopformer_hf import ShortcutConsistency
from support import REPO_ROOT, TESTS_DIR

CONFIGS = REPO_ROOT / "training" / "configs" / "accelerate"
BUDGETS = [1, 4, 2]
SHORT = [0.5, 0.25, 0.25]  # the short trajectory of the consistency objective


def _batch(generator, vocab_size):
    return torch.randint(0, vocab_size, (2, 16), generator=generator)


def _loss(model, ids, budget):
    return model(input_ids=ids, labels=ids, loop_budget=budget, shortcut_consistency=ShortcutConsistency(SHORT)).loss


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full(tensor):
    """The whole tensor on every rank (FSDP2 holds parameters and gradients as sharded DTensors)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _flat_grads(model):
    return torch.cat([_full(p.grad.detach()).flatten() for p in model.parameters()])


def _flat_params(model):
    return torch.cat([_full(p.detach()).flatten() for p in model.parameters()])


def _fully_shard_as_configured(model):
    """FSDP2 as fsdp.yaml configures it, with torch's `fully_shard` on a CPU mesh: the plugin reads the config's
    settings from the environment `accelerate launch` sets; each module of a class it names to wrap (default: the
    model's `_no_split_modules`) is its own unit, the rest goes to the root unit."""
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2, "fsdp.yaml asks for FSDP2 (`fully_shard`)"
    names = plugin.transformer_cls_names_to_wrap or list(model._no_split_modules)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    units = [m for m in model.modules() if type(m).__name__ in names]
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
    }
    for module in units:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return len(units)


def worker(out_dir):
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    torch.set_num_threads(1)
    accelerator = Accelerator()
    model = make_model(seed=0).train()  # same seed: identical start on every rank (DDP also broadcasts it)
    fsdp_units = 0
    fsdp_launch = os.environ.get("ACCELERATE_USE_FSDP", "false") == "true"
    if fsdp_launch and accelerator.distributed_type != DistributedType.FSDP:
        fsdp_units = _fully_shard_as_configured(model)  # before the optimizer: it must hold the sharded parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if not fsdp_units:
        model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    local_numel = sum(getattr(p, "to_local", lambda: p)().numel() for p in inner.parameters())
    data = torch.Generator().manual_seed(1000 + accelerator.process_index)  # different batches per rank
    losses, grads = [], []
    for budget in BUDGETS:
        ids = _batch(data, inner.config.vocab_size)
        loss = _loss(model, ids, budget)
        accelerator.backward(loss)
        grads.append(_flat_grads(inner))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.save(
        {
            "params": _flat_params(inner),
            "grads": grads,
            "losses": losses,
            "world": accelerator.num_processes,
            "backend": dist.get_backend(),
            "type": str(accelerator.distributed_type),
            "fsdp_units": fsdp_units,
            "local_numel": local_numel,
            "wrapper": type(model).__name__,
        },
        Path(out_dir) / f"rank{accelerator.process_index}.pt",
    )


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
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[fsdp["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]],
    )
    assert plugin.transformer_cls_names_to_wrap == ["LoopFormerBlock"]
    assert get_module_class_from_name(model, "LoopFormerBlock") is type(blocks[0])


@pytest.mark.parametrize("config", ["ddp", "fsdp"])
def test_two_process_run_on_cpu_matches_one_process(tmp_path, config):
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / f"{config}.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(_free_port()),
        __file__,
        str(tmp_path),
    ]
    # Both configs make `accelerate launch` start one process per rank through torchrun; ACCELERATE_USE_CPU makes
    # each rank join a gloo group on CPU (accelerate's `--cpu` flag would run one process).
    # the ranks import this checkout's packages (not an installed copy) and this file's helpers
    path = os.pathsep.join([str(TESTS_DIR), str(REPO_ROOT)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": path}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0["world"] == r1["world"] == 2 and r0["backend"] == "gloo"
    # accelerate sets up MULTI_CPU for both configs: on CPU it does not enable FSDP (hence the worker's own sharding)
    assert r0["type"] == "DistributedType.MULTI_CPU"
    start = make_model(seed=0)
    total = start.num_parameters()
    if config == "fsdp":
        assert r0["fsdp_units"] == start.config.num_hidden_layers  # one unit per shared block
        assert r0["wrapper"].startswith("FSDP") and r0["local_numel"] + r1["local_numel"] == total  # sharded ...
        assert max(r0["local_numel"], r1["local_numel"]) < total  # ... not replicated
    else:
        assert r0["wrapper"] == "DistributedDataParallel" and r0["local_numel"] == total
    assert r0["losses"] != r1["losses"]  # different data on each rank ...
    assert torch.equal(r0["params"], r1["params"])  # ... yet identical parameters: gradients were reduced
    assert not torch.allclose(r0["params"], torch.cat([p.detach().flatten() for p in start.parameters()]))  # moved

    # One process replays the run: each step's gradient is the mean of the two ranks' batch gradients (what DDP's
    # all-reduce and FSDP's reduce-scatter compute), and the whole objective, short trajectory included, must have
    # been inside the wrapped forward.
    model = make_model(seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [torch.Generator().manual_seed(1000 + rank) for rank in (0, 1)]
    worst = 0.0
    for step, budget in enumerate(BUDGETS):
        per_rank = []
        for rank in (0, 1):
            model.zero_grad()
            _loss(model, _batch(data[rank], model.config.vocab_size), budget).backward()
            per_rank.append(_flat_grads(model))
        expected = (per_rank[0] + per_rank[1]) / 2
        for r in (r0, r1):
            torch.testing.assert_close(r["grads"][step], expected, rtol=1e-4, atol=1e-6)
            worst = max(worst, (r["grads"][step] - expected).abs().max().item())
        offset = 0
        for p in model.parameters():
            p.grad = expected[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
    final = _flat_params(model)
    torch.testing.assert_close(r0["params"], final, rtol=1e-4, atol=1e-5)
    print(
        f"{config}: max |gradient difference| to one process over {len(BUDGETS)} steps: {worst:.3g}; "
        f"max |parameter difference| after them: {(r0['params'] - final).abs().max().item():.3g}"
    )


@pytest.mark.parametrize("variant", ["loopformer", "base_loop", "tmlt", "naive_loop_ee", "tmlt_ee", "base"])
def test_every_parameter_gets_a_gradient_in_each_variants_training_forward(variant):
    """Why train.py runs DDP with find_unused_parameters=False: a parameter without a gradient would make DDP fail."""
    import random

    from loopformer_hf import LoopFormerForCausalLM
    from looped_training.loopformer.objective import sample_early_exit_trajectory, sample_shortcut_trajectory
    from looped_training.loopformer.arguments import VARIANTS, ModelArguments
    from looped_training.loopformer.train import build_config

    config = build_config(ModelArguments(variant=variant, hidden_size=32, num_attention_heads=2, num_loops=4), 64, 16)
    torch.manual_seed(0)
    model = LoopFormerForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 16))
    trajectory = VARIANTS[variant][2]
    fields = {}
    if trajectory is not None:  # the callback's fields; a one-step short run is the sparsest it draws
        sample = sample_shortcut_trajectory if trajectory == "shortcut" else sample_early_exit_trajectory
        rng = random.Random(0)
        short = next(t for t in iter(lambda: sample(rng, config.num_loops), None) if len(t) == 1)
        fields = {"shortcut_consistency": ShortcutConsistency(short, 0.1, 0.1)}
    model(input_ids=ids, labels=ids, **fields).loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []


def test_training_script_refuses_fsdp_that_accelerate_did_not_set_up(tmp_path, monkeypatch):
    """On CPU accelerate turns the FSDP launch of fsdp.yaml into plain DDP; train.py says so instead of training."""
    from looped_training.loopformer.train import main

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file fsdp.yaml` sets
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    with pytest.raises(ValueError, match=r"FSDP was requested .* without it: .*accelerate ddp"):
        main(_training_args(corpus, tmp_path / "run", per_device_batch=2))
    assert not (tmp_path / "run" / "model.safetensors").exists()


def _training_args(corpus, output_dir, per_device_batch):
    """A tiny LoopFormer text run with the consistency objective: full blocks of text make every row carry the same
    number of labelled tokens, so two ranks' batches weigh as their union does in one process; plain SGD, a constant
    learning rate keep the parameters a simple function of the (clipped) gradients."""
    return [
        "--output_dir",
        str(output_dir),
        "--variant",
        "loopformer",
        "--task",
        "text",
        "--train_files",
        str(corpus),
        "--block_size",
        "16",
        "--tokenizer_vocab_size",
        "300",
        "--hidden_size",
        "32",
        "--num_attention_heads",
        "2",
        "--num_loops",
        "4",
        "--per_device_train_batch_size",
        str(per_device_batch),
        "--gradient_accumulation_steps",
        "2",
        "--max_steps",
        "2",
        "--optim",
        "sgd",
        "--learning_rate",
        "0.5",
        "--lr_scheduler_type",
        "constant",
        "--eval_strategy",
        "no",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--log_trajectories",
        "true",
        "--use_cpu",
    ]


def _trajectories(run, rank):
    lines = (run / f"shortcut_trajectories_rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_training_script_under_ddp_yaml_matches_one_process_without_unused_parameter_warning(tmp_path):
    from safetensors.torch import load_file

    from looped_training.loopformer.train import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3))
    two, one = tmp_path / "two", tmp_path / "one"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / "ddp.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(_free_port()),
        "-m",
        "looped_training.loopformer.train",
        *_training_args(corpus, two, per_device_batch=2),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    # the Trainer's default (find_unused_parameters=True) made torch warn on every rank; train.py turns it off
    assert "find_unused_parameters" not in output

    # both ranks ran the same trajectory at every micro-batch (2 optimizer steps x 2 accumulated), and it varied
    per_rank = [_trajectories(two, rank) for rank in (0, 1)]
    assert len(per_rank[0]) == 4 and per_rank[0] == per_rank[1]
    assert len({tuple(r["trajectory"]) for r in per_rank[0]}) > 1
    state = json.loads((two / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "ce_short" in h] == [1, 2]

    # One process with twice the per-device batch sees the same global batches (accelerate's seeded sampler, rank r
    # taking every other batch of it) with the same trajectories: the trained parameters agree.
    main(_training_args(corpus, one, per_device_batch=4))
    assert _trajectories(one, 0) == per_rank[0]
    logged = [
        [
            (h["loss"], h["grad_norm"])
            for h in json.loads((run / "trainer_state.json").read_text())["log_history"]
            if "grad_norm" in h
        ]
        for run in (two, one)
    ]
    assert len(logged[1]) == 2 and min(g for _, g in logged[1]) > 1e-3  # the steps did move the parameters
    torch.testing.assert_close(torch.tensor(logged[0]), torch.tensor(logged[1]), rtol=1e-4, atol=1e-6)
    distributed, single = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    assert distributed.keys() == single.keys()
    for name in single:
        torch.testing.assert_close(distributed[name], single[name], rtol=1e-4, atol=1e-5)
    worst = max((distributed[k] - single[k]).abs().max().item() for k in single)
    print(f"train.py under ddp.yaml: max |parameter difference| to one process after 2 steps: {worst:.3g}")


def test_fprm_training_script_under_ddp_yaml_saves_evaluates_and_writes_once(tmp_path):
    # every rank saved model/, ran the whole evaluation and wrote results.json and the plots, at the same time
    out = tmp_path / "fprm"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / "ddp.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(_free_port()),
        "-m",
        "looped_training.fprm.train",
        "--task",
        "sudoku",
        "--sudoku_size",
        "4",
        "--num_train",
        "64",
        "--num_test",
        "8",
        "--hidden_size",
        "32",
        "--intermediate_size",
        "64",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "16",
        "--disable_tqdm",
        "true",
        "--torch_threads",
        "1",
        "--output_dir",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert output.count(f"wrote {out}/results.json") == 1 and output.count("exact acc") >= 1
    assert output.count("cell acc") == output.count("exact acc")  # one report's lines, not two
    assert (out / "model" / "model.safetensors").is_file()

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    results = json.loads((out / "results.json").read_text(), parse_constant=refuse)
    assert results["train_steps"] == 2


if __name__ == "__main__":
    worker(sys.argv[1])
