"""ShortcutConsistencyCallback: LoopFormer's shortcut-consistency objective for the stock `Trainer`.

Per micro-batch the model runs two trajectories through the same weights (spec, "Training: shortcut consistency"):

    loss = CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)

- full: the training trajectory [1/L] * L (the Trainer's own forward);
- short: S ~ U{1..L-1} steps, each a multiple of 1/L drawn uniformly among those that leave at least 1/L for
  every remaining step, the last one filling up to 1 (`trajectory="shortcut"`, LoopFormer); or the first S of the
  L uniform steps (`trajectory="early_exit"`, the -EE baselines, whose models only know a step count);
- D: MSE on the final normed hidden states (the reference, mean-reduced) or, with `consistency="kl"`,
  KL(p_full || p_short) of the next-token distributions on the labelled positions.

How it changes the loss (a callback alone cannot): the callback's `compute_loss` is handed to the Trainer as
`compute_loss_func`, and at `on_train_begin` the callback installs two hooks on the model it is given: a forward
pre-hook that records the inputs of the Trainer's forward, and a forward hook on the final norm that records the
final normed hidden state. `compute_loss` then runs the short trajectory on the same inputs and combines the terms.
`ShortcutConsistencyCallback(...).trainer_kwargs()` returns both arguments:

    callback = ShortcutConsistencyCallback(lambda_short=0.1, lambda_consistency=0.1)
    trainer = Trainer(model=model, args=args, train_dataset=ds, **callback.trainer_kwargs())

Without the callback the Trainer trains the model as a plain looped LM (the model's own CE on the full trajectory).

The sampler is counter-based: the trajectory of the n-th training micro-batch is drawn from
`random.Random(f"{seed}:{n}")`. Every process of a data-parallel run holds the same seed and counts the same
micro-batches, so all processes run the same trajectory each step without communicating. The counter is the
sampler's state; it is saved in every checkpoint (`trainer_state.json`, `stateful_callbacks`) and restored at
`on_train_begin`, so a resumed run draws exactly the trajectories the uninterrupted one would have drawn.

CE_full, CE_short and the consistency term (per-token means over the logging window, on the main process) and the
current λ1, λ2 are added to the Trainer's logs (`state.log_history` and the progress/printer output).
"""

import json
import math
import numbers
import os
import random

import torch
import torch.nn.functional as F
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

CONSISTENCY_LOSSES = ("mse", "kl")
TRAJECTORY_KINDS = ("auto", "shortcut", "early_exit")
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")


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


