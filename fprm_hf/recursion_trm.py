"""TRM's recursion (Tiny Recursive Model, the FPRM paper's baseline; their models/recursive_reasoning/trm.py), for
`FPRMConfig(recursion="trm")`: the same block stack f as FPRM (`FPRMModel.fixed_point_map`), looped over two states
instead of solved to a fixed point.

One ACT step, from (z_H, z_L):

    H_cycles − 1 cycles without gradient, each:  L_cycles × (z_L ← f(z_L, z_H + x)),  then z_H ← f(z_H, z_L)
    1 cycle with gradient:                       n_backwards_L × (z_L ← f(z_L, z_H + x)), then z_H ← f(z_H, z_L)

where f(y, injection) re-injects `injection` in place of x. The logits and the Q-head read z_H; the carry between ACT
steps is detached. z_H and z_L start from the stored vectors `H_init` and `L_init` on every token. Evaluation runs
`halt_max_steps` ACT steps for every sample (theirs: "always use max steps"); in training the trainer runs one ACT
step per optimizer step and halts by the Q-head (looped_training/fprm/trainer_trm.py).

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

from dataclasses import dataclass

import torch

from .solver_fprm import RESIDUAL_DENOM_EPS, FPRMSolverState


@dataclass
class TRMState:
    """What TRM carries between ACT steps: z_H (`hidden`, what the head reads), z_L and, per sample, the ACT steps
    and block-stack applications so far, the relative change of z_H over the last ACT step and the halting flags
    (`halted` is set by the trainer's Q-head rule; a forward leaves it as given)."""

    hidden: torch.Tensor  # z_H (batch, tokens, hidden)
    z_L: torch.Tensor  # (batch, tokens, hidden)
    steps: torch.Tensor  # (batch,) ACT steps so far
    iterations: torch.Tensor  # (batch,) applications of the block stack f so far
    residuals: torch.Tensor  # (batch,) max over tokens of ‖Δz_H‖∞ / ‖z_H‖∞ over the last ACT step (inf before one)
    halted: torch.Tensor  # (batch,) bool
    converged: torch.Tensor  # (batch,) bool: residual < halt_eps (a diagnostic; TRM does not halt on it)
    diverged: torch.Tensor  # (batch,) bool: a non-finite z_H
    fingerprint: torch.Tensor | None = None  # as FPRMSolverState's

    @classmethod
    def start(cls, z_H, z_L):
        def full(value, dtype):
            return torch.full((z_H.shape[0],), value, dtype=dtype, device=z_H.device)

        return cls(
            hidden=z_H,
            z_L=z_L,
            steps=full(0, torch.long),
            iterations=full(0, torch.long),
            residuals=full(float("inf"), torch.float32),
            halted=full(False, torch.bool),
            converged=full(False, torch.bool),
            diverged=full(False, torch.bool),
        )

    def detach(self):
        return TRMState(**{**self.__dict__, "hidden": self.hidden.detach(), "z_L": self.z_L.detach()})

    # row-wise merge and selection, field by field (the trainer refills halted rows), as the solver's state
    where = FPRMSolverState.where
    select = FPRMSolverState.select


def applications_per_step(config):
    """Applications of the block stack f in one ACT step: (H_cycles − 1)·(L_cycles + 1) + n_backwards_L + 1."""
    return (config.H_cycles - 1) * (config.L_cycles + 1) + config.n_backwards_L + 1


def act_step(f, x, z_H, z_L, config):
    """One ACT step of their inner forward (module docstring): the new (z_H, z_L), with gradient through the last
    cycle only."""
    with torch.no_grad():
        for _ in range(config.H_cycles - 1):
            for _ in range(config.L_cycles):
                z_L = f(z_L, z_H + x)
            z_H = f(z_H, z_L)
    for _ in range(config.n_backwards_L):
        z_L = f(z_L, z_H + x)
    return f(z_H, z_L), z_L


def check_trm_state(state, x, fingerprint):
    """A `solver_state` given to a TRM forward must be a previous TRM call's on these inputs."""
    if not isinstance(state, TRMState) or not torch.is_tensor(state.hidden) or state.hidden.shape != x.shape:
        raise ValueError(
            f"`solver_state` of a TRM model (recursion='trm') must be the TRMState of a previous call on inputs of "
            f"this shape (state {tuple(x.shape)}), got {type(state).__name__} "
            f"{tuple(getattr(getattr(state, 'hidden', None), 'shape', ()))}."
        )
    if state.fingerprint is not None and not torch.equal(state.fingerprint, fingerprint):
        rows = (state.fingerprint != fingerprint).nonzero().flatten().tolist()
        raise ValueError(
            f"`solver_state` was computed on other inputs than these (rows {rows} differ). Pass the inputs it was "
            f"computed on, or no `solver_state` to start from H_init and L_init."
        )


def recurse(f, x, state, config, act_steps, halt_eps, output_residual_trace=False, output_hidden_states=False):
    """Runs `act_steps` ACT steps from `state` (a `TRMState`); `f(y, injection)` is the block stack. Returns the new
    state, the block-stack applications this call ran per sample, the residual trace (one entry per ACT step) and the
    z_H after each ACT step (with `output_hidden_states`, z_H at the start first), else None. Between ACT steps the
    carry is detached, as theirs: the gradient reaches the last ACT step's last cycle only."""
    z_H, z_L = state.hidden, state.z_L
    trace, iterates = [], [z_H] if output_hidden_states else None
    residuals = state.residuals
    for k in range(act_steps):
        if k:
            z_H, z_L = z_H.detach(), z_L.detach()
        previous = z_H
        z_H, z_L = act_step(f, x, z_H, z_L, config)
        with torch.no_grad():
            change = (z_H - previous).abs().amax(-1).float()
            residuals = (change / (z_H.abs().amax(-1).float() + RESIDUAL_DENOM_EPS)).amax(-1)
            residuals = torch.where(torch.isfinite(residuals), residuals, torch.full_like(residuals, float("inf")))
        trace.append(residuals)
        if output_hidden_states:
            iterates.append(z_H)
    ran = torch.full_like(state.iterations, act_steps * applications_per_step(config))
    new = TRMState(
        hidden=z_H,
        z_L=z_L,
        steps=state.steps + act_steps,
        iterations=state.iterations + ran,
        residuals=residuals,
        halted=state.halted,
        converged=residuals < halt_eps,
        diverged=~torch.isfinite(z_H.detach()).all(-1).all(-1),
        fingerprint=state.fingerprint,
    )
    trace = torch.stack(trace, dim=1) if output_residual_trace and trace else None
    return new, ran, trace, None if iterates is None else tuple(iterates)


__all__ = ["TRMState", "act_step", "applications_per_step", "check_trm_state", "recurse"]
