"""ShortcutConsistencyCallback: the trajectory sampler, λ schedule and logs of LoopFormer's shortcut-consistency
objective for the stock `Trainer`.

Per micro-batch the model runs two trajectories through the same weights (spec, "Training: shortcut consistency"):

    loss = CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)

The model computes this itself: `LoopFormerForCausalLM.forward(labels=..., short_step_schedule=..., lambda_short=...,
lambda_consistency=..., consistency_loss=...)` returns the combined loss and its three terms, so both trajectories run
inside the one forward the Trainer calls (under DDP, inside the wrapper). The callback decides what goes into that
forward, through a data collator that adds those fields to each training batch:

- full: the training trajectory [1/L] * L (the model's default);
- short: S ~ U{1..L-1} steps, each a multiple of 1/L drawn uniformly among those that leave at least 1/L for
  every remaining step, the last one filling up to 1 (`trajectory="shortcut"`, LoopFormer); or the first S of the
  L uniform steps (`trajectory="early_exit"`, the -EE baselines, whose models only know a step count);
- D: MSE on the final normed hidden states (the reference, mean-reduced) or, with `consistency="kl"`,
  KL(p_full || p_short) of the next-token distributions on the labelled positions;
- λ1, λ2: grow linearly from 0 over `warmup_steps` optimizer steps.

    callback = ShortcutConsistencyCallback(lambda_short=0.1, lambda_consistency=0.1)
    trainer = Trainer(model=model, args=args, train_dataset=ds, **callback.trainer_kwargs(default_data_collator))

Without the callback the Trainer trains the model as a plain looped LM (the model's own CE on the full trajectory).

The sampler is counter-based: the trajectory of the n-th training micro-batch is drawn from
`random.Random(f"{seed}:{n}")`. Every process of a data-parallel run holds the same seed and collates the same
micro-batches in the same order, so all processes run the same trajectory each step without communicating. The
count of trained micro-batches is the sampler's state; it is saved in every checkpoint (`trainer_state.json`,
`stateful_callbacks`) and restored at `on_train_begin`, so a resumed run draws exactly the trajectories the
uninterrupted one would have drawn. Batches collated for an evaluation carry no trajectory and draw none.
The collator runs in the main process: `dataloader_num_workers` must be 0. The model computes the objective from the
labels, so a Trainer that takes them to compute its own loss (`label_smoothing_factor`) is refused.

CE_full, CE_short and the consistency term (per-token means over the logging window, on the main process) and the
current λ1, λ2 are added to the Trainer's logs (`state.log_history` and the progress/printer output); the callback
reads them from the model's output (a read-only forward hook: the Trainer hands callbacks no outputs).
"""

import json
import math
import numbers
import os
import random

from transformers import TrainerCallback, default_data_collator
from transformers.trainer_callback import ExportableState

CONSISTENCY_LOSSES = ("mse", "kl")
TRAJECTORY_KINDS = ("auto", "shortcut", "early_exit")


def sample_shortcut_trajectory(rng, num_loops):
    """A shortcut trajectory on the 1/L grid: S ~ U{1..L-1} steps, each step a uniform multiple of 1/L that leaves
    at least 1/L for every remaining step, the last step filling up to exactly 1."""
    length = rng.randint(1, num_loops - 1)
    units, remaining = [], num_loops
    for i in range(length - 1):
        u = rng.randint(1, remaining - (length - 1 - i))
        units.append(u)
        remaining -= u
    units.append(remaining)
    return tuple(u / num_loops for u in units)


def sample_early_exit_trajectory(rng, num_loops):
    """The first S ~ U{1..L-1} steps of the uniform trajectory (a model without Δ conditioning sees only S)."""
    length = rng.randint(1, num_loops - 1)
    return tuple([1.0 / length] * length)


