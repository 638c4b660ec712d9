"""The flags of `python -m looped_training.fprm.train` (`ModelArguments`, `DataArguments`, `EvalArguments`,
`FPRMTrainingArguments`; `python -m looped_training.fprm.evaluate` reads the data and evaluation flags again from a
run's record), and their checks before any work is done."""

import math
from dataclasses import dataclass, field

from fprm_hf.batching_fprm import check_batching
from fprm_hf.configuration_fprm import check_halt_eps, check_max_loops, check_unit_interval
from looped_training.arguments import TrainingArguments
from looped_training.fprm.callbacks import TimeBudgetCallback
from looped_training.fprm.tasks import TASKS


VARIANTS = ("fprm", "trm")


@dataclass
class ModelArguments:
    variant: str = field(
        default="fprm",
        metadata={
            "help": f"{VARIANTS}: fprm (the fixed-point solver) or trm, the paper's baseline (FPRMConfig(recursion="
            "'trm'), trained by TRMTrainer: one ACT step per optimizer step, Q-head halting; its presets *-trm)"
        },
    )
    H_cycles: int = field(default=3, metadata={"help": "trm: cycles per ACT step"})
    L_cycles: int = field(default=6, metadata={"help": "trm: z_L updates per cycle"})
    n_backwards_L: int | None = field(default=None, metadata={"help": "trm: z_L updates with gradient (L_cycles)"})
    halt_max_steps: int = field(default=16, metadata={"help": "trm: ACT steps (evaluation runs all of them)"})
    halt_exploration_prob: float = field(default=0.1, metadata={"help": "trm: their Q-halting exploration"})
    conv_type: str | None = field(
        default=None, metadata={"help": "causal_1d, 2d or none (default: the task's; TRM's block has none)"}
    )
    hidden_size: int = field(default=128)
    num_attention_heads: int = field(default=4)
    intermediate_size: int = field(default=256)
    num_hidden_layers: int = field(default=2)
    residual_scaling: str = field(
        default="input_independent", metadata={"help": "input_independent|fixed|input_dependent|none"}
    )
    outer_only: bool = field(default=False, metadata={"help": "β2 = 1 − α2, α1 = β1 = 1"})
    norm_type: str = field(default="pre", metadata={"help": "pre (FPRM), post (TRM style) or peri"})
    norm_placement: str = field(default="none", metadata={"help": "none, input or output (the authors' maze)"})
    alpha1: float = field(default=0.5, metadata={"help": "initial α1 (0.75 in the authors' Sudoku/maze configs)"})
    alpha2: float = field(default=0.5, metadata={"help": "initial α2 (0.25 in the authors' Sudoku/maze configs)"})
    fixed_init: bool = field(
        default=False, metadata={"help": "one stored z0 vector instead of a fresh draw per reset"}
    )
    num_prefix_tokens: int | None = field(
        default=None,
        metadata={
            "help": "learned prefix rows before the input (their puzzle_emb_len; 16 in their arch/trm.yaml); default "
            "the task's: 0"
        },
    )
    position_embedding_type: str | None = field(
        default=None,
        metadata={
            "help": "rope, learned or none (their pos_encodings; rope in arch/trm.yaml); default the task's: none for "
            "state tracking (their FPRM state-tracking configs), rope for grids"
        },
    )
    init_std: float = field(
        default=1.0, metadata={"help": "std of the truncated normal z0 (6.0 in the paper's configs)"}
    )
    conv_kernel_size: int | None = field(
        default=None, metadata={"help": "depthwise conv kernel (default: 3 for grids, 4 for sequences, as the paper)"}
    )
    halt_eps: float = field(default=0.1)
    patience: int = field(default=5)
    gamma_train: float = field(default=0.9)
    gamma_eval: float = field(default=0.99)
    use_q_head: bool = field(
        default=False,
        metadata={
            "help": "their Q-head on the first state row (trained by --q_loss_coefficient, theirs 0.5 on Sudoku/maze)"
        },
    )
    puzzle_emb_ndim: int | None = field(
        default=None,
        metadata={
            "help": "values of the prefix rows that are learned (their puzzle_emb_ndim, = d in "
            "their Sudoku/maze configs: the first of the 16 rows); default all"
        },
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "start from this FPRM (a saved folder, or the authors' fixed-point-reasoners/fprm with "
            "--subfolder sudoku|maze): the model flags then come from it (looped_training.fprm.continued)"
        },
    )
    subfolder: str | None = field(default=None, metadata={"help": "the folder of --model_name_or_path"})
    step: int | None = field(
        default=None, metadata={"help": "the authors' step_N file of --model_name_or_path (default: the newest)"}
    )


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
            "looped_training.fprm.evaluate_authors does, with --seed, --eval_batch_size, --eval_max_loops (not on a resume)"
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


def check_run_flags(data_args, eval_args):
    """A ValueError (one line and exit 2 as a command) for a flag read only after training (the evaluation) or
    during it (a callback), before any data or model is built: a bad value must not cost a run. The rules are those
    of the code that reads the flag."""
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
        check(getattr(args, flag), f"--{flag}")


