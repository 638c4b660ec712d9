"""FPRM training through `transformers.Trainer`: truncated BPTT with deep supervision, as the paper (TRM style).

Every Trainer step is one *segment*: `n_backward` solver iterations with gradient, starting from the state the
previous segment left (detached), then one loss and one optimizer step. A sample stays in the batch ("carry") for
up to `max_segments` segments or until it halts (the authors': every segment runs its `n_backward` iterations,
then the model's halting rule, `SolverSettings.halts`, judges the sample: residual < τ or η < min_eta); its slot
is then refilled from the next batch of the data loader. So the number of loops a sample sees grows with
`max_segments` while the autograd graph, hence peak memory, only ever spans `n_backward` iterations (the truncated Neumann series of (I − J)⁻¹ of the paper).

`n_backward = max_segments × n_backward` loops in one segment (`max_segments=1`) is full BPTT, for contrast.

The carry is part of a checkpoint (`fprm_carry.safetensors`, one per process), so a resumed run goes on with the
samples that were in flight and trains exactly as the uninterrupted one would.
"""

import logging
import os
from dataclasses import dataclass, fields, replace

import torch
from safetensors.torch import load_file
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from fprm_hf import FPRMSolverState, SolverSettings
from looped_training.fprm.arguments import LOSS_TYPES, FPRMTrainingArguments
from looped_training.fprm.callbacks import CarryCheckpointCallback, EMACallback, carry_file, ema_file
from looped_training.fprm.losses import q_halt_loss, token_loss
from looped_training.fprm.optimizer import SignSGDAdamW

logger = logging.getLogger(__name__)


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
        named.update(
            {
                f"state.{f.name}": getattr(self.state, f.name)
                for f in fields(self.state)
                if getattr(self.state, f.name) is not None
            }
        )
        named["segments"] = self.segments
        return {k: v.detach().contiguous() for k, v in named.items()}

    @classmethod
    def from_tensors(cls, named, state_class=FPRMSolverState):
        def part(prefix):
            return {k[len(prefix) :]: v for k, v in named.items() if k.startswith(prefix)}

        return cls(part("inputs."), state_class(**part("state.")), named["segments"])


