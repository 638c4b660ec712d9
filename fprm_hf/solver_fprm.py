"""FPRM's solver (Algorithm 1 of the paper): the damped fixed-point iteration y ← η·f(y) + (1 − η)·y, with a
relative residual, step decay and halting per sample. `SolverSettings` are the knobs of one solve, `FPRMSolverState`
what it carries between calls, `solve` the loop itself; f is any callable (the model's `fixed_point_map`).

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

from dataclasses import dataclass, fields, replace

import torch

from .configuration_fprm import (
    check_halt_eps,
    check_halt_scope,
    check_max_loops,
    check_min_eta,
    check_patience,
    check_unit_interval,
)


RESIDUAL_DENOM_EPS = 1e-8  # r = ‖y − f(y)‖∞ / (‖f(y)‖∞ + 1e-8)


@dataclass
class FPRMSolverState:
    """What the solver carries between calls (e.g. between truncated-BPTT segments): the state y and, per sample,
    the damping step η, patience, best residual, iterations so far and the halting flags."""

    hidden: torch.Tensor  # (batch, tokens, hidden) the current iterate y
    eta: torch.Tensor  # (batch,) damping step
    patience: torch.Tensor  # (batch,) iterations left before η decays
    best: torch.Tensor  # (batch,) best residual so far
    residuals: torch.Tensor  # (batch,) latest residual (inf before the first iteration or after a non-finite one)
    iterations: torch.Tensor  # (batch,) iterations of f applied so far
    halted: torch.Tensor  # (batch,) bool, the row is frozen
    converged: torch.Tensor  # (batch,) bool, halted because r < halt_eps
    diverged: torch.Tensor  # (batch,) bool, halted because the residual was not finite
    # (batch,) int64 `input_fingerprint` of the inputs each row was computed on; None (a state built by hand or by
    # the trainer before its first forward): not known, taken on trust and set by the next forward
    fingerprint: torch.Tensor | None = None

    @classmethod
    def start(cls, hidden, eta, patience):
        """A fresh state from the iterate `hidden` (z0): η = `eta` and `patience` per sample, nothing halted."""

        def full(value, dtype):
            return torch.full((hidden.shape[0],), value, dtype=dtype, device=hidden.device)

        return cls(
            hidden=hidden,
            eta=full(float(eta), torch.float32),
            patience=full(patience, torch.long),
            best=full(float("inf"), torch.float32),
            residuals=full(float("inf"), torch.float32),
            iterations=full(0, torch.long),
            halted=full(False, torch.bool),
            converged=full(False, torch.bool),
            diverged=full(False, torch.bool),
        )

    def detach(self):
        return replace(self, hidden=self.hidden.detach())

    def where(self, rows, other):
        """A state that takes `other`'s rows where `rows` (bool, (batch,)) is True and this one's elsewhere."""
        out = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is None or theirs is None:
                out[f.name] = None
                continue
            mask = rows.view(-1, *([1] * (mine.dim() - 1)))
            out[f.name] = torch.where(mask, theirs, mine)
        return type(self)(**out)

    def put(self, rows, other):
        """A state with `other`'s rows written at `rows` (a LongTensor, one index per row of `other`) and this one's
        elsewhere: continuous batching puts a new puzzle's fresh state (z0, η0, patience, counters) in a done row."""
        out = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = None if mine is None or theirs is None else mine.index_copy(0, rows, theirs)
        return FPRMSolverState(**out)

    def select(self, rows):
        """The state of the rows indexed by `rows` (a LongTensor)."""
        return type(self)(
            **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows] for f in fields(self)}
        )


