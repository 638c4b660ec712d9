"""ShortcutConsistencyCallback: the trajectory sampler, λ schedule and logs of LoopFormer's shortcut-consistency
objective for the stock `Trainer`.

Per micro-batch the model runs two trajectories through the same weights (spec, "Training: shortcut consistency"):

    loss = CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)

The model computes this itself: `LoopFormerForCausalLM.forward(labels=..., shortcut_consistency=ShortcutConsistency(
short_step_schedule, lambda_short, lambda_consistency, consistency_loss))` returns the combined loss and its three
terms, so both trajectories run inside the one forward the Trainer calls (under DDP, inside the wrapper). The callback
decides what that forward gets: while the Trainer trains, a forward pre-hook on the Trainer's model hands each
training forward given labels the micro-batch's `ShortcutConsistency` (a frozen value; the model reads it and calls
nothing back), and a forward hook reads the three terms off the output for the logs:

- full: the training trajectory [1/L] * L (the model's default);
- short: S ~ U{1..L-1} steps, each a multiple of 1/L drawn uniformly among those that leave at least 1/L for
  every remaining step, the last one filling up to 1 (`trajectory="shortcut"`, LoopFormer); or the first S of the
  L uniform steps (`trajectory="early_exit"`, the -EE baselines, whose models only know a step count);
- D: MSE on the final normed hidden states (the reference, mean-reduced) or, with `consistency="kl"`,
  KL(p_full || p_short) of the next-token distributions on the labelled positions;
- λ1, λ2: grow linearly from 0 over `warmup_steps` optimizer steps.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ShortcutConsistencyCallback(lambda_short=0.1, lambda_consistency=0.1)])

Without the callback the Trainer trains the model as a plain looped LM (the model's own CE on the full trajectory).

The sampler is counter-based: the trajectory of the n-th training micro-batch is drawn from
`random.Random(f"shortcut-sampler:{seed}:{n}")`. Every process of a data-parallel run holds the same seed and runs
the same number of training forwards, so all processes run the same trajectory each step without communicating. The
count of training forwards is the sampler's whole state; it is saved in every checkpoint (`trainer_state.json`,
`stateful_callbacks`) and restored at `on_train_begin`, so a resumed run draws exactly the trajectories the
uninterrupted one would have drawn. An evaluation forward (the model in eval mode) draws none. The model computes
the objective from the labels, so a Trainer that takes them to compute its own loss (`label_smoothing_factor`) is
refused.

CE_full, CE_short and the consistency term (per-token means over the logging window, on the main process) and the
current λ1, λ2 are added to the Trainer's logs (`state.log_history` and the progress/printer output).
"""

import inspect
import json
import os
import random

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from loopformer_hf.loss_loopformer import CONSISTENCY_LOSSES, ShortcutConsistency, check_lambdas

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


def _objective_host(model):
    """The module of `model` (itself, or the causal LM inside a PEFT or other wrapper) whose forward computes the
    objective from a `shortcut_consistency` argument, or None."""
    return next(
        (m for m in model.modules() if "shortcut_consistency" in inspect.signature(type(m).forward).parameters), None
    )


def _labelled_tokens(kwargs):
    """Labelled next-token positions of a forward's `labels` (shifted by one) or `shift_labels` (as given)."""
    if kwargs.get("shift_labels") is not None:
        return int((kwargs["shift_labels"] != -100).sum())
    return int((kwargs["labels"][:, 1:] != -100).sum())