class ShortcutCollator:
    """A data collator that adds the shortcut-consistency fields of `LoopFormerForCausalLM.forward`
    (`short_step_schedule`, `lambda_short`, `lambda_consistency`, `consistency_loss`) to each training batch that
    `collator` builds; the callback decides them."""

    def __init__(self, callback, collator=None):
        self.callback = callback
        self.collator = default_data_collator if collator is None else collator

    def __call__(self, features):
        batch = self.collator(features)
        if self.callback.collating_training_batches:
            batch.update(self.callback.next_batch_fields())
        return batch


class ShortcutConsistencyCallback(TrainerCallback, ExportableState):
    """Decides the per-batch inputs of the shortcut-consistency objective that the model computes (λ1, λ2 and their
    warm-up, the seeded trajectory sampler, the consistency distance) and logs its three terms.

    Args:
        lambda_short (`float`, defaults to 0.1): λ1, weight of CE on the short trajectory.
        lambda_consistency (`float`, defaults to 0.1): λ2, weight of the consistency term.
        warmup_steps (`int`, defaults to 0): λ1 and λ2 grow linearly from 0 over this many optimizer steps.
        consistency (`str`, defaults to `"mse"`): `"mse"` on final normed hidden states (reference) or `"kl"`
            on next-token distributions.
        trajectory (`str`, defaults to `"auto"`): `"shortcut"`, `"early_exit"`, or `"auto"` (shortcut for a model
            with `loop_conditioning="shortcut"`, early exit otherwise).
        seed (`int`, defaults to 0): seed of the trajectory sampler; the same on every process.
        log_trajectories_dir (`str`, *optional*): if set, each process appends the trajectory of each micro-batch
            it trains to `shortcut_trajectories_rank{R}.jsonl` there (for checking multi-process runs); across
            resumes the file holds every micro-batch of the run exactly once.
    """

    def __init__(self, lambda_short=0.1, lambda_consistency=0.1, warmup_steps=0, consistency="mse",
                 trajectory="auto", seed=0, log_trajectories_dir=None):
        for name, value in (("lambda_short", lambda_short), ("lambda_consistency", lambda_consistency)):
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value >= 0 or math.isinf(value):
                raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be an integer >= 0, got {warmup_steps!r}.")
        if consistency not in CONSISTENCY_LOSSES:
            raise ValueError(f"`consistency` must be one of {CONSISTENCY_LOSSES}, got {consistency!r}.")
        if trajectory not in TRAJECTORY_KINDS:
            raise ValueError(f"`trajectory` must be one of {TRAJECTORY_KINDS}, got {trajectory!r}.")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"`seed` must be an integer, got {seed!r}.")
        self.lambda_short = float(lambda_short)
        self.lambda_consistency = float(lambda_consistency)
        self.warmup_steps = warmup_steps
        self.consistency = consistency
        self.trajectory = trajectory
        self.seed = seed
        self.log_trajectories_dir = log_trajectories_dir
        self.micro_batches_seen = 0  # the sampler's state: micro-batches trained so far
        self.sampled = []  # trajectories this process ran, in order (this session only)
        self.collating_training_batches = False  # set while the Trainer collates training (not evaluation) batches
        self._next_index = 0  # the micro-batch the collator's next batch will be
        self._hook = None
        self._global_step = 0
        self._kind = None
        self._reset_window()

    def trainer_kwargs(self, data_collator=None):
        """`Trainer(..., **callback.trainer_kwargs(data_collator))`: registers the callback and wraps `data_collator`
        (default: transformers' `default_data_collator`) so that each training batch carries the short trajectory."""
        return {"callbacks": [self], "data_collator": ShortcutCollator(self, data_collator)}

    # ---- sampler -------------------------------------------------------------------------------------------------

    def sample_trajectory(self, index, num_loops, kind):
        """The trajectory of training micro-batch `index` (a pure function of seed, index, L and kind)."""
        rng = random.Random(f"shortcut-sampler:{self.seed}:{index}")
        if kind == "shortcut":
            return sample_shortcut_trajectory(rng, num_loops)
        return sample_early_exit_trajectory(rng, num_loops)

    def lambdas(self, step=None):
        """(λ1, λ2) at optimizer step `step` (default: the current one), after warm-up."""
        step = self._global_step if step is None else step
        ramp = 1.0 if self.warmup_steps == 0 else min(1.0, step / self.warmup_steps)
        return self.lambda_short * ramp, self.lambda_consistency * ramp

    def next_batch_fields(self):
        """The forward arguments of the next training micro-batch (called by `ShortcutCollator`, in collation order,
        which the Trainer keeps equal to training order)."""
        index = self._next_index
        self._next_index += 1
        # a micro-batch belongs to optimizer step index // gradient_accumulation_steps (exact unless an epoch ends
        # with a shorter accumulation step)
        lambda_short, lambda_consistency = self.lambdas(index // self._accumulation)
        return {"short_step_schedule": list(self.sample_trajectory(index, self._num_loops, self._kind)),
                "lambda_short": lambda_short, "lambda_consistency": lambda_consistency,
                "consistency_loss": self.consistency}

    # ---- Trainer events ------------------------------------------------------------------------------------------

    def state(self):
        return {
            "args": {
                "lambda_short": self.lambda_short,
                "lambda_consistency": self.lambda_consistency,
                "warmup_steps": self.warmup_steps,
                "consistency": self.consistency,
                "trajectory": self.trajectory,
                "seed": self.seed,
                "log_trajectories_dir": self.log_trajectories_dir,
            },
            "attributes": {"micro_batches_seen": self.micro_batches_seen},
        }

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("ShortcutConsistencyCallback needs the model at on_train_begin (use the stock Trainer).")
        config = model.config
        num_loops = getattr(config, "num_loops", None)
        if not isinstance(num_loops, int) or num_loops < 2:
            raise ValueError(
                f"Shortcut consistency samples a short trajectory of 1..L-1 steps and needs a looped model with "
                f"num_loops >= 2; got num_loops={num_loops!r}. Train such a model without the callback."
            )
        conditioning = getattr(config, "loop_conditioning", None)
        kind = self.trajectory
        if kind == "auto":
            kind = "shortcut" if conditioning == "shortcut" else "early_exit"
        if kind == "shortcut" and conditioning != "shortcut":
            raise ValueError(
                f"trajectory='shortcut' needs a model with loop_conditioning='shortcut'; this model has "
                f"{conditioning!r}, which only knows step counts: use trajectory='early_exit' or 'auto'."
            )
        self._kind = kind
        self._num_loops = num_loops
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(saved, dict):  # resuming: continue the sampler where the checkpoint left it
            saved_args = saved.get("args", {})
            if saved_args.get("seed", self.seed) != self.seed:
                raise ValueError(
                    f"The checkpoint's shortcut sampler used seed {saved_args.get('seed')!r}, this run gives seed "
                    f"{self.seed!r}: resuming would not reproduce the run. Use the checkpoint's seed."
                )
            self.micro_batches_seen = int(saved.get("attributes", {}).get("micro_batches_seen", 0))
        if args.dataloader_num_workers:
            raise ValueError(
                f"ShortcutConsistencyCallback draws each micro-batch's trajectory in the data collator, counting "
                f"batches in the main process; got dataloader_num_workers={args.dataloader_num_workers}: use 0."
            )
        if args.label_smoothing_factor:
            raise ValueError(
                f"ShortcutConsistencyCallback's objective is computed by the model from the labels, but with "
                f"label_smoothing_factor={args.label_smoothing_factor} the Trainer takes them and computes a plain "
                f"loss itself: use label_smoothing_factor=0."
            )
        collate = getattr(kwargs.get("train_dataloader"), "collate_fn", None)
        collator = getattr(collate, "data_collator", collate)
        if collate is not None and not isinstance(collator, ShortcutCollator):
            raise ValueError(
                "ShortcutConsistencyCallback passes each micro-batch's trajectory through its data collator: build "
                "the Trainer with `Trainer(..., **callback.trainer_kwargs(data_collator))`."
            )
        if collator is not None:
            # `restore_callback_states_from_checkpoint` replaces this callback by a new instance: the collator must
            # ask the one that trains
            collator.callback = self
        self._global_step = state.global_step
        self._accumulation = args.gradient_accumulation_steps
        self._next_index = self.micro_batches_seen
        if self.log_trajectories_dir:
            self._open_trajectory_log(int(os.environ.get("RANK", args.process_index)))
        self.collating_training_batches = not args.eval_on_start
        self._remove_hook()
        self._hook = model.register_forward_hook(self._record_terms, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        self._global_step = state.global_step

    def on_substep_end(self, args, state, control, **kwargs):
        self._trained_one()

    def on_step_end(self, args, state, control, **kwargs):
        self._trained_one()
        # an evaluation follows (DefaultFlowCallback decided it before this callback ran): its batches draw nothing
        self.collating_training_batches = not control.should_evaluate

    def on_epoch_end(self, args, state, control, **kwargs):
        self.collating_training_batches = not control.should_evaluate  # as on_step_end: `eval_strategy="epoch"`

    def on_evaluate(self, args, state, control, **kwargs):
        self.collating_training_batches = self._hook is not None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self._window["micro_batches"] == 0:
            return
        w = self._window
        extra = {
            "ce_full": w["ce_full"] / max(w["tokens"], 1),
            "ce_short": w["ce_short"] / max(w["tokens"], 1),
            "consistency": w["consistency"] / w["micro_batches"],
            "lambda_short": self.lambdas()[0],
            "lambda_consistency": self.lambdas()[1],
        }
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)
        self._reset_window()

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hook()
        self.collating_training_batches = False

    # ---- internals -----------------------------------------------------------------------------------------------

    def _trained_one(self):
        """A training micro-batch went through forward and backward: the sampler's state moves on."""
        index = self.micro_batches_seen
        if index >= self._next_index:
            raise RuntimeError(
                f"Micro-batch {index} was trained but the collator drew only {self._next_index} trajectories: pass "
                f"the collator from `trainer_kwargs()` to the Trainer."
            )
        trajectory = self.sample_trajectory(index, self._num_loops, self._kind)
        self.sampled.append((index, trajectory))
        self.micro_batches_seen += 1
        if self.log_trajectories_dir:  # one line as each micro-batch trains, so that a killed run loses none
            with open(self._log_path, "a") as f:
                f.write(json.dumps({"micro_batch": index, "trajectory": list(trajectory)}) + "\n")

    def _open_trajectory_log(self, rank):
        """Keep the log's lines of the micro-batches the restored sampler has counted (the run's earlier segments)
        and drop the rest: those a killed run trained after its last checkpoint are trained, and logged, again, and a
        run from scratch starts an empty log. Each micro-batch is then in the log exactly once."""
        os.makedirs(self.log_trajectories_dir, exist_ok=True)
        self._log_path = os.path.join(self.log_trajectories_dir, f"shortcut_trajectories_rank{rank}.jsonl")
        kept = {}
        if os.path.exists(self._log_path):
            with open(self._log_path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:  # the last line of a run killed while writing it
                        continue
                    if record["micro_batch"] < self.micro_batches_seen:
                        kept[record["micro_batch"]] = record
        with open(self._log_path + ".tmp", "w") as f:
            f.writelines(json.dumps(kept[i]) + "\n" for i in sorted(kept))
        os.replace(self._log_path + ".tmp", self._log_path)

    def _record_terms(self, module, args, kwargs, output):
        """Add the model's objective terms of a training forward to the logging window (reads, never changes)."""
        labels = kwargs.get("labels")
        if not module.training or labels is None or getattr(output, "ce_full", None) is None:
            return
        tokens = int((labels[:, 1:] != -100).sum())
        w = self._window
        w["ce_full"] += output.ce_full.item() * tokens
        w["ce_short"] += output.ce_short.item() * tokens
        w["tokens"] += tokens
        w["consistency"] += output.consistency.item()
        w["micro_batches"] += 1

    def _remove_hook(self):
        if self._hook is not None:
            self._hook.remove()
        self._hook = None

    def _reset_window(self):
        self._window = {"ce_full": 0.0, "ce_short": 0.0, "consistency": 0.0, "tokens": 0, "micro_batches": 0}