@dataclass(frozen=True)
class SolverSettings:
    """The knobs of one solve (Algorithm 1), each checked by the rule of its config field. `from_config` fills what
    a call leaves None with the config's defaults."""

    halt_eps: float  # τ: a sample has converged when its relative residual r < τ
    max_loops: int  # iteration cap of this call
    eta: float  # η0, the damping step of a sample that starts here
    gamma: float  # γ, the decay η ← γ·η after `patience` iterations without improvement
    patience: int  # P
    min_eta: float  # a sample halts when η < min_eta
    halting: bool = True  # False: every sample runs `max_loops` iterations (a non-finite residual still stops it)
    halt_scope: str = (
        "sample"  # "batch": every row stops at once, when the batch's largest r < τ or largest η < min_eta
    )

    def __post_init__(self):
        checks = (
            ("halt_eps", check_halt_eps),
            ("max_loops", check_max_loops),
            ("eta", check_unit_interval),
            ("gamma", check_unit_interval),
            ("patience", check_patience),
            ("min_eta", check_min_eta),
        )
        for name, check in checks:
            object.__setattr__(self, name, check(getattr(self, name), name))
        if not isinstance(self.halting, bool):
            raise ValueError(f"`halting` must be True or False, got {self.halting!r} ({type(self.halting).__name__}).")
        object.__setattr__(self, "halt_scope", check_halt_scope(self.halt_scope))

    @classmethod
    def from_config(cls, config, training=False, **given):
        """The settings of a call: each of `given` that is None takes the config's value (`gamma`: `gamma_train`
        in training mode, `gamma_eval` in evaluation mode; `halt_scope`: the config's in evaluation mode, per sample
        in training mode, as the authors' evaluation and training halt)."""
        defaults = dict(
            halt_eps=config.halt_eps,
            max_loops=config.max_loops,
            eta=config.eta,
            gamma=config.gamma_train if training else config.gamma_eval,
            patience=config.patience,
            min_eta=config.min_eta,
            halting=True,
            halt_scope="sample" if training else getattr(config, "halt_scope", "sample"),
        )
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise ValueError(f"Unknown solver settings {unknown}; allowed: {sorted(defaults)}.")
        return cls(**{k: v if given.get(k) is None else given[k] for k, v in defaults.items()})

    def halts(self, residuals, eta):
        """The halting rule (the one place it is written; the trainer judges its segments by it too): per sample,
        (converged = r < τ, halts = converged or η < min_eta). With `halt_scope="batch"` (the authors' evaluation,
        models/fixed_point_reasoning/fprm.py) every row halts once the largest r of the batch is below τ or the
        largest η below min_eta, so `residuals` and `eta` are then the whole batch's."""
        converged = residuals < self.halt_eps
        if self.halt_scope == "batch":
            if residuals.numel() == 0:
                return converged, converged
            stop = (residuals.max() < self.halt_eps) | (eta.max() < self.min_eta)
            return converged, stop.expand_as(converged).clone()
        return converged, converged | (eta < self.min_eta)


def input_fingerprint(input_ids, puzzle_identifiers=None, inputs_embeds=None):
    """(batch,) int64: a hash of each row's input (its token ids, or the bits of its embeddings, and its puzzle
    identifier, None counted as 0), recorded in the `FPRMSolverState` so that a state is not carried onto other
    inputs, where a row converged on the old puzzle would run 0 iterations and return the old answer."""
    if inputs_embeds is not None:
        values = inputs_embeds.detach().flatten(1).float().view(torch.int32).long()
    else:
        values = input_ids.long()
    ids = (
        torch.zeros(values.shape[0], dtype=torch.long, device=values.device)
        if puzzle_identifiers is None
        else (puzzle_identifiers.long())
    )
    values = torch.cat([ids[:, None], values], dim=1)
    # fixed odd 63-bit weights: products and sum wrap around in int64, a multiplicative hash
    weights = torch.randint(-(2**62), 2**62, (values.shape[1],), generator=torch.Generator().manual_seed(0)) | 1
    return (values * weights.to(values.device)).sum(1)


def check_solver_state(state, x, fingerprint):
    """A `solver_state` given to a forward must be a previous call's on these inputs: of their shape and dtype
    (each per-sample field of shape (batch,) and its dtype), and, where it records them, on the same inputs."""
    if not isinstance(state, FPRMSolverState) or not torch.is_tensor(state.hidden) or state.hidden.shape != x.shape:
        raise ValueError(
            f"`solver_state` must be the FPRMSolverState of a previous call on inputs of this shape "
            f"(state {tuple(x.shape)}), got {type(state).__name__} "
            f"{tuple(getattr(getattr(state, 'hidden', None), 'shape', ()))}."
        )
    if state.hidden.dtype != x.dtype:
        raise ValueError(
            f"`solver_state.hidden` is {state.hidden.dtype}, this model computes in {x.dtype}: pass a state of "
            f"a call in this dtype (or `.to({x.dtype})` its hidden)."
        )
    per_sample = {
        "eta": torch.float32,
        "patience": torch.long,
        "best": torch.float32,
        "residuals": torch.float32,
        "iterations": torch.long,
        "halted": torch.bool,
        "converged": torch.bool,
        "diverged": torch.bool,
    }
    for name, dtype in per_sample.items():
        value = getattr(state, name)
        if not torch.is_tensor(value) or value.shape != (x.shape[0],) or value.dtype != dtype:
            raise ValueError(
                f"`solver_state.{name}` must be a {dtype} tensor of shape ({x.shape[0]},), got "
                f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))} {getattr(value, 'dtype', '')}."
            )
    if state.fingerprint is not None and not torch.equal(state.fingerprint, fingerprint):
        rows = (state.fingerprint != fingerprint).nonzero().flatten().tolist()
        raise ValueError(
            f"`solver_state` was computed on other inputs than these (rows {rows} differ): a row that converged "
            f"there would return its old answer here. Pass the inputs it was computed on, or no `solver_state` "
            f"to solve these from the start."
        )


