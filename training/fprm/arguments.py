"""The data and evaluation flags of `python -m looped_training.fprm.train`, which `python -m
looped_training.fprm.evaluate` reads again from a run's record, and their checks before any work is done."""

import math
from dataclasses import dataclass, field

from fprm_hf.batching_fprm import check_batching
from fprm_hf.configuration_fprm import check_halt_eps, check_max_loops, check_unit_interval
from looped_training.fprm.callbacks import TimeBudgetCallback
from looped_training.fprm.tasks import TASKS


@dataclass
class DataArguments:
    preset: str | None = field(
        default=None,
        metadata={
            "help": "a file of training/configs/fprm/ by name: `--preset s5-cpu` reads "
            "training/configs/fprm/s5-cpu.yaml (the same as `--config` with that file)"
        },
    )
    task: str = field(default="sudoku", metadata={"help": f"one of {TASKS}"})
    num_train: int = field(default=2000)
    num_test: int = field(default=200)
    sudoku_size: int = field(default=4)
    maze_size: int = field(default=15)
    train_length: int = field(default=32)
    min_train_length: int | None = field(
        default=None,
        metadata={
            "help": "state tracking: train lengths uniform in [min_train_length, train_length] "
            "(default: all exactly train_length)"
        },
    )
    test_length: int = field(default=128)
    pad_train_to_test_length: bool = field(
        default=True,
        metadata={
            "help": "state tracking: pad the training rows to --test_length with ignored labels, "
            "as the authors' build_state_tracking_dataset (false: to the longest training "
            "length, cheaper per step; the halting residual then reads fewer positions)"
        },
    )
    curriculum_start_length: int | None = field(
        default=None,
        metadata={
            "help": "state tracking: train on fresh sequences of length <= this first, then "
            "raise the maximum by half (up to --train_length) each time accuracy at the "
            "current maximum reaches --curriculum_threshold"
        },
    )
    curriculum_threshold: float = field(default=0.9)
    curriculum_check_steps: int = field(default=50, metadata={"help": "optimizer steps between curriculum checks"})
    arc_max_grid: int = field(default=10)
    arc_max_tasks: int = field(default=40)
    arc_augmentations: int = field(default=8)
    data_seed_offset: int = field(default=0)
    data: str | None = field(
        default=None,
        metadata={
            "help": "a folder their dataset/build_*_dataset.py (or looped_training.fprm.prepare) wrote: train on its "
            "train/ split, drawn as their puzzle_dataset.py draws it, and evaluate on the first --num_test puzzles "
            "of its test/ split (--task sudoku or maze; the generator flags are not used)"
        },
    )
    epochs_per_iter: int = field(
        default=1,
        metadata={
            "help": "with --data: passes over the groups in one of their loader's iterations (one Trainer epoch, one "
            "seeded shuffle); theirs: eval_interval (5000 Sudoku-Extreme)"
        },
    )


@dataclass
class EvalArguments:
    eval_max_loops: int = field(default=200, metadata={"help": "solver cap at evaluation"})
    eval_halt_eps: float | None = field(default=None, metadata={"help": "halt_eps at evaluation (default: config)"})
    eval_gamma: float | None = field(default=None)
    eval_batch_size: int = field(default=100)
    eval_batching: str | None = field(
        default=None,
        metadata={
            "help": "how evaluation fills its batches (fprm_hf/batching_fprm.py): batch (every row halts at once, "
            "the authors'), sample (each row halts on its own, the batch shrinks), continuous (a halted puzzle's row "
            "is taken by the next one); default: the model's halt_scope (sample)"
        },
    )
    compare_cap: bool = field(default=True, metadata={"help": "also evaluate always running the cap"})
    eval_iterations_curve: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated iteration counts, e.g. '8,16,32,64,128,256': accuracy and "
            "fraction converged with halting off after each (the stability test)"
        },
    )
    time_budget_minutes: float | None = field(
        default=None, metadata={"help": "stop training after this long (0: no budget, e.g. to lift a preset's)"}
    )
    time_budget_decay_fraction: float = field(
        default=0.0,
        metadata={
            "help": "decay the learning rate linearly to 0 over this last fraction of the time budget (0: no decay)"
        },
    )
    eval_before_training: bool = field(
        default=False,
        metadata={
            "help": "with --data: evaluate before the first step (and after the last) as "
            "looped_training.fprm.published does, with --seed, --eval_batch_size, --eval_max_loops (not on a resume)"
        },
    )
    torch_threads: int | None = field(
        default=None, metadata={"help": "torch.set_num_threads (1 is fastest for small models on a busy CPU)"}
    )


def _at_least_one(value, name):
    if value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")


def _time_budget(value, name):
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"`{name}` must be a finite number of minutes >= 0 (0: no budget, e.g. over a preset's), got {value!r}."
        )


def _unless_none(check):
    """`check` for a flag whose None means "not given"."""
    return lambda value, name: value is None or check(value, name)


def check_run_flags(parser, data_args, eval_args):
    """argparse's error (exit 2) for a flag read only after training (the evaluation) or during it (a callback),
    before any data or model is built: a bad value must not cost a run. The rules are those of the code that reads
    the flag."""
    checks = [
        (eval_args, "eval_max_loops", check_max_loops),
        (eval_args, "eval_halt_eps", _unless_none(check_halt_eps)),  # None: the config's
        (eval_args, "eval_gamma", _unless_none(check_unit_interval)),
        (eval_args, "eval_batch_size", _at_least_one),
        (eval_args, "eval_batching", lambda value, name: check_batching(value, 1, name)),
        (data_args, "num_test", _at_least_one),
        (eval_args, "torch_threads", _unless_none(_at_least_one)),
        (data_args, "curriculum_check_steps", _at_least_one),
        (data_args, "epochs_per_iter", _at_least_one),
        (eval_args, "time_budget_minutes", _unless_none(_time_budget)),
        # TimeBudgetCallback's own check (with a stand-in budget): checked with or without a budget
        (eval_args, "time_budget_decay_fraction", lambda value, name: TimeBudgetCallback(1.0, value)),
    ]
    for args, flag, check in checks:
        try:
            check(getattr(args, flag), f"--{flag}")
        except ValueError as e:
            parser.error(str(e))