def check_train_size(data_args, train_args):
    """A ValueError (one line and exit 2 as a command) for a generated training set (`--num_train`; not ARC's, not
    a curriculum's stream) that gives no batch: Trainer would train 0 steps, or fail in its sampler, after the data
    was built."""
    if data_args.task == "arc" or data_args.curriculum_start_length is not None or data_args.data is not None:
        return  # --data: the folder's size is checked when it is read (AuthorsTrainStream)
    batch, processes = train_args.per_device_train_batch_size, train_args.world_size
    needed = batch * processes if train_args.dataloader_drop_last else 1
    if data_args.num_train < needed:
        why = (
            f"--per_device_train_batch_size {batch} x {processes} process(es) with --dataloader_drop_last true"
            if train_args.dataloader_drop_last
            else "a batch"
        )
        raise ValueError(
            f"`--num_train` must be >= {needed} ({why}: a smaller training set gives no batch), got "
            f"{data_args.num_train}."
        )


LOSS_TYPES = ("softmax", "stablemax")
LR_SCHEDULES = ("trainer", "authors")
LOSS_NORMALIZATIONS = ("sample", "token")
PUZZLE_EMB_OPTIMIZERS = ("adamw", "signsgd")
FORWARD_DTYPES = ("float32", "bfloat16")


def _option(default, help):
    return field(default=default, metadata={"help": help})


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
    max_grad_norm: float = _option(
        0.0,
        "Gradient clipping; 0 (default) is off, as the authors' pretrain.py (Trainer's default is 1.0: pass it "
        "to clip).",
    )
    lr_schedule: str = _option(
        "trainer",
        f"{LR_SCHEDULES}: trainer = --lr_scheduler_type with --warmup_steps; authors = their pretrain.py: "
        "lr·(s+1)/W for steps s < W (their first step trains at lr/W), then constant (their lr_min_ratio "
        "1.0); --lr_scheduler_type is then not used.",
    )
    loss_normalization: str = _option(
        "sample",
        f"{LOSS_NORMALIZATIONS}: sample (the authors') = each sample's mean over its labelled tokens, then "
        "the mean over the batch; token (earlier versions) = the mean over every labelled token of the "
        "batch. Equal when every sample has the same number of labels.",
    )
    q_loss_coefficient: float | None = _option(
        None,
        "Weight of their Q-halt loss, BCE(q_halt_logits, sequence correct), for a model with use_q_head=True "
        "(default then 0.5, theirs; 0 turns it off).",
    )
    ema_decay: float | None = _option(
        None,
        "Keep an exponential moving average of the weights, updated after every optimizer step (the authors' "
        "Sudoku/maze: 0.999), for evaluation and the saved model; None: off.",
    )
    puzzle_emb_optimizer: str = _option(
        "adamw",
        f"{PUZZLE_EMB_OPTIMIZERS}: how the prefix rows (model.prefix) are trained. adamw: with the rest; "
        "signsgd (the authors'): sign of the gradient summed over the batch, with decoupled weight decay on "
        "the rows of the batch only, at --puzzle_emb_lr (scheduled as --learning_rate).",
    )
    puzzle_emb_lr: float | None = _option(None, "SignSGD learning rate of the prefix rows (default: --learning_rate).")
    puzzle_emb_weight_decay: float | None = _option(
        None, "SignSGD weight decay of the prefix rows (default: --weight_decay)."
    )
    forward_dtype: str = _option(
        "float32",
        f"{FORWARD_DTYPES}: what the training forward runs in (their forward_dtype). bfloat16 (their configs; the "
        "accelerator presets) trains under bf16 autocast, as --bf16 true, and needs an accelerator with bf16: on a "
        "machine without one the command refuses it (give --forward_dtype float32 there). float32 (the CPU presets): "
        "as --bf16 says.",
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("n_backward", "max_segments"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"`loss_type` must be one of {LOSS_TYPES}, got {self.loss_type!r}.")
        choices = (
            ("forward_dtype", FORWARD_DTYPES),
            ("lr_schedule", LR_SCHEDULES),
            ("loss_normalization", LOSS_NORMALIZATIONS),
            ("puzzle_emb_optimizer", PUZZLE_EMB_OPTIMIZERS),
        )
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)!r}.")
        for name in ("q_loss_coefficient", "puzzle_emb_lr", "puzzle_emb_weight_decay"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"`{name}` must be None or a finite number >= 0, got {value!r}.")
        if self.ema_decay is not None and not (isinstance(self.ema_decay, (int, float)) and 0 < self.ema_decay < 1):
            raise ValueError(
                f"`ema_decay` must be None (off) or a number in (0, 1) (theirs: 0.999), got {self.ema_decay!r}."
            )
        if self.train_halt_eps is not None and not self.train_halt_eps > 0:
            raise ValueError(f"`train_halt_eps` must be a positive number or None, got {self.train_halt_eps!r}.")
        if self.label_smoothing_factor:
            # Trainer applies it only in its own compute_loss; FPRMTrainer's segment loss would train without it
            raise ValueError(
                f"`label_smoothing_factor` is not applied by FPRMTrainer, whose segment loss is its own "
                f"(`loss_type` one of {LOSS_TYPES}); got {self.label_smoothing_factor!r}: use 0."
            )