class ShortcutConsistencyCallback(TrainerCallback, ExportableState):
    """Decides the per-batch inputs of the shortcut-consistency objective that the model computes (λ1, λ2 and their
    warm-up, the seeded trajectory sampler, the consistency distance) and logs its three terms.

    `Trainer(..., callbacks=[ShortcutConsistencyCallback(), ...])`: nothing else to pass. While training, each
    training forward of the Trainer's model with labels and no `shortcut_consistency` of its own is given
    `next_shortcut_consistency()`, and its terms are added to the logs.

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

    def __init__(
        self,
        lambda_short=0.1,
        lambda_consistency=0.1,
        warmup_steps=0,
        consistency="mse",
        trajectory="auto",
        seed=0,
        log_trajectories_dir=None,
    ):
        check_lambdas(lambda_short, lambda_consistency)
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
        self.micro_batches_seen = 0  # the sampler's state: training forwards so far
        self.sampled = []  # (index, trajectory) this process trained, in order (this session only)
        self._hooks = ()  # the forward hooks on the Trainer's model while training
        self._global_step = 0
        self._accumulation = 1
        self._kind = None
        self._num_loops = None
        self._reset_window()

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

    def next_shortcut_consistency(self):
        """The `ShortcutConsistency` of the next training micro-batch; drawn once per training forward, in training
        order, so the count is the sampler's state."""
        index = self.micro_batches_seen
        self.micro_batches_seen += 1
        trajectory = self.sample_trajectory(index, self._num_loops, self._kind)
        self.sampled.append((index, trajectory))
        if self.log_trajectories_dir:  # one line as each micro-batch trains, so that a killed run loses none
            with open(self._log_path, "a") as f:
                f.write(json.dumps({"micro_batch": index, "trajectory": list(trajectory)}) + "\n")
        # a micro-batch belongs to optimizer step index // gradient_accumulation_steps (exact unless an epoch ends
        # with a shorter accumulation step)
        lambda_short, lambda_consistency = self.lambdas(index // self._accumulation)
        return ShortcutConsistency(trajectory, lambda_short, lambda_consistency, self.consistency)

    def record_terms(self, ce_full, ce_short, consistency, tokens):
        """Add a training forward's detached terms (per-token CE means over its `tokens` labelled tokens, and D) to
        the logging window."""
        w = self._window
        w["ce_full"] += float(ce_full) * tokens
        w["ce_short"] += float(ce_short) * tokens
        w["tokens"] += tokens
        w["consistency"] += float(consistency)
        w["micro_batches"] += 1

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
        host = None if model is None else _objective_host(model)
        if host is None:
            raise ValueError(
                f"ShortcutConsistencyCallback trains a LoopFormerForCausalLM (whose forward computes the objective); "
                f"the Trainer's model is {type(model).__name__}."
            )
        self._kind, self._num_loops = self._trajectory_kind(host.config)
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(saved, dict):  # resuming: continue the sampler where the checkpoint left it
            saved_args = saved.get("args", {})
            if saved_args.get("seed", self.seed) != self.seed:
                raise ValueError(
                    f"The checkpoint's shortcut sampler used seed {saved_args.get('seed')!r}, this run gives seed "
                    f"{self.seed!r}: resuming would not reproduce the run. Use the checkpoint's seed."
                )
            self.micro_batches_seen = int(saved.get("attributes", {}).get("micro_batches_seen", 0))
        if args.label_smoothing_factor:
            raise ValueError(
                f"ShortcutConsistencyCallback's objective is computed by the model from the labels, but with "
                f"label_smoothing_factor={args.label_smoothing_factor} the Trainer takes them and computes a plain "
                f"loss itself: use label_smoothing_factor=0."
            )
        self._global_step = state.global_step
        self._accumulation = args.gradient_accumulation_steps
        if self.log_trajectories_dir:
            self._open_trajectory_log(int(os.environ.get("RANK", args.process_index)))
        self._detach()
        self._hooks = (
            model.register_forward_pre_hook(self._give, with_kwargs=True),
            model.register_forward_hook(self._read_terms, with_kwargs=True),
        )

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
        self._detach()

    # ---- internals -----------------------------------------------------------------------------------------------

    def _trajectory_kind(self, config):
        """("shortcut" or "early_exit", L) for a model of `config`, or ValueError for one this objective cannot train."""
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
        return kind, num_loops

    def _give(self, module, args, kwargs):
        """Forward pre-hook: a training forward with labels gets the micro-batch's objective (evaluation, a forward
        without labels, or one given its own, draws nothing)."""
        if module.training and kwargs.get("labels") is not None and kwargs.get("shortcut_consistency") is None:
            return args, {**kwargs, "shortcut_consistency": self.next_shortcut_consistency()}
        return None

    def _read_terms(self, module, args, kwargs, output):
        """Forward hook: add a training forward's detached terms to the logging window."""
        if module.training and getattr(output, "ce_full", None) is not None:
            self.record_terms(output.ce_full, output.ce_short, output.consistency, _labelled_tokens(kwargs))

    def _detach(self):
        """Stop feeding the model: later forwards (after training, or of another Trainer) draw nothing."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = ()

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

    def _reset_window(self):
        self._window = {"ce_full": 0.0, "ce_short": 0.0, "consistency": 0.0, "tokens": 0, "micro_batches": 0}
