"""Callbacks of FPRM training: the state-tracking length curriculum, the wall-clock budget of the presets, the EMA of
the weights, and the files a checkpoint holds beside Trainer's (the carry, the EMA shadow)."""

import math
import os
import random
import time

import torch
from safetensors.torch import save_file
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR


def _saved_attributes(callback, state):
    """This callback's attributes in the checkpoint a run resumes from (Trainer keeps every `ExportableState`'s
    `state()` in trainer_state.json), or None. A fresh run's TrainerState holds the callback's own current values."""
    saved = (getattr(state, "stateful_callbacks", None) or {}).get(type(callback).__name__)
    return saved.get("attributes") if isinstance(saved, dict) else None


class LengthCurriculumCallback(TrainerCallback, ExportableState):
    """Raises the stream's maximum length by half (at least 1, at most `final_length`) whenever accuracy at the
    current maximum on a fresh held-out batch reaches `threshold`, and gives every sample enough deep-supervision
    segments to reach its last position (one position per loop step: ceil((length + 2) / n_backward)).

    A checkpoint keeps the length reached, the probe's random state and the history (`state()`), and a resumed run
    goes on from them; they come back in `on_train_begin`, not through Trainer's
    `restore_callback_states_from_checkpoint` (which rebuilds callbacks from JSON arguments: this one holds the
    stream)."""

    def __init__(self, stream, final_length, threshold, check_steps, trainer_args, num_check=256, seed=12345):
        self.stream, self.final_length, self.threshold, self.check_steps = stream, final_length, threshold, check_steps
        self.trainer_args, self.num_check = trainer_args, num_check
        self.base_segments = trainer_args.max_segments
        self.rng = random.Random(seed)
        self.history = []
        self._set_segments()

    def state(self):
        version, internal, gauss = self.rng.getstate()
        return {
            "args": {},
            "attributes": {
                "max_length": self.stream.max_length,
                "history": self.history,
                "rng_state": [version, list(internal), gauss],
            },
        }

    def on_train_begin(self, args, state, control, **kwargs):
        saved = _saved_attributes(self, state)
        if saved:
            self.stream.set_max_length(saved["max_length"])
            self.history = list(saved["history"])
            version, internal, gauss = saved["rng_state"]
            self.rng.setstate((version, tuple(internal), gauss))
            self._set_segments()

    def _set_segments(self):
        needed = math.ceil((self.stream.max_length + 2) / self.trainer_args.n_backward)
        self.trainer_args.max_segments = max(self.base_segments, needed)

    @torch.no_grad()
    def accuracy_at_max_length(self, model):
        length = self.stream.max_length
        rows = self.stream.sample(self.num_check, self.rng)
        ids, labels = torch.tensor(rows["input_ids"]), torch.tensor(rows["labels"])
        full = torch.tensor(rows["length"]) == length
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        logits = model(ids.to(device), max_loops=length + 4, halting=False).logits
        model.train(was_training)
        correct = (logits.argmax(-1).cpu() == labels)[full, length - 1]
        return float(correct.float().mean()) if correct.numel() else 0.0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.check_steps or self.stream.max_length >= self.final_length:
            return
        acc = self.accuracy_at_max_length(model)
        self.history.append({"step": state.global_step, "max_length": self.stream.max_length, "accuracy": acc})
        if acc >= self.threshold:
            length = self.stream.max_length
            self.stream.set_max_length(min(self.final_length, length + max(1, length // 2)))
            self._set_segments()
            print(
                f"curriculum: step {state.global_step}, accuracy {acc:.3f} at length {length} -> train up to "
                f"length {self.stream.max_length} ({self.trainer_args.max_segments} segments)"
            )


class TimeBudgetCallback(TrainerCallback, ExportableState):
    """Stops training after a wall-clock budget (the presets promise a CPU time). With `decay_fraction` > 0 the
    learning rate also falls linearly to 0 over that last fraction of the budget, on top of the Trainer's own
    schedule: the step count a budget buys is not known in advance, so a step-based decay cannot be placed.
    A checkpoint keeps the time spent, so a resumed run has what was left of the budget, and the unscaled learning
    rates (the scheduler's state in the checkpoint holds the scaled ones, which a resumed run would scale again)."""

    def __init__(self, minutes, decay_fraction=0.0, clock=time.perf_counter):
        if not 0 <= decay_fraction <= 1:
            raise ValueError(f"`time_budget_decay_fraction` must lie in [0, 1], got {decay_fraction}.")
        self.seconds, self.decay_fraction, self.clock = minutes * 60, decay_fraction, clock

    def state(self):
        attributes = {"elapsed_s": self.clock() - self.start if hasattr(self, "start") else 0.0}
        if getattr(self, "base_lrs", None) is not None:
            attributes["base_lrs"] = list(self.base_lrs)
        return {"args": {}, "attributes": attributes}

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        saved = _saved_attributes(self, state) or {}
        self.start = self.clock() - saved.get("elapsed_s", 0.0)
        if self.decay_fraction:
            if not isinstance(lr_scheduler, torch.optim.lr_scheduler.LambdaLR):
                raise ValueError(
                    f"A time-based decay needs a LambdaLR schedule (constant, linear, cosine, ...), got "
                    f"{type(lr_scheduler).__name__}."
                )
            # resumed: the scheduler restored from the checkpoint holds base values this callback had scaled
            base_lrs = saved.get("base_lrs")
            if base_lrs is None or len(base_lrs) != len(lr_scheduler.base_lrs):
                base_lrs = lr_scheduler.base_lrs
            self.base_lrs = list(base_lrs)

    def lr_factor(self):
        left = 1 - (self.clock() - self.start) / self.seconds
        return min(1.0, max(0.0, left) / self.decay_fraction) if self.decay_fraction else 1.0

    def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if not self.decay_fraction:
            return
        factor = self.lr_factor()
        # scale the scheduler's base values too, so that the logged learning rate is the one used
        for i, group in enumerate(optimizer.param_groups):
            lr_scheduler.base_lrs[i] = self.base_lrs[i] * factor
            group["lr"] = lr_scheduler.base_lrs[i] * lr_scheduler.lr_lambdas[i](lr_scheduler.last_epoch)

    def on_step_end(self, args, state, control, **kwargs):
        if self.clock() - self.start > self.seconds:
            control.should_training_stop = True


class EMACallback(TrainerCallback):
    """Their EMAHelper: a shadow copy of the trained parameters, shadow ← (1 − μ)·p + μ·shadow after every
    optimizer step (`on_step_end`), from the weights at the start of training. The prefix rows of a SignSGD run are
    not averaged (theirs are a buffer, outside `named_parameters`)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.trainer.ema is None:
            self.trainer.ema = {n: p.detach().clone() for n, p in self.trainer.ema_parameters()}

    def on_step_end(self, args, state, control, **kwargs):
        mu = args.ema_decay
        with torch.no_grad():
            for name, p in self.trainer.ema_parameters():
                shadow = self.trainer.ema[name]
                shadow.copy_((1.0 - mu) * p.detach() + mu * shadow)

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, ema_file(args))
        save_file({k: v.contiguous() for k, v in self.trainer.ema.items()}, path + ".tmp")
        os.replace(path + ".tmp", path)


def ema_file(args):
    return f"fprm_ema_{args.process_index}.safetensors" if args.world_size > 1 else "fprm_ema.safetensors"


def carry_file(args):
    """The carry's file name in a checkpoint: one per process, as Trainer's RNG states."""
    return f"fprm_carry_{args.process_index}.safetensors" if args.world_size > 1 else "fprm_carry.safetensors"


class CarryCheckpointCallback(TrainerCallback):
    """Adds the trainer's carry to each checkpoint when Trainer has written it (`on_save`), under a temporary name
    renamed when complete, so that a kill while it is written leaves no truncated carry."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        carry = self.trainer.carry
        if carry is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, carry_file(args))
        save_file(carry.tensors(), path + ".tmp")
        os.replace(path + ".tmp", path)
