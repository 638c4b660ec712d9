"""Every training preset of FPRM and of TRM (the paper's baseline) against the authors' config files, GitHub
nilskiKonjIzDunava/fprm. `AUTHORS` is transcribed from their yaml files (their keys and values, each file at the
commit named); `model_fields` and `training_fields` say which field of this package answers each key, and how its
value reads here. A preset's model config is the one a one-step run saves (model/config.json: the task's fields
included, which no flag of the preset shows), its training arguments are those `fprm.train` parses from it.

- A paper-size preset (s5, a5, sudoku, maze and their -trm) takes every value of its files; the data it is built from
  are this package's generated data (`DATA`: their sizes, and the steps over the grids).
- A -cpu-trm preset is its -trm preset but for sizes, steps and time budget (`CPU_SIZES`), and its file lists those
  differences in a comment.
- An FPRM recipe for a CPU or one accelerator (-cpu, -gpu) takes every value of its model that is not a size; its
  training differs from theirs in the knobs `RECIPES` names, each with the reason.
- An accelerator preset trains under bf16 autocast, as their `forward_dtype: bfloat16` (`--bf16`); a CPU preset in
  float32.
"""

import json
import os
import re

import pytest
import yaml

from fprm_hf.configuration_fprm import swiglu_width

pytestmark = pytest.mark.usefixtures("one_thread")

# ---- their files, transcribed (the keys that set what a run computes; paths, logging and evaluation grids left out)

# config/arch/trm.yaml at 9e0ebf3 (the one version stored)
ARCH_TRM = {
    "name": "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1",
    "loss": {"name": "losses@ACTLossHead", "loss_type": "stablemax_cross_entropy", "q_loss_coeff": 0.5},
    "halt_exploration_prob": 0.1,
    "halt_max_steps": 16,
    "H_cycles": 3,
    "L_cycles": 6,
    "n_backwards_L": "${.L_cycles}",
    "H_layers": 0,
    "L_layers": 2,
    "hidden_size": 512,
    "num_heads": 8,
    "expansion": 4,
    "puzzle_emb_ndim": "${.hidden_size}",
    "pos_encodings": "rope",
    "forward_dtype": "bfloat16",
    "mlp_t": False,
    "puzzle_emb_len": 16,
    "no_ACT_continue": True,
    "q_logit_detach_model": False,
    "q_logit_from_puzzle_emb": True,
    "softmax_temp": 1.0,
    "norm_type": "post-norm",
    "norm_placement": "none",
    "conv_type": "none",
    "conv_kernel_size": 4,
    "conv_bias": False,
    "residual_scale": None,
    "alpha_1_init": 0.5,
    "alpha_2_init": 0.5,
    "outer_only": False,
    "normalize_input_injection": False,
    "use_spec_norm_linear": False,
}

# config/arch/fprm.yaml at 68e118c (9e0ebf3 has one stepsize_decay: 0.9; this package follows the later split into
# training and evaluation decay, as their task files at 68e118c and 4fd7ab1 do)
ARCH_FPRM = {
    "name": "fixed_point_reasoning.fprm@FixedPointReasoningModel_ACTV1",
    "loss": {
        "name": "losses@ACTLossHead",
        "loss_type": "stablemax_cross_entropy",
        "q_loss_coeff": 0.5,
        "deep_supervision": True,
        "jacobian_reg_lambda": 0.0,
    },
    "H_cycles": 3,
    "L_cycles": 6,
    "H_layers": 0,
    "L_layers": 2,
    "max_iter": 1000,
    "max_iter_eval": None,
    "n_backwards_L": "${.L_cycles}",
    "hidden_size": 512,
    "num_heads": 8,
    "expansion": 4,
    "puzzle_emb_ndim": "${.hidden_size}",
    "pos_encodings": "rope",
    "forward_dtype": "bfloat16",
    "mlp_t": False,
    "puzzle_emb_len": 16,
    "no_ACT_continue": True,
    "fp_thresh": 0.1,
    "outlier_quantile": 0.25,
    "stepsize": 1.0,
    "stepsize_decay_train": 0.9,
    "stepsize_decay_eval": 0.99,
    "decay_patience": 5,
    "eps": 1.0e-8,
    "init_std": 1.0,
    "additive_noise_std": 0.0,
    "fixed_init": False,
    "max_iter_dist": "expon",
    "conv_type": "conv1d",
    "conv_kernel_size": 4,
    "conv_bias": False,
    "residual_scale": "input-independent",
    "alpha_1_init": 0.5,
    "alpha_2_init": 0.5,
    "outer_only": False,
    "norm_placement": "none",
    "norm_type": "pre-norm",
    "normalize_input_injection": False,
    "softmax_temp": 1.0,
    "n_decode_steps": 0,
    "weight_dropout": 0.0,
    "variational_dropout": 0.0,
}

