"""Train and evaluate FPRM on Sudoku, mazes, A5/S5 state tracking or ARC-AGI-1, on one CPU, one GPU or several
processes (`accelerate launch`), through `FPRMTrainer` (truncated BPTT + deep supervision). With several processes
the main one alone saves `model/`, evaluates and writes `results.json` (strict JSON: a non-finite number is null).

    python -m looped_training.fprm.train --preset s5-cpu              # the authors' S5 recipe, CPU-sized (<= 15 min)
    python -m looped_training.fprm.train --preset s5-gpu              # the same on one accelerator (<= 10 min, bf16)
    python -m looped_training.fprm.train --preset sudoku-cpu --max_steps 500 --output_dir outputs/sudoku
    python -m looped_training.fprm.train training/configs/fprm/maze-cpu.yaml --torch_threads 2

A preset is a YAML file of training/configs/fprm/ (`--preset NAME`; any file of the same keys: `--config FILE` or FILE as
the first argument). It only sets defaults: any flag given on the command line wins. The accelerator presets train under
bf16 autocast as the authors' configs do (`forward_dtype: bfloat16`, which sets `--bf16 true`; refused on a machine
without an accelerator, where `--forward_dtype float32` runs them in float32); the CPU presets in float32.

Checkpoints are off by default (`--save_strategy no`); with `--save_strategy steps --save_steps N`, resume a killed
run with `--resume_from_checkpoint last` (the newest complete checkpoint in `--output_dir`; one left incomplete by a
kill during its save is skipped with a warning) or a checkpoint's path, and the model and data flags of the run that
wrote it (flags that build another model config are refused; the evaluation flags may change). An `--output_dir` that
holds a run (`model/`, `results.json`, checkpoints) is refused unless the run resumes it or `--overwrite_output_dir` is
given (which deletes the old run first). A run stopped during its final evaluation (after `model/` was saved, before
`results.json`) is evaluated, without training, by `--resume_from_checkpoint last`.

The evaluation prints cell and exact accuracy, iterations used against difficulty (Sudoku: blanks and rating; maze:
path length; state tracking: sequence length), the per-prefix accuracy curve (state tracking), halting vs always
running the cap (accuracy, iterations and wall-clock), and writes PNG plots and `results.json` to `--output_dir`.
"""

import json
import os
import sys
import time
from dataclasses import asdict

import torch
from safetensors.torch import load_file
from transformers import HfArgumentParser, TrainerState, set_seed

from fprm_hf import FPRMConfig, FPRMForReasoning
from looped_training.arguments import given_flags, parse_args_with_config, split_config_file
from looped_training.checkpoints import (
    RESUME_FREE_CONFIG_KEYS,
    RUN_RECORD,
    RunRecordCallback,
    check_resume_config,
    check_resume_data,
    check_run_length,
    finished_run,
    load_model,
    resolve_resume,
    run_record,
)
from looped_training.run_folder import (
    claim_output_dir,
    finish_final_save,
    output_dir_lock,
    start_final_save,
    unfinished_records,
)
from looped_training.configs import CONFIGS_DIR, config_names, with_preset
from looped_training.fprm.callbacks import LengthCurriculumCallback, TimeBudgetCallback
from looped_training.fprm.continued import check_continued_flags
from looped_training.fprm.arguments import (
    VARIANTS,
    DataArguments,
    EvalArguments,
    FPRMTrainingArguments,
    ModelArguments,
    check_run_flags,
    check_train_size,
)
from looped_training.fprm.evaluate import (
    RESULTS_FILE,
    _strict_json,
    accuracy,
    evaluate,
    parse_iteration_counts,
)
from looped_training.fprm.report import print_report, write_plots
from looped_training.fprm.tasks import STATE_TRACKING_TASKS, TASKS, build_task
from looped_training.fprm.callbacks import ema_file
from looped_training.fprm.trainer import FPRMTrainer
from looped_training.fprm.trainer_trm import TRMTrainer


# each checkpoint's record of the data flags it was trained on, and those a resume may change
RUN_FILE = "fprm_run.json"
RESUME_FREE_DATA_FLAGS = ("preset",)

# Presets: YAML files of flags of the four argument groups; `--preset NAME` reads training/configs/fprm/NAME.yaml.
PRESETS_DIR = os.path.join(CONFIGS_DIR, "fprm")
# the command as users type it (`--help`, one-line errors); argparse would say "train.py"
PROG = "python -m looped_training.fprm.train"