def _token_ce_sum(logits, labels):
    """Sum of next-token cross-entropies over labelled positions, and their number."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:].to(logits.device)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return ce, int((labels != -100).sum())


class ShortcutConsistencyCallback(TrainerCallback, ExportableState):
    """Owns the shortcut-consistency objective (λ1, λ2, their warm-up, the seeded trajectory sampler, the
    consistency distance) and logs its three terms.

    Args:
        lambda_short (`float`, defaults to 0.1): λ1, weight of CE on the short trajectory.
        lambda_consistency (`float`, defaults to 0.1): λ2, weight of the consistency term (0 for the -EE baselines).
        warmup_steps (`int`, defaults to 0): λ1 and λ2 grow linearly from 0 over this many optimizer steps.
        consistency (`str`, defaults to `"mse"`): `"mse"` on final normed hidden states (reference) or `"kl"`
            on next-token distributions.
        trajectory (`str`, defaults to `"auto"`): `"shortcut"`, `"early_exit"`, or `"auto"` (shortcut for a model
            with `loop_conditioning="shortcut"`, early exit otherwise).
        seed (`int`, defaults to 0): seed of the trajectory sampler; the same on every process.
        log_trajectories_dir (`str`, *optional*): if set, each process writes the trajectories it ran to
            `shortcut_trajectories_rank{R}.jsonl` there at the end of training (for checking multi-process runs).
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
        self.micro_batches_seen = 0  # the sampler's state
        self.sampled = []  # trajectories this process ran, in order (this session only)
        self._model = None
        self._hooks = []
        self._captured_inputs = None
        self._captured_hidden = None
        self._in_short_forward = False
        self._global_step = 0
        self._kind = None
        self._reset_window()

    def trainer_kwargs(self):
        """`Trainer(..., **callback.trainer_kwargs())`: registers the callback and its loss."""
        return {"callbacks": [self], "compute_loss_func": self.compute_loss}

    # ---- sampler -------------------------------------------------------------------------------------------------

    def sample_trajectory(self, index, num_loops, kind):
        """The trajectory of training micro-batch `index` (a pure function of seed, index, L and kind)."""
        rng = random.Random(f"shortcut-sampler:{self.seed}:{index}")
        if kind == "shortcut":
            return sample_shortcut_trajectory(rng, num_loops)
        return sample_early_exit_trajectory(rng, num_loops)

    def lambdas(self):
        """(λ1, λ2) at the current optimizer step, after warm-up."""
        ramp = 1.0 if self.warmup_steps == 0 else min(1.0, self._global_step / self.warmup_steps)
        return self.lambda_short * ramp, self.lambda_consistency * ramp

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
        self._global_step = state.global_step
        self._remove_hooks()
        self._model = model
        norm = getattr(getattr(model, "base_model", model), "norm", None)
        if norm is None:
            raise ValueError(f"{type(model).__name__} has no final norm at `model.base_model.norm` to read h from.")
        self._hooks = [
            model.register_forward_pre_hook(self._record_inputs, with_kwargs=True),
            norm.register_forward_hook(self._record_hidden),
        ]

    def on_step_begin(self, args, state, control, **kwargs):
        self._global_step = state.global_step

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
        self._remove_hooks()
        if self.log_trajectories_dir:
            rank = int(os.environ.get("RANK", args.process_index))
            os.makedirs(self.log_trajectories_dir, exist_ok=True)
            path = os.path.join(self.log_trajectories_dir, f"shortcut_trajectories_rank{rank}.jsonl")
            with open(path, "w") as f:
                for index, trajectory in self.sampled:
                    f.write(json.dumps({"micro_batch": index, "trajectory": list(trajectory)}) + "\n")

    # ---- the loss ------------------------------------------------------------------------------------------------

    def compute_loss(self, outputs, labels, num_items_in_batch=None):
        """`compute_loss_func` for the Trainer: CE_full (+ λ1·CE_short + λ2·consistency while training)."""
        if self._model is None:
            raise ValueError(
                "ShortcutConsistencyCallback.compute_loss was called before on_train_begin: pass the callback in "
                "`callbacks` too (use `Trainer(..., **callback.trainer_kwargs())`), and keep "
                "`restore_callback_states_from_checkpoint=False` (the callback restores its sampler itself)."
            )
        if labels is None:
            raise ValueError("ShortcutConsistencyCallback needs `labels` in every batch (causal LM targets).")
        ce_full_sum, n_local = _token_ce_sum(outputs.logits, labels)  # (tensor, int)
        # The Trainer treats a compute_loss_func loss as already normalised over the whole accumulated (and, with
        # average_tokens_across_devices, all-process) batch: divide sums by num_items_in_batch, and weigh per-batch
        # means by this micro-batch's share of the tokens.
        denom = n_local if num_items_in_batch is None else num_items_in_batch
        denom = torch.as_tensor(denom, device=ce_full_sum.device, dtype=torch.float32).clamp(min=1)
        share = n_local / denom
        loss = ce_full_sum / denom
        model = self._model
        if not model.training:
            return loss

        lambda_short, lambda_consistency = self.lambdas()
        h_full = self._captured_hidden
        index = self.micro_batches_seen
        trajectory = self.sample_trajectory(index, self._num_loops, self._kind)
        self.micro_batches_seen += 1
        self.sampled.append((index, trajectory))
        short_inputs = {k: v for k, v in (self._captured_inputs or {}).items() if k in MODEL_INPUT_KEYS}
        self._in_short_forward = True
        try:
            out_short = model(**short_inputs, step_schedule=list(trajectory), use_cache=False)
        finally:
            self._in_short_forward = False
        h_short = self._captured_hidden
        ce_short_sum, _ = _token_ce_sum(out_short.logits, labels)
        if self.consistency == "mse":
            consistency = F.mse_loss(h_short.float(), h_full.detach().float())
        else:
            mask = labels[:, 1:] != -100
            log_p_short = F.log_softmax(out_short.logits[:, :-1][mask].float(), dim=-1)
            log_p_full = F.log_softmax(outputs.logits[:, :-1][mask].detach().float(), dim=-1)
            consistency = F.kl_div(log_p_short, log_p_full, log_target=True, reduction="batchmean")
        loss = loss + lambda_short * ce_short_sum / denom + lambda_consistency * consistency * share

        w = self._window
        w["ce_full"] += ce_full_sum.detach().item()
        w["ce_short"] += ce_short_sum.detach().item()
        w["tokens"] += n_local
        w["consistency"] += consistency.detach().item()
        w["micro_batches"] += 1
        return loss

    # ---- internals -----------------------------------------------------------------------------------------------

    def _record_inputs(self, module, args, kwargs):
        if not self._in_short_forward:
            self._captured_inputs = dict(kwargs)
            if args:
                self._captured_inputs["input_ids"] = args[0]

    def _record_hidden(self, module, args, output):
        self._captured_hidden = output

    def _remove_hooks(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _reset_window(self):
        self._window = {"ce_full": 0.0, "ce_short": 0.0, "consistency": 0.0, "tokens": 0, "micro_batches": 0}