# the state-tracking FPRM files' arch block (4fd7ab1); S5's differs from A5's in two values
_FPRM_STATE_TRACKING_ARCH = {
    "causal": True,
    "H_cycles": 3,
    "H_layers": 0,
    "L_cycles": 4,
    "L_layers": 2,
    "n_backwards_L": 4,
    "hidden_size": 512,
    "num_heads": 8,
    "expansion": 4,
    "puzzle_emb_len": 0,
    "puzzle_emb_ndim": 0,
    "pos_encodings": "none",
    "forward_dtype": "bfloat16",
    "max_iter": 128,
    "max_iter_eval": 160,
    "max_iter_dist": "det",
    "alpha_1_init": 0.5,
    "alpha_2_init": 0.5,
    "residual_scale": "input-independent",
    "outer_only": False,
    "norm_type": "pre-norm",
    "norm_placement": "none",
    "conv_type": "conv1d",
    "conv_kernel_size": 4,
    "conv_bias": False,
    "fp_thresh": 0.1,
    "outlier_quantile": 0.25,
    "stepsize": 1.0,
    "stepsize_decay_train": 0.95,
    "stepsize_decay_eval": 0.99,
    "decay_patience": 10,
    "eps": 1.0e-8,
    "init_std": 6.0,
    "additive_noise_std": 0.0,
    "n_decode_steps": 0,
    "softmax_temp": 1.0,
    "mlp_t": False,
    "no_ACT_continue": True,
    "normalize_input_injection": False,
    "variational_dropout": 0.0,
    "weight_dropout": 0.0,
    "loss": {"loss_type": "stablemax_cross_entropy", "q_loss_coeff": 0.0, "deep_supervision": True},
}
_FPRM_STATE_TRACKING_TRAINING = {
    "global_batch_size": 1024,
    "epochs": 50,
    "optimizer": "adamw",
    "lr": 1e-4,
    "lr_min_ratio": 1.0,
    "lr_warmup_steps": 0,
    "weight_decay": 0.01,
    "beta1": 0.9,
    "beta2": 0.95,
    "puzzle_emb_lr": 1e-2,
    "puzzle_emb_weight_decay": 0.01,
    "ema": False,
    "ema_rate": 0.999,
}
AUTHORS = {
    # config/cfg_pretrain_state_tracking.yaml at 9e0ebf3: TRM on state tracking
    "cfg_pretrain_state_tracking.yaml": {
        "defaults": ["arch: trm"],
        "arch": {"causal": True},
        "global_batch_size": 512,
        "epochs": 5,
        "lr": 1e-4,
        "lr_min_ratio": 1.0,
        "lr_warmup_steps": 0,
        "beta1": 0.9,
        "beta2": 0.95,
        "weight_decay": 0.1,
        "puzzle_emb_weight_decay": 0.1,
        "optimizer": "adamw",
        "puzzle_emb_lr": 1e-2,
        "ema": False,
        "ema_rate": 0.999,
    },
    # config/cfg_pretrain_state_tracking_fprm_s5.yaml and _a5.yaml at 4fd7ab1 (the one version stored)
    "cfg_pretrain_state_tracking_fprm_s5.yaml": {
        "defaults": ["arch: fprm"],
        **_FPRM_STATE_TRACKING_TRAINING,
        "arch": _FPRM_STATE_TRACKING_ARCH,
    },
    "cfg_pretrain_state_tracking_fprm_a5.yaml": {
        "defaults": ["arch: fprm"],
        **_FPRM_STATE_TRACKING_TRAINING,
        "arch": {**_FPRM_STATE_TRACKING_ARCH, "stepsize_decay_train": 0.9, "decay_patience": 5},
    },
    # config/cfg_pretrain_sudoku.yaml at 68e118c
    "cfg_pretrain_sudoku.yaml": {
        "defaults": ["arch: fprm"],
        "global_batch_size": 768,
        "epochs": 60000,
        "optimizer": "adamw",
        "lr": 1e-3,
        "lr_min_ratio": 1.0,
        "lr_warmup_steps": 2000,
        "weight_decay": 0.001,
        "beta1": 0.9,
        "beta2": 0.95,
        "puzzle_emb_lr": 1e-3,
        "puzzle_emb_weight_decay": 0.001,
        "ema": True,
        "ema_rate": 0.999,
        "arch": {
            "H_cycles": 3,
            "L_cycles": 6,
            "H_layers": 0,
            "L_layers": 2,
            "n_backwards_L": 6,
            "hidden_size": 512,
            "num_heads": 8,
            "expansion": 4,
            "puzzle_emb_len": 16,
            "pos_encodings": "rope",
            "max_iter": 12,
            "max_iter_dist": "det",
            "max_iter_eval": 1000,
            "alpha_1_init": 0.75,
            "alpha_2_init": 0.25,
            "residual_scale": "input-independent",
            "outer_only": False,
            "norm_type": "pre-norm",
            "norm_placement": "none",
            "conv_type": "conv2d",
            "conv_kernel_size": 3,
            "conv_bias": False,
            "fp_thresh": 0.1,
            "stepsize": 1.0,
            "stepsize_decay_train": 0.9,
            "stepsize_decay_eval": 0.99,
            "decay_patience": 5,
            "init_std": 6.0,
            "softmax_temp": 1.0,
            "mlp_t": False,
            "no_ACT_continue": True,
            "normalize_input_injection": False,
            "variational_dropout": 0.0,
            "weight_dropout": 0.0,
            "loss": {"loss_type": "stablemax_cross_entropy", "q_loss_coeff": 0.5, "deep_supervision": True},
        },
    },
    # config/cfg_pretrain_maze.yaml at 68e118c
    "cfg_pretrain_maze.yaml": {
        "defaults": ["arch: fprm"],
        "global_batch_size": 768,
        "epochs": 60000,
        "optimizer": "adamw",
        "lr": 1e-4,
        "lr_min_ratio": 1.0,
        "lr_warmup_steps": 2000,
        "weight_decay": 1.0,
        "beta1": 0.9,
        "beta2": 0.95,
        "puzzle_emb_lr": 1e-2,
        "puzzle_emb_weight_decay": 1.0,
        "ema": True,
        "ema_rate": 0.999,
        "arch": {
            "H_cycles": 3,
            "H_layers": 0,
            "L_cycles": 6,
            "L_layers": 2,
            "n_backwards_L": 6,
            "hidden_size": 512,
            "num_heads": 8,
            "expansion": 4,
            "puzzle_emb_len": 16,
            "puzzle_emb_ndim": 512,
            "pos_encodings": "rope",
            "forward_dtype": "bfloat16",
            "max_iter": 24,
            "max_iter_dist": "det",
            "max_iter_eval": 1000,
            "alpha_1_init": 0.75,
            "alpha_2_init": 0.25,
            "residual_scale": "input-independent",
            "outer_only": False,
            "norm_type": "pre-norm",
            "norm_placement": "output",
            "conv_type": "conv1d",
            "conv_kernel_size": 4,
            "conv_bias": False,
            "fp_thresh": 0.1,
            "outlier_quantile": 0.25,
            "stepsize": 1.0,
            "stepsize_decay_train": 0.9,
            "stepsize_decay_eval": 0.99,
            "decay_patience": 5,
            "eps": 1.0e-8,
            "init_std": 6.0,
            "additive_noise_std": 0.0,
            "n_decode_steps": 0,
            "softmax_temp": 1.0,
            "mlp_t": False,
            "no_ACT_continue": True,
            "normalize_input_injection": False,
            "loss": {"loss_type": "stablemax_cross_entropy", "q_loss_coeff": 0.5, "deep_supervision": True},
        },
    },
}
ARCHS = {"trm": ARCH_TRM, "fprm": ARCH_FPRM}

