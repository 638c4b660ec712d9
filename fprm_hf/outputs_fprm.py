"""What an FPRM call returns: `FPRMModelOutput` (the final state) and `FPRMReasoningOutput` (the head's logits), each
with the solver's fields, declared once in `FPRMSolverOutputMixin`.

A dataclass lists its fields base by base, from the last class of its MRO to the first, then its own. Each output
therefore names the mixin first and the `ModelOutput` that holds its leading fields second: its fields (and
`to_tuple()`) read leading fields, the solver's fields, then its own.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

from dataclasses import dataclass, fields

import torch
from transformers.modeling_outputs import ModelOutput

from .solver_fprm import FPRMSolverState


@dataclass
class FPRMSolverOutputMixin:
    """
    The solver's fields of both outputs, in this order:

    iterations: (batch,) iterations of f this call applied to each sample.
    residuals: (batch,) final relative ∞-norm residual per sample (inf where it was not finite).
    converged: (batch,) True where the residual fell below `halt_eps`.
    diverged: (batch,) True where a non-finite residual stopped the sample (its last finite state is kept).
    residual_trace: (batch, iterations run) residual after each iteration (with `output_residual_trace=True`);
        a halted row repeats its final residual.
    solver_state: the `FPRMSolverState` to continue from (pass it back as `solver_state=`).
    hidden_states: with `output_hidden_states=True`, the solver's iterates (y_0, y_1, ..., y_K) as a tuple of
        (batch, prefix + tokens, hidden) tensors: y_0 the state the call starts from (z0, or the given
        `solver_state`), y_k the state after iteration k, K the most iterations any sample ran in this call. A
        sample that halted before K repeats its final state. The entries are the raw iterates (no final norm).
    """

    iterations: torch.LongTensor | None = None
    residuals: torch.FloatTensor | None = None
    converged: torch.BoolTensor | None = None
    diverged: torch.BoolTensor | None = None
    residual_trace: torch.FloatTensor | None = None
    solver_state: FPRMSolverState | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


def solver_fields(output):
    """{name: value} of the solver's fields of `output` (an `FPRMModelOutput`), to pass on to another output."""
    return {field.name: getattr(output, field.name) for field in fields(FPRMSolverOutputMixin)}


@dataclass
class _FinalStateOutput(ModelOutput):
    last_hidden_state: torch.FloatTensor | None = None


@dataclass
class FPRMModelOutput(FPRMSolverOutputMixin, _FinalStateOutput):
    """
    last_hidden_state: the final state y, prefix tokens included.
    Then the solver's fields ([`FPRMSolverOutputMixin`]): iterations, residuals, converged, diverged, residual_trace,
    solver_state, hidden_states.
    """


@dataclass
class _PredictionOutput(ModelOutput):
    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None


@dataclass
class FPRMReasoningOutput(FPRMSolverOutputMixin, _PredictionOutput):
    """
    loss: cross-entropy of `logits` against `labels` (-100 ignored), when labels are given.
    logits: (batch, input tokens, vocab_size) prediction for every input token (prefix tokens dropped).
    Then the solver's fields ([`FPRMSolverOutputMixin`]): iterations, residuals, converged, diverged, residual_trace,
    solver_state, hidden_states.
    q_halt_logits: (batch,) float32, with `use_q_head=True`: the Q-head's halting logit, read from the first row of
        the final state (their `q_head(y[:, 0])[..., 0]`).
    """

    q_halt_logits: torch.FloatTensor | None = None


__all__ = ["FPRMSolverOutputMixin", "FPRMModelOutput", "FPRMReasoningOutput", "solver_fields"]