def preset_names():
    return config_names("fprm")


def parse_args(argv=None):
    """The four argument groups: defaults here, then a preset or config file, then the flags given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((ModelArguments, DataArguments, EvalArguments, FPRMTrainingArguments), prog=PROG)
    argv = with_preset(argv, "fprm")
    config_file, _ = split_config_file(argv)
    name = os.path.splitext(os.path.basename(config_file))[0] if config_file else None
    defaults = {
        "report_to": "none",
        "save_strategy": "no",
        "dataloader_drop_last": True,
        "logging_steps": 50,
        "output_dir": f"outputs/fprm-{name}" if name else "outputs/fprm",
    }
    (model_args, data_args, eval_args, train_args), _ = parse_args_with_config(parser, argv, defaults)
    if train_args.forward_dtype == "bfloat16" and not train_args.bf16:
        # their forward_dtype: bfloat16 is bf16 autocast; TrainingArguments sets it up from --bf16 (and refuses it
        # without an accelerator, in words about --use_cpu), so it is checked here and set as that flag
        from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

        if not (is_torch_bf16_gpu_available() or is_torch_xla_available()):
            raise ValueError(
                f"`--forward_dtype bfloat16`{f' (preset {data_args.preset})' if data_args.preset else ''} trains under "
                "bf16 autocast on an accelerator, and this machine has none with bf16: give --forward_dtype float32 "
                "to train in float32 here."
            )
        (model_args, data_args, eval_args, train_args), _ = parse_args_with_config(
            parser, [*argv, "--bf16", "true"], defaults
        )
    if data_args.task not in TASKS:
        raise ValueError(f"`--task` must be one of {TASKS}, got {data_args.task!r}.")
    if model_args.variant not in VARIANTS:
        raise ValueError(f"`--variant` must be one of {VARIANTS}, got {model_args.variant!r}.")
    if model_args.variant == "trm" and eval_args.eval_batching not in (None, "batch"):
        raise ValueError(
            f"--eval_batching {eval_args.eval_batching}: --variant trm runs every row its halt_max_steps ACT steps, "
            "so its batches are filled one way; give --eval_batching batch or leave it out."
        )
    start = data_args.curriculum_start_length
    if start is not None:
        if data_args.task not in STATE_TRACKING_TASKS:
            raise ValueError(
                f"`--curriculum_start_length` is for state tracking {STATE_TRACKING_TASKS}, got task "
                f"{data_args.task!r}."
            )
        low = data_args.min_train_length or 1
        if not low <= start <= data_args.train_length:
            raise ValueError(
                f"`--curriculum_start_length` must lie in [min_train_length={low}, train_length="
                f"{data_args.train_length}], got {start}."
            )
        if not 0 < data_args.curriculum_threshold <= 1:
            raise ValueError(f"`--curriculum_threshold` must lie in (0, 1], got {data_args.curriculum_threshold}.")
        if train_args.max_steps <= 0:
            raise ValueError("A curriculum streams fresh data without end: set `--max_steps`.")
    if eval_args.eval_iterations_curve is not None:
        parse_iteration_counts(eval_args.eval_iterations_curve)
    check_run_flags(data_args, eval_args)
    check_continued_flags(model_args, data_args, eval_args, given_flags(parser, argv, config_file))
    check_train_size(data_args, train_args)
    return model_args, data_args, eval_args, train_args


def predictions_and_iterations(outputs, labels):
    """What `solver_metrics` needs of an evaluation batch's outputs (logits, iterations, ...): not the logits."""
    return outputs[0].argmax(-1), outputs[1]


def solver_metrics(eval_pred):
    """Cell and exact accuracy and mean solver iterations of an evaluation during training (`--eval_strategy`)."""
    preds, iterations = eval_pred.predictions
    cell, exact, _, _ = accuracy(torch.as_tensor(preds), eval_pred.label_ids)
    return {"cell_accuracy": cell, "exact_accuracy": exact, "mean_iterations": float(iterations.mean())}


def main(argv=None):
    model_args, data_args, eval_args, train_args = parse_args(argv)
    check_run_length(train_args)
    with output_dir_lock(train_args.output_dir, hold=train_args.process_index == 0) as unwritable:
        return train(model_args, data_args, eval_args, train_args, unwritable)