# ---- which of their runs each preset is ---------------------------------------------------------------------------

# preset -> (their task file, their arch file). TRM on Sudoku and the maze: their task file's training section with
# arch/trm.yaml; that file's own `arch:` block overrides arch/fprm.yaml (FPRM's solver and block) and is not TRM's.
RUNS = {
    "s5": ("cfg_pretrain_state_tracking_fprm_s5.yaml", "fprm"),
    "a5": ("cfg_pretrain_state_tracking_fprm_a5.yaml", "fprm"),
    "sudoku": ("cfg_pretrain_sudoku.yaml", "fprm"),
    "maze": ("cfg_pretrain_maze.yaml", "fprm"),
    "s5-trm": ("cfg_pretrain_state_tracking.yaml", "trm"),
    "a5-trm": ("cfg_pretrain_state_tracking.yaml", "trm"),
    "sudoku-trm": ("cfg_pretrain_sudoku.yaml", "trm"),
    "maze-trm": ("cfg_pretrain_maze.yaml", "trm"),
}
for _base in ("s5", "a5", "sudoku", "maze"):
    RUNS[f"{_base}-cpu"] = RUNS[f"{_base}-gpu"] = RUNS[_base]
    RUNS[f"{_base}-cpu-trm"] = RUNS[f"{_base}-trm"]