class FPRMTrainer(Trainer):
    """`Trainer` whose training step is one deep-supervision segment of truncated BPTT (module docstring).

    Evaluation (`model.eval()`) runs the ordinary forward: the full solver with `gamma_eval`, on every sample
    (`dataloader_drop_last` applies to training only). α parameters are kept out of weight decay (they are logits of
    scales in (0, 1), not weights).
    """

    state_class = FPRMSolverState  # the carry's state (read back from a checkpoint as this class)

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
        self.ema = None  # the EMA shadow (name -> tensor) with `ema_decay`
        self._segment_stats = {"iterations": [], "halted": [], "segments": []}
        self.add_callback(CarryCheckpointCallback(self))
        core = self._core(self.model)
        if self.args.q_loss_coefficient and getattr(self.accelerator.unwrap_model(self.model), "q_head", None) is None:
            raise ValueError(
                f"`q_loss_coefficient={self.args.q_loss_coefficient}` needs a model with a Q-head "
                f"(FPRMConfig(use_q_head=True)); this one has none. Use 0 or None."
            )
        if self.args.puzzle_emb_optimizer == "signsgd" and core.prefix is None:
            raise ValueError(
                "`puzzle_emb_optimizer='signsgd'` trains the prefix rows, and this model has none "
                "(num_prefix_tokens=0): use 'adamw'."
            )
        if self.args.ema_decay is not None:
            self.add_callback(EMACallback(self))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, which also restores the carry (and the EMA shadow) of the checkpoint it resumes from."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, (str, os.PathLike)):
            path = os.path.join(checkpoint, carry_file(self.args))
            if os.path.exists(path):
                self.carry = Carry.from_tensors(load_file(path, device=str(self.args.device)), self.state_class)
            else:
                logger.warning(
                    "%s has no %s: the samples in flight at that step start afresh.", checkpoint, carry_file(self.args)
                )
            path = os.path.join(checkpoint, ema_file(self.args))
            if self.args.ema_decay is not None:
                if not os.path.exists(path):
                    raise ValueError(
                        f"--ema_decay {self.args.ema_decay} resumes from {checkpoint}, which has no "
                        f"{ema_file(self.args)} (it was written without EMA): resume without "
                        f"--ema_decay, or from a checkpoint of an EMA run."
                    )
                self.ema = load_file(path, device=str(self.args.device))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ---- the authors' recipe: schedule, optimizer, EMA -----------------------------------------------------------

    def create_scheduler(self, num_training_steps, optimizer=None):
        """`lr_schedule="authors"`: their pretrain.py's lr·(s+1)/W over the W warm-up steps (`--warmup_steps`, or
        `--warmup_ratio` of the steps), constant after (their lr_min_ratio 1.0). Otherwise Trainer's."""
        if self.args.lr_schedule != "authors" or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        warmup = self.args.get_warmup_steps(num_training_steps)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer if optimizer is None else optimizer,
            lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0,
        )
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def create_optimizer(self, model=None):
        """Trainer's AdamW, and with `puzzle_emb_optimizer="signsgd"` the prefix rows in their own SignSGD group
        (`SignSGDAdamW`) at `puzzle_emb_lr` / `puzzle_emb_weight_decay`."""
        if self.args.puzzle_emb_optimizer != "signsgd" or self.optimizer is not None:
            return super().create_optimizer(model)
        if str(getattr(self.args.optim, "value", self.args.optim)) not in ("adamw_torch", "adamw_torch_fused"):
            raise ValueError(
                f"`puzzle_emb_optimizer='signsgd'` goes with the authors' AdamW (--optim adamw_torch), "
                f"got --optim {self.args.optim!r}."
            )
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        prefix = self._core(opt_model).prefix
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad and p is not prefix]
        args = self.args
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            {
                "params": [prefix],
                "signsgd": True,
                "lr": args.learning_rate if args.puzzle_emb_lr is None else args.puzzle_emb_lr,
                "weight_decay": (
                    args.weight_decay if args.puzzle_emb_weight_decay is None else args.puzzle_emb_weight_decay
                ),
            },
        ]
        self.optimizer = SignSGDAdamW(
            groups,
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
        )
        return self.optimizer

    def ema_parameters(self):
        """The (name, parameter) pairs the EMA averages: every trained parameter (not SignSGD's prefix rows)."""
        model = self.accelerator.unwrap_model(self.model)
        prefix = model.model.prefix if self.args.puzzle_emb_optimizer == "signsgd" else None
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad and p is not prefix]

    def swap_ema(self):
        """Exchange the model's weights with the EMA shadow (call twice to swap back); no-op without EMA."""
        if self.ema is None:
            return
        with torch.no_grad():
            for name, p in self.ema_parameters():
                shadow = self.ema[name]
                tmp = p.detach().clone()
                p.copy_(shadow)
                shadow.copy_(tmp)

    def evaluate(self, *args, **kwargs):
        """Trainer's evaluation, on the EMA weights when `ema_decay` is set (as the authors evaluate)."""
        self.swap_ema()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.swap_ema()

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
        """The authors' groups: every parameter decays (biases and the Q-head included) except the α logits of the
        input-independent residual scaling (their `_no_weight_decay` tag)."""
        return [n for n, p in model.named_parameters() if not n.endswith("_logit")]

    def _core(self, model):
        return self.accelerator.unwrap_model(model).model

    def initial_state(self, core, x):
        """A fresh sample's state: z0 and the solver's start (`FPRMModel.initial_solver_state`)."""
        return core.initial_solver_state(x)

    def finished(self, carry):
        """The samples of the carry whose slots take new data: halted, or at `max_segments`."""
        return carry.done(self.args.max_segments)

    def _refill(self, model, inputs):
        """Replace finished samples of the carry with the rows of the new batch in the same slots."""
        core = self._core(model)
        fresh_inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "labels", "puzzle_identifiers")}
        with torch.no_grad():
            x = core.embed(fresh_inputs["input_ids"], fresh_inputs.get("puzzle_identifiers"))
            fresh_state = self.initial_state(core, x)
        segments = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        carry = self.carry
        if carry is None or carry.state.hidden.shape != fresh_state.hidden.shape:
            self.carry = Carry(fresh_inputs, fresh_state, segments)
            return
        replace = self.finished(carry)
        mixed = {}
        for k, v in fresh_inputs.items():
            mask = replace.view(-1, *([1] * (v.dim() - 1)))
            mixed[k] = torch.where(mask, v, carry.inputs[k])
        segments = torch.where(replace, segments, carry.segments)
        self.carry = Carry(mixed, carry.state.where(replace, fresh_state), segments)

    def segment_loss(self, outputs, labels):
        """The loss of one segment: the token loss (`loss_type`, `loss_normalization`) + their Q-halt loss when the
        model has a Q-head (`q_loss_coefficient`, default 0.5)."""
        loss = token_loss(outputs.logits, labels, self.args.loss_type, self.args.loss_normalization)
        q_coefficient = self.args.q_loss_coefficient
        if outputs.q_halt_logits is not None:
            q_coefficient = 0.5 if q_coefficient is None else q_coefficient
            if q_coefficient:
                loss = loss + q_coefficient * q_halt_loss(outputs.q_halt_logits, outputs.logits, labels)
        return loss

    def mark_signsgd_rows(self, model, carry, labels):
        """Tells `SignSGDAdamW` which prefix rows this segment trains: those of the samples in flight."""
        prefix = self._core(model).prefix
        if prefix is not None:
            ids = carry.inputs.get("puzzle_identifiers")
            prefix.signsgd_rows = (
                torch.zeros(1, dtype=torch.long, device=labels.device) if ids is None else ids.unique()
            )
            if self.args.world_size > 1:  # theirs: the rows of every rank's batch, i.e. those the reduced
                prefix.signsgd_rows = None  # gradient reaches (the same on every rank)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss
        if "labels" not in inputs:
            raise ValueError(
                f"FPRMTrainer needs `labels` in every training batch (the answer token of every input "
                f"token, -100 ignored), got {sorted(inputs)}."
            )
        self._refill(model, inputs)
        carry = self.carry
        labels = carry.inputs["labels"]
        model_inputs = {k: v for k, v in carry.inputs.items() if k != "labels"}
        # every segment runs its n_backward iterations; the halting rule judges each sample after it (below)
        outputs = model(
            **model_inputs,
            max_loops=self.args.n_backward,
            halt_eps=self.args.train_halt_eps,
            halting=False,
            solver_state=carry.state,
        )
        loss = self.segment_loss(outputs, labels)
        self.mark_signsgd_rows(model, carry, labels)
        # the state goes on to the next segment without its graph: memory spans n_backward iterations only
        state = outputs.solver_state.detach()
        settings = SolverSettings.from_config(
            self._core(model).config, training=True, halt_eps=self.args.train_halt_eps
        )
        converged, stops = settings.halts(state.residuals, state.eta)
        carry.state = replace(state, converged=converged, halted=state.halted | stops)
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


__all__ = ["Carry", "FPRMTrainer"]
