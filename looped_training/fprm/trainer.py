"""FPRM training through `transformers.Trainer`: truncated BPTT with deep supervision, as the paper (TRM style).

Every Trainer step is one *segment*: `n_backward` solver iterations with gradient, starting from the state the
previous segment left (detached), then one loss and one optimizer step. A sample stays in the batch ("carry") for
up to `max_segments` segments or until it halts (the authors': after a segment, residual < τ or η < min_eta;
`segment_halting`); its slot is then refilled from the next batch of the data loader. So the number of loops a sample sees grows with `max_segments` while the autograd graph, hence peak
memory, only ever spans `n_backward` iterations (the truncated Neumann series of (I − J)⁻¹ of the paper).

`n_backward = max_segments × n_backward` loops in one segment (`max_segments=1`) is full BPTT, for contrast.

The carry is part of a checkpoint (`fprm_carry.safetensors`, one per process), so a resumed run goes on with the
samples that were in flight and trains exactly as the uninterrupted one would.
"""

import logging
import os
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from fprm_hf import FPRMSolverState

logger = logging.getLogger(__name__)


LOSS_TYPES = ("softmax", "stablemax")
SEGMENT_HALTINGS = ("after_segment", "per_iteration")


@dataclass
class FPRMTrainingArguments(TrainingArguments):
    n_backward: int = field(
        default=4, metadata={"help": "Solver iterations with gradient per segment (6 Sudoku/maze, 4 state tracking)."}
    )
    max_segments: int = field(
        default=16,
        metadata={"help": "Segments before a sample is replaced (12 Sudoku, 24 maze, 128 state tracking)."},
    )
    train_halt_eps: float | None = field(
        default=None, metadata={"help": "halt_eps in training (default: the config's)."}
    )
    loss_type: str = field(
        default="softmax", metadata={"help": f"Cross-entropy over {LOSS_TYPES}; the reference uses stablemax."}
    )
    segment_halting: str = field(
        default="after_segment",
        metadata={"help": "after_segment (the authors'): every segment runs its n_backward iterations, then a sample "
                          "halts when its residual < train_halt_eps or η < min_eta; per_iteration (earlier versions): "
                          "the solver freezes a sample inside the segment as soon as it halts."},
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("n_backward", "max_segments"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
        if self.segment_halting not in SEGMENT_HALTINGS:
            raise ValueError(f"`segment_halting` must be one of {SEGMENT_HALTINGS}, got {self.segment_halting!r}.")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"`loss_type` must be one of {LOSS_TYPES}, got {self.loss_type!r}.")
        if self.train_halt_eps is not None and not self.train_halt_eps > 0:
            raise ValueError(f"`train_halt_eps` must be a positive number or None, got {self.train_halt_eps!r}.")
        if self.label_smoothing_factor:
            # Trainer applies it only in its own compute_loss; FPRMTrainer's segment loss would train without it
            raise ValueError(f"`label_smoothing_factor` is not applied by FPRMTrainer, whose segment loss is its own "
                             f"(`loss_type` one of {LOSS_TYPES}); got {self.label_smoothing_factor!r}: use 0.")


def stablemax_cross_entropy(logits, labels, ignore_index=-100):
    """Cross-entropy with s(x) = x + 1 (x ≥ 0), 1 / (1 − x) (x < 0) in place of exp (TRM's stablemax)."""
    logits = logits.double()
    s = torch.where(logits >= 0, logits + 1, 1 / (1 - logits))
    logprobs = torch.log(s / s.sum(-1, keepdim=True))
    valid = labels != ignore_index
    picked = torch.gather(logprobs, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * valid).sum().float() / valid.sum().clamp(min=1)


def token_loss(logits, labels, loss_type):
    if loss_type == "stablemax":
        return stablemax_cross_entropy(logits, labels)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


@dataclass
class Carry:
    """The samples in flight: their inputs, labels, solver state and segments done."""

    inputs: dict
    state: object
    segments: torch.Tensor

    def done(self, max_segments):
        return self.state.halted | (self.segments >= max_segments)

    def tensors(self):
        """The carry as named tensors, for a checkpoint."""
        named = {f"inputs.{k}": v for k, v in self.inputs.items()}
        named.update({f"state.{f.name}": getattr(self.state, f.name) for f in fields(self.state)})
        named["segments"] = self.segments
        return {k: v.detach().contiguous() for k, v in named.items()}

    @classmethod
    def from_tensors(cls, named):
        def part(prefix):
            return {k[len(prefix):]: v for k, v in named.items() if k.startswith(prefix)}

        return cls(part("inputs."), FPRMSolverState(**part("state.")), named["segments"])


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


class FPRMTrainer(Trainer):
    """`Trainer` whose training step is one deep-supervision segment of truncated BPTT (module docstring).

    Evaluation (`model.eval()`) runs the ordinary forward: the full solver with `gamma_eval`, on every sample
    (`dataloader_drop_last` applies to training only). α parameters are kept out of weight decay (they are logits of
    scales in (0, 1), not weights).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, FPRMTrainingArguments):
            raise ValueError(f"FPRMTrainer needs FPRMTrainingArguments, got {type(self.args).__name__}.")
        if self.compute_loss_func is not None:
            # Trainer would also stop dividing the loss by gradient_accumulation_steps, expecting the function to
            raise ValueError(
                f"`compute_loss_func` is not applied by FPRMTrainer, whose loss is computed on the samples in flight "
                f"(the carry), not on the batch; got "
                f"{getattr(self.compute_loss_func, '__name__', type(self.compute_loss_func).__name__)}. Pass None "
                f"and choose the loss with `loss_type` {LOSS_TYPES} of FPRMTrainingArguments."
            )
        self.carry = None
        self._segment_stats = {"iterations": [], "halted": [], "segments": []}
        self.add_callback(CarryCheckpointCallback(self))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, which also restores the carry of the checkpoint it resumes from."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, (str, os.PathLike)):
            path = os.path.join(checkpoint, carry_file(self.args))
            if os.path.exists(path):
                self.carry = Carry.from_tensors(load_file(path, device=str(self.args.device)))
            else:
                logger.warning("%s has no %s: the samples in flight at that step start afresh.", checkpoint,
                               carry_file(self.args))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_eval_dataloader(self, eval_dataset=None):
        """Trainer's, without `dataloader_drop_last`: training needs it (the carry keeps one batch shape), but an
        evaluation must see every sample."""
        return self._without_drop_last(super().get_eval_dataloader, eval_dataset)

    def get_test_dataloader(self, test_dataset):
        return self._without_drop_last(super().get_test_dataloader, test_dataset)

    def _without_drop_last(self, make, dataset):
        drop_last = self.args.dataloader_drop_last
        self.args.dataloader_drop_last = False
        try:
            return make(dataset)
        finally:
            self.args.dataloader_drop_last = drop_last

    def get_decay_parameter_names(self, model):
        return [n for n in super().get_decay_parameter_names(model) if "alpha" not in n]

    def _core(self, model):
        return self.accelerator.unwrap_model(model).model

    def _refill(self, model, inputs):
        """Replace finished samples of the carry with the rows of the new batch in the same slots."""
        core = self._core(model)
        fresh_inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "labels", "puzzle_identifiers")}
        with torch.no_grad():
            x = core.embed(fresh_inputs["input_ids"], fresh_inputs.get("puzzle_identifiers"))
            fresh_state = core.initial_solver_state(x)
        segments = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        carry = self.carry
        if carry is None or carry.state.hidden.shape != fresh_state.hidden.shape:
            self.carry = Carry(fresh_inputs, fresh_state, segments)
            return
        replace = carry.done(self.args.max_segments)
        mixed = {}
        for k, v in fresh_inputs.items():
            mask = replace.view(-1, *([1] * (v.dim() - 1)))
            mixed[k] = torch.where(mask, v, carry.inputs[k])
        segments = torch.where(replace, segments, carry.segments)
        self.carry = Carry(mixed, carry.state.where(replace, fresh_state), segments)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss
        if "labels" not in inputs:
            raise ValueError(f"FPRMTrainer needs `labels` in every training batch (the answer token of every input "
                             f"token, -100 ignored), got {sorted(inputs)}.")
        self._refill(model, inputs)
        carry = self.carry
        labels = carry.inputs["labels"]
        model_inputs = {k: v for k, v in carry.inputs.items() if k != "labels"}
        after_segment = self.args.segment_halting == "after_segment"
        outputs = model(
            **model_inputs,
            max_loops=self.args.n_backward,
            halt_eps=self.args.train_halt_eps,
            halting=not after_segment,
            solver_state=carry.state,
        )
        loss = token_loss(outputs.logits, labels, self.args.loss_type)
        # the state goes on to the next segment without its graph: memory spans n_backward iterations only
        state = outputs.solver_state.detach()
        if after_segment:  # the authors' training halting: per sample, on the segment's last iteration
            config = self._core(model).config
            tau = config.halt_eps if self.args.train_halt_eps is None else self.args.train_halt_eps
            converged = state.residuals < tau
            state = replace(state, converged=converged,
                            halted=state.halted | converged | (state.eta < config.min_eta))
        carry.state = state
        carry.segments = carry.segments + 1
        stats = self._segment_stats
        stats["iterations"].append(float(outputs.iterations.float().mean()))
        stats["halted"].append(float(carry.state.halted.float().mean()))
        stats["segments"].append(float(carry.segments.float().mean()))
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        for key, values in self._segment_stats.items():
            if values and "loss" in logs:
                logs[f"segment_{key}"] = round(sum(values) / len(values), 4)
                values.clear()
        super().log(logs, *args, **kwargs)


__all__ = ["FPRMTrainer", "FPRMTrainingArguments", "stablemax_cross_entropy", "token_loss", "SEGMENT_HALTINGS"]
