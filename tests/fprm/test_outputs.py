"""outputs_fprm.py: what an FPRM call returns. Both outputs carry the solver's fields from one declaration, behave as
transformers' `ModelOutput` (keys of the fields that are set, by name or position), and `solver_fields` hands the
solver's fields of one output to the other. Field order against a real forward: test_fprm_conventions.py."""

from dataclasses import fields

import torch

from fprm_hf.outputs_fprm import FPRMModelOutput, FPRMReasoningOutput, FPRMSolverOutputMixin, solver_fields


def test_solver_fields_pass_every_solver_field_from_one_output_to_the_other():
    state = torch.zeros(2, 3, 4)
    model_out = FPRMModelOutput(
        last_hidden_state=state,
        iterations=torch.tensor([3, 5]),
        residuals=torch.tensor([0.1, 0.01]),
        converged=torch.tensor([False, True]),
        diverged=torch.tensor([False, False]),
        hidden_states=(state, state),
    )
    passed = solver_fields(model_out)
    assert list(passed) == [f.name for f in fields(FPRMSolverOutputMixin)]
    assert passed["iterations"] is model_out.iterations and passed["residual_trace"] is None
    out = FPRMReasoningOutput(logits=torch.ones(2, 3, 7), **passed)
    assert all(getattr(out, name) is value for name, value in passed.items())
    assert out.loss is None and out.q_halt_logits is None


def test_outputs_are_model_outputs_keyed_by_the_fields_that_are_set():
    logits, iterations = torch.ones(1, 2, 3), torch.tensor([4])
    out = FPRMReasoningOutput(logits=logits, iterations=iterations, q_halt_logits=torch.zeros(1))
    assert list(out.keys()) == ["logits", "iterations", "q_halt_logits"]
    assert out["logits"] is logits and out[1] is iterations and out.to_tuple()[0] is logits
    assert FPRMModelOutput(last_hidden_state=logits).to_tuple() == (logits,)
