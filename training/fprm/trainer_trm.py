"""TRM's training step (their pretrain.py with models/recursive_reasoning/trm.py and models/losses.py), through the
same `Trainer` as FPRM's: `TRMTrainer` is `FPRMTrainer` with TRM's carry and halting.

Every Trainer step is one ACT step of the samples in flight: a halted sample's slot takes the next batch's row with
z_H = H_init and z_L = L_init; the model runs one ACT step (the gradient through its last cycle only); the loss is
FPRM's (stablemax, per-sample mean, + 0.5 × BCE(q_halt, sequence correct)); then, without gradient, each sample
halts when it has run `halt_max_steps` ACT steps or its Q-head says so (q_halt > 0, their `no_ACT_continue`), unless
exploration holds it: with probability `halt_exploration_prob` it first runs a number of steps drawn uniformly from
2..`halt_max_steps`. `n_backward` and `max_segments` (FPRM's segments) do not apply.
"""

import torch

from fprm_hf.recursion_trm import TRMState
from looped_training.fprm.trainer import FPRMTrainer


class TRMTrainer(FPRMTrainer):
    """`FPRMTrainer` for a model with `recursion="trm"` (module docstring)."""

    state_class = TRMState

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self._core(self.model).config
        if config.recursion != "trm":
            raise ValueError(
                f"TRMTrainer trains a model with recursion='trm', got recursion={config.recursion!r}: use FPRMTrainer."
            )

    def initial_state(self, core, x):
        return core.trm_initial_state(x)

    def finished(self, carry):
        return carry.state.halted

    def explore(self, q_halt_logits, steps):
        """Their exploration: the least number of ACT steps each sample runs before its Q-head may halt it (0 for
        most; uniform in 2..halt_max_steps with probability `halt_exploration_prob`). Two global-RNG draws, as
        theirs (rand, then randint)."""
        config = self._core(self.model).config
        explores = torch.rand_like(q_halt_logits) < config.halt_exploration_prob
        return explores * torch.randint_like(steps, low=2, high=config.halt_max_steps + 1)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if "labels" not in inputs:
            raise ValueError(
                f"TRMTrainer needs `labels` in every training batch (the answer token of every input token, -100 "
                f"ignored), got {sorted(inputs)}."
            )
        self._refill(model, inputs)
        carry = self.carry
        labels = carry.inputs["labels"]
        model_inputs = {k: v for k, v in carry.inputs.items() if k != "labels"}
        outputs = model(**model_inputs, max_loops=1, solver_state=carry.state)
        loss = self.segment_loss(outputs, labels)
        self.mark_signsgd_rows(model, carry, labels)
        config = self._core(model).config
        state = outputs.solver_state.detach()
        with torch.no_grad():
            halted = state.steps >= config.halt_max_steps
            if config.halt_max_steps > 1:  # their ACT halting in training
                halted = halted | (outputs.q_halt_logits > 0)
                halted = halted & (state.steps >= self.explore(outputs.q_halt_logits, state.steps))
        state.halted = halted
        carry.state = state
        carry.segments = state.steps.clone()  # its own tensor: the carry checkpoint refuses shared storage
        stats = self._segment_stats
        stats["iterations"].append(float(outputs.iterations.float().mean()))
        stats["halted"].append(float(halted.float().mean()))
        stats["segments"].append(float(state.steps.float().mean()))
        return (loss, outputs) if return_outputs else loss


__all__ = ["TRMTrainer"]