ACCELERATOR = {"s5", "a5", "sudoku", "maze", "s5-gpu", "a5-gpu", "sudoku-gpu", "maze-gpu"} | {
    f"{b}-trm" for b in ("s5", "a5", "sudoku", "maze")
}

# The data are this package's generated data (the tasks of their builders, at the sizes below) rather than their
# files: the state-tracking presets use their 2M-sequence build's sizes (train length 32, test 128; their TRM file
# names an older build, k_train 20, and evaluates to 128) and train their epochs over it; the grid presets generate
# 9x9 Sudoku and 30x30 mazes and choose their own number of steps (their 60000 epochs are of their 1k-puzzle
# augmented sets).
STATE_TRACKING_TRAIN = 2_000_000
DATA_KEYS = {"num_train", "num_test", "max_steps"}

# What a CPU (-cpu, -cpu-trm) or single-accelerator (-gpu) preset may set to its own value: sizes, steps, time budget.
CPU_SIZES = {
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",  # their expansion 4 at the preset's width (asserted)
    "puzzle_emb_ndim",  # their ${hidden_size} at the preset's width (asserted)
    "num_train",
    "num_test",
    "grid_size",  # sudoku_size, maze_size
    "per_device_train_batch_size",
    "warmup_steps",
    "ema_decay",  # off over a few hundred steps: an EMA of 0.999 would average back to mostly initial weights
    "max_steps",
    "time_budget_minutes",
    "torch_threads",
    "eval_batch_size",
    "forward_dtype",
}

# The FPRM recipes' knobs that are not theirs (docs/fprm.md, "The authors' recipes": what each recipe shrinks)
RECIPES = {
    "s5-cpu": {"learning_rate": "1e-3 at d 64, batch 64", "max_segments": "<= 16 segments in an 11-minute budget"},
    "a5-cpu": {"learning_rate": "1e-3 at d 64, batch 64", "max_segments": "<= 16 segments in an 11-minute budget"},
    "s5-gpu": {"learning_rate": "5e-4 at d 256, batch 512"},
    "a5-gpu": {"learning_rate": "5e-4 at d 256, batch 512"},
    "sudoku-cpu": {"num_prefix_tokens": "4 rows for a 6x6 grid", "max_loops": "an evaluation cap of 200 for 6x6"},
    "sudoku-gpu": {"max_loops": "an evaluation cap of 300 in an 8-minute job"},
    "maze-cpu": {
        "num_prefix_tokens": "4 rows for an 11x11 maze",
        "max_loops": "an evaluation cap of 300 for 11x11",
        "learning_rate": "1e-3 at d 96, batch 32",
        "weight_decay": "1e-3 over an 11-minute budget (theirs 1.0 over 50k steps)",
        "puzzle_emb_weight_decay": "as weight_decay",
    },
    "maze-gpu": {
        "max_loops": "an evaluation cap of 300 for 21x21",
        "learning_rate": "5e-4 at d 256, batch 128",
        "weight_decay": "0.1 in an 8-minute job (theirs 1.0 over 50k steps)",
        "puzzle_emb_weight_decay": "as weight_decay",
    },
}
# the data the paper-size presets are built from: their builds' sizes (state tracking) and grids
DATA = {
    "s5": {"train_length": 32, "test_length": 128},
    "a5": {"train_length": 32, "test_length": 128},
    "sudoku": {"sudoku_size": 9},
    "maze": {"maze_size": 30},
}


