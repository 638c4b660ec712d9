"""LoopFormer's trajectories, in one place: the budget M and step sizes Δ_1..Δ_M a call runs.

- the named schedules (`STEP_SCHEDULE_PRESETS`) and their steps on the 1/L grid (`step_schedule_preset`);
- the checks of a budget and of an explicit schedule (`check_budget`, `check_schedule`), run before anything is
  allocated;
- `resolve_trajectory`: a (budget, schedule) request, with the config's defaults, as one validated trajectory (and a
  warning, once, for one the model was not trained for);
- per-row trajectories (`LoopFormerRows`, `resolve_rows`) and `resolve_call`, what one forward call runs.

`LoopFormerConfig` delegates its trajectory methods here; `LoopFormerPlan` (plan_loopformer.py) resolves a call
with `resolve_call`. Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code`
loading.
"""

import math
import numbers
import warnings

import torch

from .looped_common import is_real_number

STEP_SCHEDULE_PRESETS = ("uniform", "coarse_to_fine", "fine_to_coarse")
SCHEDULE_SUM_TOLERANCE = 1e-6

# Extrapolation warnings are shown once per distinct trajectory, not on every decode step.
_warned_trajectories = set()


def check_budget(config, budget, name="loop_budget"):
    """An integer 1 <= M <= `config.max_loop_budget`, checked before anything is allocated for it."""
    if isinstance(budget, torch.Tensor) and budget.ndim == 0:
        raise ValueError(
            f"`{name}` must be an integer >= 1, got a 0-dim tensor {budget!r}: give an int "
            f"(`{name}=int(t)`) for the whole batch, or a 1-D integer tensor with one budget per row."
        )
    if isinstance(budget, torch.Tensor):  # a 1-D integer tensor gives rows (`resolve_rows`) and never gets here
        raise ValueError(
            f"`{name}` as a tensor must be a 1-D integer tensor with one budget per row, got a {budget.ndim}-D "
            f"{budget.dtype} tensor of shape {tuple(budget.shape)}: give torch.tensor([...], dtype=torch.long), or an "
            f"int for the whole batch."
        )
    if not isinstance(budget, numbers.Integral) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {budget!r} ({type(budget).__name__}).")
    if budget > config.max_loop_budget:
        raise ValueError(
            f"`{name}`={budget} exceeds the largest loop budget this model allows, max_loop_budget="
            f"{config.max_loop_budget} (max_loop_budget_factor={config.max_loop_budget_factor} x num_loops="
            f"{config.num_loops}); raise `config.max_loop_budget_factor` to allow more loop steps."
        )
    return int(budget)


