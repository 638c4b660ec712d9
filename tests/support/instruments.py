"""Instruments the tests (and the lab's benchmarks, which import them from here) measure with: an op counter and a
meter of the bytes autograd saves for backward. Not part of the library: nothing under loopformer_hf/, fprm_hf/ or
training/ imports them."""

import resource
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback

from fprm_hf import FPRMConfig, FPRMForReasoning


class CountOps(TorchDispatchMode):
    """Counts the tensor operations (ATen calls) dispatched inside the `with` block: at small widths each costs about
    the same fixed overhead, so counts compare per-token work exactly where times on a shared CPU are noisy."""

    def __enter__(self):
        self.count = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class SavedActivations:
    """Bytes of distinct tensors autograd saves for backward, per optimizer step; `peak` over the steps."""

    def __init__(self):
        self.step_bytes, self.peak, self._seen = 0, 0, set()

    def pack(self, tensor):
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in self._seen:
            self._seen.add(key)
            self.step_bytes += key[1]
        return tensor

    def new_step(self):
        self.peak = max(self.peak, self.step_bytes)
        self.step_bytes, self._seen = 0, set()


class StepBoundary(TrainerCallback):
    """Closes the meter's step at each optimizer step's start and end."""

    def __init__(self, meter):
        self.meter = meter

    def on_step_begin(self, args, state, control, **kwargs):
        self.meter.new_step()

    def on_step_end(self, args, state, control, **kwargs):
        self.meter.new_step()


def tiny_sudoku_like(batch, seed=0, size=6, vocab=8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch * 4, size * size), generator=g)
    labels = torch.randint(0, vocab, (batch * 4, size * size), generator=g)
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def train_memory(loops, mode, hidden=64, batch=16, n_backward=4, size=6, seed=0, output_dir="/tmp/fprm_bench"):
    """Train a small grid model for `loops` solver iterations per sample and return the memory it took.

    truncated: loops / n_backward segments of n_backward iterations (one optimizer step each);
    full:      one segment of `loops` iterations (backprop through all of them)."""
    # imported here: the model tests import this module in environments without the installed training package
    from looped_training.fprm.arguments import FPRMTrainingArguments
    from looped_training.fprm.trainer import FPRMTrainer

    if mode not in ("truncated", "full"):
        raise ValueError(f"`mode` must be 'truncated' or 'full', got {mode!r}.")
    if mode == "truncated" and loops % n_backward:
        raise ValueError(f"`loops` ({loops}) must be a multiple of n_backward ({n_backward}) for truncated BPTT.")
    torch.manual_seed(seed)
    config = FPRMConfig(
        vocab_size=8,
        hidden_size=hidden,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        grid_size=size,
        num_prefix_tokens=2,
        init_std=1.0,
    )
    model = FPRMForReasoning(config)
    segment = n_backward if mode == "truncated" else loops
    args = FPRMTrainingArguments(
        output_dir=output_dir,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=batch,
        max_steps=loops // segment,
        n_backward=segment,
        max_segments=loops // segment,
        train_halt_eps=1e-12,
        learning_rate=1e-4,
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_drop_last=True,
    )
    meter = SavedActivations()
    trainer = FPRMTrainer(
        model=model, args=args, train_dataset=tiny_sudoku_like(batch, seed, size), callbacks=[StepBoundary(meter)]
    )
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        trainer.train()
    meter.new_step()
    iterations = int(trainer.carry.state.iterations.max())
    return {
        "loops": loops,
        "mode": mode,
        "segments": loops // segment,
        "iterations_per_sample": iterations,
        "saved_activation_bytes": meter.peak,
        "rss_peak_increase_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "seconds": time.perf_counter() - start,
    }


def warnings_logged(caplog, logger_name, call):
    """(call(), the messages `logger_name` logged at WARNING or above meanwhile): transformers' loggers do not
    propagate to pytest's caplog unless told to."""
    import transformers

    transformers.logging.enable_propagation()
    try:
        with caplog.at_level("WARNING", logger=logger_name):
            result = call()
    finally:
        transformers.logging.disable_propagation()
    return result, [r.getMessage() for r in caplog.records if r.name == logger_name]