def resolve(arch):
    """Their `${.key}` interpolations, within the arch block."""
    return {k: arch[v[3:-1]] if isinstance(v, str) and v.startswith("${.") else v for k, v in arch.items()}


def their_run(name):
    """(the arch block as their hydra composes it, the training section) of the run preset `name` is."""
    task_file, arch_name = RUNS[name]
    task = AUTHORS[task_file]
    arch = dict(ARCHS[arch_name])
    own = task.get("arch", {})
    if arch_name == "fprm" or task["defaults"] == ["arch: trm"]:
        arch.update({k: v for k, v in own.items() if k != "loss"})
        arch["loss"] = {**arch["loss"], **own.get("loss", {})}
    return resolve(arch), {k: v for k, v in task.items() if k not in ("arch", "defaults")}


NORM_TYPES = {"pre-norm": "pre", "post-norm": "post", "peri-norm": "peri"}
CONV_TYPES = {"conv1d": "causal_1d", "conv2d": "2d", "none": "none"}
RESIDUAL_SCALES = {
    None: "none",
    "fixed": "fixed",
    "input-independent": "input_independent",
    "input-dependent": "input_dependent",
}


def model_fields(arch, trm):
    """Their arch block as this package's config fields."""
    d = arch["hidden_size"]
    fields = {
        "hidden_size": d,
        "num_attention_heads": arch["num_heads"],
        "intermediate_size": swiglu_width(d, arch["expansion"]),
        "num_hidden_layers": arch["L_layers"],
        "position_embedding_type": arch["pos_encodings"],
        "num_prefix_tokens": arch["puzzle_emb_len"],
        "puzzle_emb_ndim": arch["puzzle_emb_ndim"] or None,  # 0: no prefix rows
        "causal": arch.get("causal", False),  # their ReasoningModelConfig default
        "norm_type": NORM_TYPES[arch["norm_type"]],
        "norm_placement": arch["norm_placement"],
        "conv_type": CONV_TYPES[arch["conv_type"]],
        "conv_bias": arch["conv_bias"],
        "residual_scaling": RESIDUAL_SCALES[arch["residual_scale"]],
        "outer_only": arch["outer_only"],
        "normalize_input_injection": arch["normalize_input_injection"],
        "softmax_temperature": arch["softmax_temp"],
    }
    if arch["conv_type"] != "none":
        fields["conv_kernel_size"] = arch["conv_kernel_size"]
    if trm:
        fields |= {
            "recursion": "trm",
            "H_cycles": arch["H_cycles"],
            "L_cycles": arch["L_cycles"],
            "n_backwards_L": arch["n_backwards_L"],
            "halt_max_steps": arch["halt_max_steps"],
            "halt_exploration_prob": arch["halt_exploration_prob"],
        }
    else:
        fields |= {
            "recursion": "fixed_point",
            "alpha1": arch["alpha_1_init"],
            "alpha2": arch["alpha_2_init"],
            "halt_eps": arch["fp_thresh"],
            "eta": arch["stepsize"],
            "gamma_train": arch["stepsize_decay_train"],
            "gamma_eval": arch["stepsize_decay_eval"],
            "patience": arch["decay_patience"],
            "init_std": arch["init_std"],
            "fixed_init": arch.get("fixed_init", False),
            "max_loops": arch["max_iter_eval"],
            "use_q_head": arch["loss"]["q_loss_coeff"] > 0,
        }
    return fields