def solve(step, x, state, settings, output_residual_trace=False, output_hidden_states=False):
    """Runs `settings.max_loops` iterations at most of y ← η·f(y) + (1 − η)·y from `state`, where `step(y, x)` is f
    on a batch of rows and `x` the input re-injected at every step. Returns the new state, the iterations this call
    ran per sample, the residual trace (with `output_residual_trace`) and the iterates y_0..y_K (with
    `output_hidden_states`), else None.

    Only rows still iterating are evaluated; a halted row is frozen. Gradients flow through every iteration run here
    (the Trainer truncates by running short segments and detaching between them).
    """
    # A carried state is judged by this call's rule, as if it had run under it: a row halted under another
    # halt_eps / min_eta / halting is reopened (or halts) here; a diverged row stays frozen at its last finite y.
    converged, stops = settings.halts(state.residuals, state.eta)
    halted = state.diverged | stops if settings.halting else state.diverged.clone()
    s = replace(
        state,
        eta=state.eta.clone(),
        patience=state.patience.clone(),
        best=state.best.clone(),
        residuals=state.residuals.clone(),
        iterations=state.iterations.clone(),
        halted=halted,
        converged=converged,
        diverged=state.diverged.clone(),
    )
    trace, iterates = [], [s.hidden] if output_hidden_states else None
    for _ in range(settings.max_loops):
        rows = (~s.halted).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        everyone = rows.numel() == x.shape[0]
        y = s.hidden if everyone else s.hidden[rows]
        f = step(y, x if everyone else x[rows])
        with torch.no_grad():
            # r = max over tokens of ‖y − f(y)‖∞ / (‖f(y)‖∞ + 1e-8), per sample
            diff = (y - f).abs().amax(-1).float()
            r = (diff / (f.abs().amax(-1).float() + RESIDUAL_DENOM_EPS)).amax(-1)
            finite = torch.isfinite(r)
        e = s.eta[rows].to(y.dtype)[:, None, None]
        new = torch.where(finite[:, None, None], e * f + (1 - e) * y, y)  # a non-finite step is discarded
        s.hidden = new if everyone else s.hidden.index_copy(0, rows, new)
        with torch.no_grad():
            _record_iteration(s, rows, torch.where(finite, r, torch.full_like(r, float("inf"))), finite, settings)
            if output_residual_trace:
                trace.append(s.residuals.clone())
        if output_hidden_states:
            iterates.append(s.hidden)
    trace = torch.stack(trace, dim=1) if trace else None
    return s, s.iterations - state.iterations, trace, None if iterates is None else tuple(iterates)


def _record_iteration(s, rows, r, finite, settings):
    """Updates the per-sample fields of `s` at `rows` after one iteration with residuals `r` (in place)."""
    s.iterations[rows] += 1
    s.residuals[rows] = r
    improved = r < s.best[rows]
    s.best[rows] = torch.minimum(s.best[rows], r)
    p = torch.where(improved, torch.full_like(s.patience[rows], settings.patience), s.patience[rows] - 1)
    decay = (p <= 0) & (r >= settings.halt_eps)  # stalled: shrink the step η ← γ·η
    s.eta[rows] = torch.where(decay, s.eta[rows] * settings.gamma, s.eta[rows])
    s.patience[rows] = torch.where(decay, torch.full_like(p, settings.patience), p)
    s.diverged[rows] = ~finite
    if settings.halt_scope == "batch":  # judged over every row: a diverged one (r = inf) keeps the batch going
        s.converged, stops = settings.halts(s.residuals, s.eta)
        s.halted = s.diverged | stops if settings.halting else s.diverged.clone()
        return
    s.converged[rows], stops = settings.halts(r, s.eta[rows])
    s.halted[rows] = ~finite | stops if settings.halting else ~finite


__all__ = ["FPRMSolverState", "SolverSettings", "input_fingerprint", "check_solver_state", "solve"]