def check_halt_eps(value, name="halt_eps"):
    """`None` (fixed depth) or a positive finite float: the per-token halting threshold."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be None or a positive finite float, got {value!r} ({type(value).__name__}).")
    return float(value)


def _ramp_on_grid(budget, num_loops, descending):
    """M positive multiples of 1/L summing to 1, as close as possible to a linear ramp M, M-1, ..., 1."""
    weights = [budget - i for i in range(budget)]
    if budget > num_loops:  # no grid schedule exists: use the continuous ramp
        steps = [w / sum(weights) for w in weights]
    else:
        # Each step gets one grid unit, the L-M spare units follow the ramp (largest remainder rounding).
        spare = num_loops - budget
        shares = [spare * w / sum(weights) for w in weights]
        units = [math.floor(s) for s in shares]
        by_remainder = sorted(range(budget), key=lambda i: (units[i] - shares[i], i))
        for i in by_remainder[: spare - sum(units)]:
            units[i] += 1
        steps = [(1 + u) / num_loops for u in units]
    return steps if descending else steps[::-1]


def step_schedule_preset(num_loops, name, budget):
    """The step sizes Δ_1..Δ_M of a named schedule for budget M (on the 1/L grid whenever M <= L)."""
    if name == "uniform":
        return [1.0 / budget] * budget
    if name in ("coarse_to_fine", "fine_to_coarse"):
        return _ramp_on_grid(budget, num_loops, descending=name == "coarse_to_fine")
    raise ValueError(f"`step_schedule` preset must be one of {STEP_SCHEDULE_PRESETS}, got {name!r}.")


def check_schedule(schedule):
    """Explicit step sizes: a list (or 1-D array) of positive finite numbers summing to 1, as a list of floats."""
    if hasattr(schedule, "tolist"):  # torch / numpy arrays
        schedule = schedule.tolist()
    if not isinstance(schedule, (list, tuple)):
        raise ValueError(
            f"`step_schedule` must be a preset name {STEP_SCHEDULE_PRESETS} or a list of positive floats summing "
            f"to 1, got {schedule!r} ({type(schedule).__name__})."
        )
    if len(schedule) == 0:
        raise ValueError("`step_schedule` is empty; it needs at least one positive step summing to 1.")
    for step in schedule:
        if not is_real_number(step) or not math.isfinite(step) or step <= 0:
            raise ValueError(
                f"`step_schedule` must hold positive finite numbers summing to 1, got {list(schedule)!r} "
                f"(bad entry {step!r})."
            )
    total = math.fsum(schedule)
    if abs(total - 1.0) > SCHEDULE_SUM_TOLERANCE:
        raise ValueError(
            f"`step_schedule` must sum to 1 within {SCHEDULE_SUM_TOLERANCE}, got {list(schedule)!r} (sum {total!r})."
        )
    return [float(s) for s in schedule]


def check_default_step_schedule(value):
    """The config field `default_step_schedule`: a preset name, or explicit step sizes summing to 1 (the authors'
    configs store their trajectory as `steps`)."""
    if isinstance(value, str) and value not in STEP_SCHEDULE_PRESETS:
        raise ValueError(f"`default_step_schedule` must be one of {STEP_SCHEDULE_PRESETS}, got {value!r}.")
    if not isinstance(value, str):
        try:
            check_schedule(value)
        except ValueError as error:
            raise ValueError(
                f"`default_step_schedule` must be one of {STEP_SCHEDULE_PRESETS} or a list of positive "
                f"step sizes summing to 1: {error}"
            ) from None


def resolve_trajectory(config, loop_budget=None, step_schedule=None):
    """Validate a (budget, schedule) request and return the step sizes (Δ_1, ..., Δ_M) as a tuple of floats.

    A schedule list alone sets the budget; a preset name uses `loop_budget` (or the config default). A budget that
    disagrees with the schedule's length, and every malformed value, raises `ValueError`. A budget above `num_loops`,
    or a trajectory the variant was not trained for, is allowed with one warning (`_warn_if_extrapolating`).
    """
    if loop_budget is not None:
        loop_budget = check_budget(config, loop_budget)
    if step_schedule is None:
        step_schedule = config.default_step_schedule
    named = step_schedule if isinstance(step_schedule, str) else None
    if named is not None:
        budget = (
            loop_budget
            or (config.default_loop_budget and check_budget(config, config.default_loop_budget, "default_loop_budget"))
            or config.num_loops
        )
        steps = step_schedule_preset(config.num_loops, step_schedule, budget)
    else:
        if hasattr(step_schedule, "__len__") and len(step_schedule) > config.max_loop_budget:
            check_budget(config, len(step_schedule), "len(step_schedule)")
        steps = check_schedule(step_schedule)
        if loop_budget is not None and loop_budget != len(steps):
            raise ValueError(
                f"`loop_budget`={loop_budget} disagrees with `step_schedule` of length {len(steps)} "
                f"({list(steps)}); give one of them, or a schedule with exactly `loop_budget` steps."
            )
    if (
        config.loop_conditioning != "shortcut"
        and named != "uniform"
        and any(abs(s - steps[0]) > SCHEDULE_SUM_TOLERANCE for s in steps)
    ):
        raise ValueError(
            f"`step_schedule`={step_schedule!r} needs loop_conditioning='shortcut'; a model with "
            f"loop_conditioning={config.loop_conditioning!r} only knows the number of steps (use 'uniform')."
        )
    _warn_if_extrapolating(config, steps)
    return tuple(float(s) for s in steps)


def _warn_if_extrapolating(config, steps):
    """One warning per variant and trajectory that the model was not trained for, saying why for the variant:
    LoopFormer interpolates Δ for a uniform budget M <= L (the paper's elastic budgets, silent) but not beyond L
    or off the grid of a given schedule; TMLT and Base-Loop have no Δ, so every M != L is a count never run."""
    if torch.compiler.is_compiling():  # a compiled decode step: the eager prefill of its call has warned
        return
    L, M = config.num_loops, len(steps)
    if config.loop_conditioning == "shortcut":
        uniform = all(abs(s - steps[0]) <= SCHEDULE_SUM_TOLERANCE for s in steps)
        off_grid = not uniform and any(abs(s * L - round(s * L)) > 1e-6 for s in steps)
        if M <= L and not off_grid:
            return
        reason = f"LoopFormer trajectory {[round(s, 6) for s in steps]} extrapolates beyond training (" + (
            f"budget {M} > num_loops {L})." if M > L else f"steps off the 1/{L} grid it was trained on)."
        )
    else:
        if M == L:
            return
        variant = "TMLT" if config.loop_conditioning == "timestep" else "Base" if L == 1 else "Base-Loop"
        reason = (
            f"{variant} was trained at exactly num_loops={L} loop steps and has no step-size conditioning to "
            f"interpolate: loop_budget={M} is a loop count it never ran."
        )
    key = (config.loop_conditioning, L, tuple(round(s, 9) for s in steps))
    if key in _warned_trajectories:
        return
    _warned_trajectories.add(key)
    warnings.warn(reason, UserWarning, stacklevel=4)


# ---- per-row trajectories ----------------------------------------------------------------------------------------


class LoopFormerRows:
    """Per-row trajectories of one call: row b runs its own M_b steps Δ_1..Δ_{M_b}; the loop runs the largest budget
    and a row keeps its state after its last step. A plain object, not a tuple: a compiled forward guards only on the
    attributes it reads (the tensors), not on every value.

    `live_counts[i]`: the rows that step i computes when the rows come sorted by budget, largest first (then they are
    a prefix of the batch, and step i computes only those: `generate` sorts a batch so); None otherwise."""

    def __init__(self, trajectories, budgets, steps):
        # per row, Δ_1..Δ_{M_b} as plain floats: read in eager code only (a compiled forward would guard on them, one
        # graph per mix of rows)
        self.trajectories = trajectories
        self.budgets = budgets  # (batch,) M_b
        self.steps = steps  # (batch, largest budget) Δ in float64, 0 after a row's last step
        self.num_steps = steps.shape[1]  # the largest budget
        lengths = [len(t) for t in trajectories]
        self.live_counts = None
        if all(a >= b for a, b in zip(lengths, lengths[1:])):
            self.live_counts = tuple(sum(m > i for m in lengths) for i in range(self.num_steps))

    @classmethod
    def from_trajectories(cls, trajectories):
        steps = torch.zeros(len(trajectories), max(map(len, trajectories)), dtype=torch.float64)
        for b, trajectory in enumerate(trajectories):
            steps[b, : len(trajectory)] = torch.tensor(trajectory, dtype=torch.float64)
        return cls(tuple(trajectories), torch.tensor([len(t) for t in trajectories]), steps)


def _rows_of(value, is_per_row):
    """`value` as one value per row (a list), or None when it is one value for the whole batch."""
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.ndim == 1 and is_per_row(value) else None
    return list(value) if isinstance(value, (list, tuple)) and is_per_row(value) else None


def per_row_budget(value):
    return not isinstance(value, torch.Tensor) or not (
        value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
    )


def _per_row_schedule(value):
    """A list whose entries are schedules (None, a preset name, a list or a 1-D tensor), not step sizes."""
    return (
        not isinstance(value, torch.Tensor)
        and len(value) > 0
        and all(
            s is None or isinstance(s, (str, list, tuple)) or (isinstance(s, torch.Tensor) and s.ndim == 1)
            for s in value
        )
    )


def resolve_rows(config, loop_budget, step_schedule, batch_size=None):
    """The trajectories of a call whose `loop_budget` (a list or 1-D integer tensor) or `step_schedule` (a list of
    schedules, None for a row's default) gives one value per row: a `LoopFormerRows`, or None when every knob is one
    value for the batch. A wrong row is a `ValueError` naming it. Rows given as lists that all resolve to one
    trajectory give that trajectory (a tuple): the batch then computes what a single budget computes. A tensor of
    budgets always gives rows, so that a compiled forward does not switch paths with the values it holds."""
    budgets = _rows_of(loop_budget, per_row_budget)
    schedules = _rows_of(step_schedule, _per_row_schedule)
    if budgets is None and schedules is None:
        return None
    if budgets is not None and not budgets:  # `max()` of no rows failed deep inside
        raise ValueError(
            f"`loop_budget` is empty ({loop_budget!r}): give an integer >= 1 for the whole batch, or one per row."
        )
    for name, values in (("loop_budget", budgets), ("step_schedule", schedules)):
        if values is not None and batch_size is not None and len(values) != batch_size:
            raise ValueError(
                f"`{name}` gives {len(values)} values, one per row, but the batch has {batch_size} rows: "
                f"give one value per row, or one value for the batch (generate's num_return_sequences "
                f"and beams repeat each row, and a tensor of budgets with it; a list is not repeated; a pipeline sends "
                f"`batch_size` inputs at a time, 1 unless given: pass batch_size=len(inputs))."
            )
    rows = max(len(budgets or ()), len(schedules or ()))
    trajectories = []
    for b in range(rows):
        budget = loop_budget if budgets is None else budgets[b]
        schedule = step_schedule if schedules is None else schedules[b]
        try:
            trajectories.append(config.resolve_trajectory(budget, schedule))
        except ValueError as error:
            raise ValueError(f"Row {b} of the batch: {error}") from None
    if len(set(trajectories)) == 1 and not isinstance(loop_budget, torch.Tensor):
        return trajectories[0]
    return LoopFormerRows.from_trajectories(trajectories)


# Read outside a compiled graph: the per-row values become a plan whose spec holds only the largest budget, so a
# compiled forward without a cache breaks its graph here once and guards on that budget, not on the rows' values.
_resolve_rows_eagerly = torch.compiler.disable(resolve_rows)


def _gives_rows(loop_budget, step_schedule):
    """Whether a knob is given per row (by its type alone: no value is read)."""
    return (
        isinstance(loop_budget, (list, tuple))
        or (isinstance(loop_budget, torch.Tensor) and loop_budget.ndim == 1)
        or (isinstance(step_schedule, (list, tuple)) and _per_row_schedule(step_schedule))
    )


def resolve_call(config, loop_budget=None, step_schedule=None, batch_size=None):
    """What one forward call runs: `(trajectory, None)`, or `((), rows)` for per-row trajectories
    (`LoopFormerRows`). Per-row knobs that all resolve to one trajectory give it."""
    rows = (
        _resolve_rows_eagerly(config, loop_budget, step_schedule, batch_size)
        if (_gives_rows(loop_budget, step_schedule))
        else None
    )
    if rows is None:
        return config.resolve_trajectory(loop_budget, step_schedule), None
    if not isinstance(rows, LoopFormerRows):
        return rows, None  # every row resolved to one trajectory
    return (), rows


__all__ = [
    "STEP_SCHEDULE_PRESETS",
    "LoopFormerRows",
    "check_budget",
    "check_halt_eps",
    "check_schedule",
    "resolve_call",
    "resolve_rows",
    "resolve_trajectory",
    "step_schedule_preset",
]