def train(model_args, data_args, eval_args, train_args, unwritable=None):
    """The run `main` parsed, in its locked `output_dir`: its results, or None if the resumed checkpoint already ends
    the run (or on a process other than the main one). `unwritable`: the `output_dir_lock`'s refusal of a folder the
    run may not write, raised unless the run is finished (nothing to write)."""
    resume = resolve_resume(train_args.resume_from_checkpoint, train_args.output_dir, FPRMConfig.model_type)
    claim_output_dir(train_args, resume, after_final=(RESULTS_FILE,))
    set_seed(train_args.seed)
    if eval_args.torch_threads:
        torch.set_num_threads(eval_args.torch_threads)
    os.makedirs(train_args.output_dir, exist_ok=True)
    t0 = time.perf_counter()
    if data_args.data is not None:  # the authors' folder, drawn as their puzzle_dataset.py draws it
        from looped_training.fprm.authors_data import build_authors_task

        batch = train_args.per_device_train_batch_size * train_args.world_size
        ds, task_config, difficulty_columns = build_authors_task(data_args, train_args.seed, batch)
    else:
        ds, task_config, difficulty_columns = build_task(data_args, train_args.seed)
    print(f"data: {data_args.task} train {len(ds['train'])} test {len(ds['test'])} ({time.perf_counter() - t0:.1f}s)")
    source = None
    if model_args.model_name_or_path is not None:
        from looped_training.fprm.continued import load_source

        source = load_source(model_args)
    config = (
        source.config
        if source is not None
        else FPRMConfig(
            hidden_size=model_args.hidden_size,
            num_attention_heads=model_args.num_attention_heads,
            intermediate_size=model_args.intermediate_size,
            num_hidden_layers=model_args.num_hidden_layers,
            residual_scaling=model_args.residual_scaling,
            outer_only=model_args.outer_only,
            norm_type=model_args.norm_type,
            norm_placement=model_args.norm_placement,
            alpha1=model_args.alpha1,
            alpha2=model_args.alpha2,
            fixed_init=model_args.fixed_init,
            init_std=model_args.init_std,
            halt_eps=model_args.halt_eps,
            patience=model_args.patience,
            conv_kernel_size=model_args.conv_kernel_size,
            use_q_head=model_args.use_q_head,
            puzzle_emb_ndim=model_args.puzzle_emb_ndim,
            gamma_train=model_args.gamma_train,
            gamma_eval=model_args.gamma_eval,
            max_loops=eval_args.eval_max_loops,
            **{"num_prefix_tokens": 0, **task_config, **variant_config(model_args)},
        )
    )
    if data_args.data is not None:
        from looped_training.fprm.authors_data import check_fits

        check_fits(ds, config)
    model_dir = os.path.join(train_args.output_dir, "model")
    data_record = run_data(data_args, train_args)
    if resume is not None:
        # max_loops is --eval_max_loops, the evaluation's cap (training runs n_backward iterations a segment); a run
        # saved without checkpoints is its own record, its config in model/
        own_record = os.path.samefile(resume, train_args.output_dir)
        check_resume_config(model_dir if own_record else resume, config, RESUME_FREE_CONFIG_KEYS + ("max_loops",))
        check_resume_data(resume, RUN_FILE, data_record, RESUME_FREE_DATA_FLAGS)  # the same model on other data
        if train_args.resume_from_checkpoint == "last" and unfinished_records(train_args.output_dir, (RESULTS_FILE,)):
            # stopped during its final evaluation (Ctrl-C, SIGTERM, a crash), after the final save: the run has ended
            # (a time budget may have ended it before --max_steps), so evaluate its saved model
            if not train_args.should_save:
                return None
            if unwritable is not None:
                raise unwritable
            print(
                f"{train_args.output_dir} holds the final model but no {RESULTS_FILE} (a run stopped during its "
                f"final evaluation?): evaluating {model_dir}, without training."
            )
            state = TrainerState.load_from_json(os.path.join(train_args.output_dir, RUN_RECORD))
            train_seconds = next(
                (h["train_runtime"] for h in reversed(state.log_history) if "train_runtime" in h), None
            )  # the Trainer's, logged at the end of training
            return record_results(
                load_model(FPRMForReasoning, model_dir),
                state,
                train_seconds,
                ds,
                data_args,
                eval_args,
                model_args,
                train_args,
                difficulty_columns,
            )
        # after the config check: a finished run resumed with flags of another model is refused, not a no-op
        # killed during its final save, after its last checkpoint: the resume finishes that save (and the evaluation)
        incomplete = not own_record and train_args.should_save and run_record(train_args.output_dir) is None
        if finished_run(resume, train_args, train_args.output_dir if incomplete else None):
            if not incomplete:
                return None
            if unwritable is not None:
                raise unwritable
            model = load_model(FPRMForReasoning, resume)
            ema = os.path.join(resume, ema_file(train_args))
            if os.path.exists(ema):  # the authors save and evaluate the EMA weights
                model.load_state_dict(load_file(ema), strict=False)
            state = TrainerState.load_from_json(os.path.join(resume, RUN_RECORD))
            return finish(model, state, None, ds, data_args, eval_args, model_args, train_args, difficulty_columns)
    if unwritable is not None:
        raise unwritable
    model = source if source is not None else FPRMForReasoning(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    train_columns = [c for c in ("input_ids", "labels", "puzzle_identifiers") if c in ds["train"].column_names]
    train_dataset = ds["train"].select_columns(train_columns)
    callbacks = [RunRecordCallback(RUN_FILE, {"data": data_record})]
    if eval_args.time_budget_minutes:
        callbacks.append(TimeBudgetCallback(eval_args.time_budget_minutes, eval_args.time_budget_decay_fraction))
    curriculum = None
    if data_args.curriculum_start_length is not None:
        from looped_training.fprm.tasks.state_tracking import StateTrackingStream

        train_dataset = StateTrackingStream(
            data_args.task.upper(),
            data_args.min_train_length or 1,
            data_args.curriculum_start_length,
            seed=train_args.seed,
            pad_to=data_args.test_length if data_args.pad_train_to_test_length else None,
        )
        curriculum = LengthCurriculumCallback(
            train_dataset,
            data_args.train_length,
            data_args.curriculum_threshold,
            data_args.curriculum_check_steps,
            train_args,
        )
        callbacks.append(curriculum)
    eval_kwargs = {}
    if train_args.eval_strategy != "no":  # evaluation during training: loss and accuracy on the test split
        test_columns = [c for c in train_columns if c in ds["test"].column_names]
        eval_kwargs = dict(
            eval_dataset=ds["test"].select_columns(test_columns),
            compute_metrics=solver_metrics,
            preprocess_logits_for_metrics=predictions_and_iterations,
        )
    trainer_class = TRMTrainer if config.recursion == "trm" else FPRMTrainer  # a continued TRM checkpoint too
    trainer = trainer_class(
        model=model, args=train_args, train_dataset=train_dataset, callbacks=callbacks, **eval_kwargs
    )
    protocol = {}  # --eval_before_training: looped_training.fprm.evaluate_authors's report before and after training
    if eval_args.eval_before_training and resume is None and trainer.is_world_process_zero():
        protocol["before_training"] = authors_report(model, ds, data_args, eval_args, train_args, "before training")
    t1 = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    train_seconds = time.perf_counter() - t1
    if trainer.ema is not None:  # the authors save and evaluate the EMA weights
        trainer.swap_ema()
    if (
        not trainer.is_world_process_zero()
    ):  # one process saves, evaluates and writes (the ranks hold the same weights)
        return None
    if curriculum is not None:  # its length and history as at the end, in the final trainer_state.json
        trainer.state.stateful_callbacks[type(curriculum).__name__] = curriculum.state()
    if eval_args.eval_before_training:
        protocol["after_training"] = authors_report(model, ds, data_args, eval_args, train_args, "after training")
    return finish(
        model,
        trainer.state,
        train_seconds,
        ds,
        data_args,
        eval_args,
        model_args,
        train_args,
        difficulty_columns,
        extra={"authors_protocol": protocol} if protocol else None,
    )


def authors_report(model, ds, data_args, eval_args, train_args, when):
    """`looped_training.fprm.evaluate_authors`'s report of `model` on the test split of `--data` (continued.py), printed."""
    from looped_training.fprm.continued import authors_protocol
    from looped_training.fprm.evaluate_authors import print_report as print_published

    report = authors_protocol(model, ds["test"], data_args.task, eval_args, train_args.seed, train_args.device)
    print(f"\n== {when}, as looped_training.fprm.evaluate_authors evaluates (--seed {train_args.seed}) ==")
    print_published(report)
    return report


def variant_config(model_args):
    """The config fields of `--variant trm` (TRM's recursion), and a `--conv_type`, `--position_embedding_type` or
    `--num_prefix_tokens` given over the task's."""
    fields = {
        name: getattr(model_args, name)
        for name in ("conv_type", "position_embedding_type", "num_prefix_tokens")
        if getattr(model_args, name) is not None
    }
    if model_args.variant == "trm":
        fields.update(
            recursion="trm",
            H_cycles=model_args.H_cycles,
            L_cycles=model_args.L_cycles,
            n_backwards_L=model_args.n_backwards_L,
            halt_max_steps=model_args.halt_max_steps,
            halt_exploration_prob=model_args.halt_exploration_prob,
        )
    return fields


def run_data(data_args, train_args):
    """The data flags of a run (`fprm_run.json`'s "data"): the seed draws the generated data too."""
    return {**asdict(data_args), "seed": train_args.seed}


def finish(
    model, state, train_seconds, ds, data_args, eval_args, model_args, train_args, difficulty_columns, extra=None
):
    """Save the trained `model` and its `state` (a `TrainerState`), evaluate it and write the results: the end of a
    run, or of one killed during its final save (`train_seconds` None)."""
    # saved before the evaluation, so that an error there cannot lose the training; written aside and moved in, the
    # record (trainer_state.json) last: a kill leaves no half-written model/, and a resume finishes the save. The data
    # flags (fprm_run.json) go beside it: a resume that evaluates the saved model checks them (it rebuilds the test set)
    staging = start_final_save(train_args.output_dir)
    model.save_pretrained(os.path.join(staging, "model"))
    with open(os.path.join(staging, RUN_FILE), "w") as f:
        json.dump({"data": run_data(data_args, train_args)}, f, indent=2)
    state.save_to_json(os.path.join(staging, RUN_RECORD))
    finish_final_save(train_args.output_dir)
    return record_results(
        model, state, train_seconds, ds, data_args, eval_args, model_args, train_args, difficulty_columns, extra
    )


def record_results(
    model, state, train_seconds, ds, data_args, eval_args, model_args, train_args, difficulty_columns, extra=None
):
    """Evaluate the saved `model` of a run whose final `state` is `state` and write results.json and the plots: the
    end of a run, or of one stopped during this evaluation (`--resume_from_checkpoint last`)."""
    results = evaluate(model, ds, data_args, eval_args, difficulty_columns)
    results.update(
        {
            "preset": data_args.preset,
            "task": data_args.task,
            "train_seconds": train_seconds,
            "train_steps": state.global_step,
            "parameters": sum(p.numel() for p in model.parameters()),
            "args": {
                "model": asdict(model_args),
                "data": asdict(data_args),
                "eval": asdict(eval_args),
                "seed": train_args.seed,
                "n_backward": train_args.n_backward,
                "max_segments": train_args.max_segments,
                "batch_size": train_args.per_device_train_batch_size,
                "learning_rate": train_args.learning_rate,
            },
            "log_history": state.log_history,
            **(extra or {}),
        }
    )
    # a curriculum's length and history: its state in trainer_state.json (the final one, or the last checkpoint's)
    saved = (state.stateful_callbacks or {}).get(LengthCurriculumCallback.__name__)
    curriculum = saved["attributes"] if saved and data_args.curriculum_start_length is not None else None
    if curriculum is not None:
        results["curriculum"] = curriculum["history"]
    if data_args.task in STATE_TRACKING_TASKS:
        results["max_train_length"] = data_args.train_length if curriculum is None else curriculum["max_length"]
    print_report(results, train_seconds or 0.0)
    plots = write_plots(results, state.log_history, train_args.output_dir)
    with open(os.path.join(train_args.output_dir, RESULTS_FILE), "w") as f:
        json.dump(_strict_json(results), f, indent=1, default=str, allow_nan=False)
    plots = (
        f" and plots: {', '.join(os.path.basename(p) for p in plots)}"
        if plots
        else " (no plots: they need matplotlib, the package's [train] extra)"
    )
    print(f"wrote {train_args.output_dir}/results.json, model/{plots}")
    return results


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, PROG)