def training_fields(arch, training, trm, task):
    """Their training section (and the arch's loss and solver budget in training) as this package's arguments."""
    prefix = arch["puzzle_emb_len"] > 0
    fields = {
        "per_device_train_batch_size": training["global_batch_size"],  # one process
        "learning_rate": training["lr"],
        "warmup_steps": training["lr_warmup_steps"],
        "lr_schedule": "authors" if training["lr_min_ratio"] == 1.0 else "cosine",  # their rule: warm-up, constant
        "weight_decay": training["weight_decay"],
        "adam_beta1": training["beta1"],
        "adam_beta2": training["beta2"],
        "optim": {"adamw": "adamw_torch"}[training["optimizer"]],
        "max_grad_norm": 0.0,  # their pretrain.py does not clip
        "ema_decay": training["ema_rate"] if training["ema"] else None,
        "loss_type": {"stablemax_cross_entropy": "stablemax"}[arch["loss"]["loss_type"]],
        "q_loss_coefficient": arch["loss"]["q_loss_coeff"],
        "forward_dtype": arch["forward_dtype"],
        # the prefix rows (their puzzle embedding) learn by their SignSGD; without rows their values are inert
        "puzzle_emb_optimizer": "signsgd" if prefix else "adamw",
    }
    if prefix:
        fields |= {
            "puzzle_emb_lr": training["puzzle_emb_lr"],
            "puzzle_emb_weight_decay": training["puzzle_emb_weight_decay"],
        }
    if not trm:  # FPRM's deep supervision: max_iter segments of n_backwards_L iterations with gradient
        fields |= {"n_backward": arch["n_backwards_L"], "max_segments": arch["max_iter"]}
    if task in ("s5", "a5"):  # pretrain.py: int(epochs x examples / global batch) optimizer steps
        fields["max_steps"] = int(training["epochs"] * STATE_TRACKING_TRAIN / training["global_batch_size"])
        fields["num_train"] = STATE_TRACKING_TRAIN
    return fields


def expected(name):
    """The values of their run that preset `name` is, by this package's names."""
    arch, training = their_run(name)
    trm = RUNS[name][1] == "trm"
    task = name.split("-")[0]
    return model_fields(arch, trm) | training_fields(arch, training, trm, task) | DATA[task]


# ---- the presets as they run --------------------------------------------------------------------------------------

# the one-step run's sizes (a preset's own sizes are compared as it parses them): tiny data, width and batch
TINY = {
    "s5": ["--train_length", "4", "--test_length", "8"],
    "a5": ["--train_length", "4", "--test_length", "8"],
    "sudoku": ["--sudoku_size", "4"],
    "maze": ["--maze_size", "5"],
}
SIZE_FIELDS = ("hidden_size", "num_attention_heads", "puzzle_emb_ndim", "grid_size")  # set by TINY in the run
TRAINING_ARGS = (
    "per_device_train_batch_size",
    "learning_rate",
    "warmup_steps",
    "lr_schedule",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "optim",
    "max_grad_norm",
    "ema_decay",
    "loss_type",
    "q_loss_coefficient",
    "forward_dtype",
    "puzzle_emb_optimizer",
    "puzzle_emb_lr",
    "puzzle_emb_weight_decay",
    "n_backward",
    "max_segments",
    "max_steps",
)


def preset_file(name):
    from looped_training.configs import config_path

    with open(config_path("fprm", name)) as f:
        return f.read()


def parsed(name):
    """The preset's arguments as `fprm.train` parses them (an accelerator preset in float32 on this machine)."""
    from looped_training.fprm.train import parse_args

    dtype = ["--forward_dtype", "float32"] if name in ACCELERATOR else []
    return parse_args(["--preset", name, *dtype])


def one_step_config(name, folder, monkeypatch):
    """model/config.json of a one-step run of the preset at tiny sizes (the evaluation after it left out)."""
    from looped_training.fprm import train

    monkeypatch.setattr(train, "record_results", lambda *args, **kwargs: {})
    model_args = parsed(name)[0]
    tiny = ["--hidden_size", "16", "--num_attention_heads", "2", "--num_train", "8", "--num_test", "2"]
    tiny += [
        "--per_device_train_batch_size",
        "4",
        "--max_steps",
        "1",
        "--eval_batch_size",
        "2",
        "--disable_tqdm",
        "true",
    ]
    if model_args.puzzle_emb_ndim is not None:
        tiny += ["--puzzle_emb_ndim", "16"]
    dtype = ["--forward_dtype", "float32"] if name in ACCELERATOR else []
    train.main(["--preset", name, *dtype, *tiny, *TINY[name.split("-")[0]], "--output_dir", str(folder)])
    with open(os.path.join(folder, "model", "config.json")) as f:
        return json.load(f)


def resolved(name, folder, monkeypatch):
    """The preset's model config (a one-step run's, its sizes as parsed) and training arguments, by this package's
    names."""
    config = one_step_config(name, folder, monkeypatch)
    model_args, data_args, _, train_args = parsed(name)
    config |= {field: getattr(model_args, field) for field in SIZE_FIELDS if hasattr(model_args, field)}
    config |= {field: getattr(train_args, field) for field in TRAINING_ARGS}
    # torch's AdamW, fused or not
    config["optim"] = str(getattr(train_args.optim, "value", train_args.optim)).removesuffix("_fused")
    if config["q_loss_coefficient"] is None:  # the trainer's default: 0.5 for a model with a Q-head (TRM has one)
        config["q_loss_coefficient"] = 0.5 if config["use_q_head"] or config["recursion"] == "trm" else 0.0
    config["forward_dtype"] = yaml.safe_load(preset_file(name)).get("forward_dtype", "float32")
    config |= {
        key: getattr(data_args, key)
        for key in ("num_train", "train_length", "test_length", "sudoku_size", "maze_size")
    }
    return config


# ---- the rules ------------------------------------------------------------------------------------------------------

PAPER = ["s5", "a5", "sudoku", "maze", "s5-trm", "a5-trm", "sudoku-trm", "maze-trm"]
CPU_TRM = ["s5-cpu-trm", "a5-cpu-trm", "sudoku-cpu-trm", "maze-cpu-trm"]
FPRM_RECIPES = sorted(RECIPES)
# a preset's grid size is its data size: on a CPU or one accelerator, smaller than theirs
GRID = {"sudoku_size", "maze_size"}


def differences(name, got):
    want = expected(name)
    return {key: (want[key], got[key]) for key in want if got[key] != want[key]}


def check_widths(got):
    """Their expansion 4 and puzzle_emb_ndim ${hidden_size}, at the preset's width."""
    assert got["intermediate_size"] == swiglu_width(got["hidden_size"], 4)
    if got["num_prefix_tokens"]:
        assert got["puzzle_emb_ndim"] == got["hidden_size"]


@pytest.mark.parametrize("name", PAPER)
def test_paper_size_presets_are_the_authors_runs(name, tmp_path, monkeypatch):
    got = resolved(name, tmp_path / "run", monkeypatch)
    assert differences(name, got) == {}
    check_widths(got)
    if name.startswith(("s5", "a5")):  # their causal attention, positions and prefix rows, as the task resolves them
        assert got["causal"] is True
        assert (got["position_embedding_type"], got["num_prefix_tokens"]) == (
            ("rope", 16) if name.endswith("-trm") else ("none", 0)
        )


@pytest.mark.parametrize("name", CPU_TRM)
def test_cpu_trm_presets_are_their_trm_preset_but_for_sizes_steps_and_time(name, tmp_path, monkeypatch):
    got = resolved(name, tmp_path / "run", monkeypatch)
    assert set(differences(name, got)) <= CPU_SIZES | GRID
    check_widths(got)
    # the files: every key that differs from the -trm preset's is a size, step or time key, named in the comment
    text = preset_file(name)
    cpu, full = yaml.safe_load(text), yaml.safe_load(preset_file(name.replace("-cpu-trm", "-trm")))
    changed = {key for key in cpu.keys() | full.keys() if cpu.get(key) != full.get(key)}
    assert changed, name
    assert changed <= CPU_SIZES | GRID
    comment = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    assert "differs from" in comment and "only in sizes, steps and time budget" in comment
    for key in changed:
        assert re.search(rf"\b{key}\b", comment), f"{name}: {key} is not listed in its comment"


@pytest.mark.parametrize("name", FPRM_RECIPES)
def test_fprm_recipes_take_their_model_and_name_what_they_change(name, tmp_path, monkeypatch):
    got = resolved(name, tmp_path / "run", monkeypatch)
    changed = set(differences(name, got)) - CPU_SIZES - GRID - DATA_KEYS
    assert changed == set(RECIPES[name])  # every change named, and no name left that no longer changes
    check_widths(got)


def test_accelerator_presets_train_under_bf16_autocast_and_cpu_presets_in_float32(monkeypatch):
    from looped_training.fprm.train import parse_args, preset_names
    from transformers import utils

    names = set(preset_names())
    assert ACCELERATOR <= names
    monkeypatch.setattr(utils, "is_torch_bf16_gpu_available", lambda *args, **kwargs: False)  # (a machine without)
    for name in sorted(names - ACCELERATOR):  # the CPU presets
        train_args = parse_args(["--preset", name])[3]
        assert (train_args.forward_dtype, train_args.bf16) == ("float32", False), name
    for name in sorted(ACCELERATOR):
        with pytest.raises(ValueError, match="give --forward_dtype float32"):  # refused, naming the way out
            parse_args(["--preset", name])
        train_args = parse_args(["--preset", name, "--forward_dtype", "float32"])[3]
        assert train_args.bf16 is False
    # on an accelerator (here: the check answers yes, and --use_cpu lets TrainingArguments take bf16 on this CPU)
    monkeypatch.setattr(utils, "is_torch_bf16_gpu_available", lambda *args, **kwargs: True)
    for name in sorted(ACCELERATOR):
        train_args = parse_args(["--preset", name, "--use_cpu", "true"])[3]
        assert (train_args.forward_dtype, train_args.bf16) == ("bfloat16", True), name


def test_the_refusal_on_a_machine_without_an_accelerator_says_what_to_give(monkeypatch):
    from looped_training.fprm.train import parse_args
    from transformers import utils

    monkeypatch.setattr(utils, "is_torch_bf16_gpu_available", lambda *args, **kwargs: False)

    with pytest.raises(ValueError) as error:  # one line and exit 2 as a command
        parse_args(["--preset", "s5-trm"])
    assert "`--forward_dtype bfloat16` (preset s5-trm) trains under bf16 autocast" in str(error.value)
    assert "give --forward_dtype float32" in str(error.value)


def test_an_accelerator_preset_trains_under_bf16_autocast(tmp_path, monkeypatch):
    """What `--bf16` sets up, seen from the training step: bf16 autocast (here on the CPU, as --use_cpu allows)."""
    import torch
    from looped_training.fprm import train
    from looped_training.fprm.trainer_trm import TRMTrainer
    from transformers import utils

    monkeypatch.setattr(utils, "is_torch_bf16_gpu_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(train, "record_results", lambda *args, **kwargs: {})
    seen, compute_loss = [], TRMTrainer.compute_loss

    def record(module, args):  # inside the model's forward, where accelerate's autocast applies
        if module.training:
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    def recording(self, model, inputs, *args, **kwargs):
        core = self.accelerator.unwrap_model(model).model
        if not core._forward_pre_hooks:
            core.register_forward_pre_hook(record)
        return compute_loss(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(TRMTrainer, "compute_loss", recording)
    tiny = ["--hidden_size", "16", "--num_attention_heads", "2", "--puzzle_emb_ndim", "16", "--sudoku_size", "4"]
    tiny += ["--num_train", "8", "--num_test", "2", "--per_device_train_batch_size", "4", "--max_steps", "2"]
    train.main(["--preset", "sudoku-trm", "--use_cpu", "true", *tiny, "--output_dir", str(tmp_path / "run")])
    assert seen == [torch.bfloat16, torch.bfloat16]
