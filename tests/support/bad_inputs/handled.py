"""The bad-input registry's `HANDLED` rows: inputs and faults that are not errors, what happens instead and the
test that shows it."""

from support.bad_inputs.shared import FP, LF, Handled

QUANT = "tests/test_quantization.py::"
HANDLED = [
    Handled(
        f"{FP} quantised",
        "torch dynamic int8 (`torch.ao.quantization.quantize_dynamic`)",
        "solves; the logit error of one solver iteration is within that of a Llama of the same width, weight "
        "scale and layer applications under the same scheme (the test prints both)",
        QUANT + "test_dynamic_int8_fprm_solves_within_the_error_of_a_same_size_llama",
    ),
    Handled(
        f"{FP} quantised",
        "`BitsAndBytesConfig(load_in_8bit=True)` / `load_in_4bit=True`",
        "loads and solves where bitsandbytes runs (skipped where it is not installed, as in the default environment: "
        "requirements-quant.txt is its own, or has no backend); the logit error of one "
        "iteration is printed beside the Llama's",
        QUANT + "test_bitsandbytes_8bit_and_4bit_load_generate_and_solve_where_bitsandbytes_runs",
    ),
    Handled(
        f"{LF} quantised",
        "torch dynamic int8",
        "loads and generates (fixed budget and halting); logit error within a same-size Llama's",
        QUANT + "test_dynamic_int8_loopformer_loads_and_generates_within_a_llamas_error",
    ),
    Handled(
        f"{LF} quantised",
        "torch dynamic int8, called with gradients on",
        "runs, as a Llama does, with the logits of a call under `torch.no_grad()` (was a raw RuntimeError: a "
        "step's 1-D conditioning reached a quantised Linear)",
        "tests/loopformer/test_quantized_with_grad.py::test_a_dynamic_int8_loopformer_runs_with_gradients_on_as_with_them_off",
    ),
    Handled(
        f"{LF} quantised",
        "`BitsAndBytesConfig(load_in_8bit=True)` / `load_in_4bit=True`",
        "loads and generates where bitsandbytes runs; logit error within a same-size Llama's",
        QUANT + "test_bitsandbytes_8bit_and_4bit_load_generate_and_solve_where_bitsandbytes_runs",
    ),
    Handled(
        "both models, this package's commands",
        "a saved model whose weights lack a tensor the config needs",
        "`from_pretrained` itself does as Llama's (the tensor is initialised at random, `missing_keys` and a log "
        "line say so); every command that loads a saved model (both evaluations, LoRA fine-tuning, publish, a "
        "killed run's final save) refuses it: `CheckpointError` (exit 2) naming the weights file and the tensor",
        "tests/training/test_cli_faults.py::test_evaluate_refuses_a_checkpoint_that_lacks_a_tensor",
    ),
    # faults of a training run (both trainers hold the output_dir lock and resume through the same checks)
    Handled(
        "both trainers",
        "the disk fills during a checkpoint save",
        "one line `No space left on device while writing FILE (N MiB free)` naming the last complete checkpoint, "
        "exit 1 (`DiskFullError`, errno ENOSPC); once space is freed, `--resume_from_checkpoint last` skips the "
        "half-written checkpoint and finishes the run",
        "tests/training/test_disk_full.py::"
        "test_a_training_run_that_fills_the_disk_says_so_in_one_line_and_resumes_after_space_is_freed",
    ),
    Handled(
        "both trainers",
        "the process killed while a checkpoint file is written",
        "`--resume_from_checkpoint last` skips the incomplete checkpoint with a warning naming it and resumes "
        "from the last complete one",
        "tests/training/test_resume.py::test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint",
    ),
    Handled(
        "both trainers",
        "a finished run given `--resume_from_checkpoint last` again",
        "a no-op that says so: nothing is trained, saved or rotated away",
        "tests/training/test_resume.py::test_a_finished_run_resumed_is_a_no_op_that_says_so",
    ),
    Handled(
        "both trainers",
        "a finished run without checkpoint-N (FPRM's default, `--save_strategy no`) given "
        "`--resume_from_checkpoint last`",
        "its own record (trainer_state.json beside the final model) counts: a no-op that says so; asked for more "
        "steps, `ValueError` (nothing to continue from: training from scratch would overwrite its model)",
        "tests/training/test_final_save.py::test_a_finished_loopformer_run_without_checkpoints_is_not_trained_over",
    ),
    Handled(
        "both trainers",
        "SIGKILL during the final save (after the last checkpoint)",
        "the final files are written aside and moved in one rename each, the record last: nothing half-written "
        "where the model goes; `--resume_from_checkpoint last` writes the final save from the last checkpoint",
        "tests/training/test_final_save.py::test_a_run_killed_during_its_final_save_is_finished_by_a_resume",
    ),
    Handled(
        "fprm.train",
        "Ctrl-C, SIGTERM or a crash during the final evaluation (after the final save, before results.json)",
        "`--resume_from_checkpoint last` evaluates the saved model/ (one line says so; nothing is trained, with or "
        "without checkpoint-N) and writes results.json and the plots, a curriculum's history and length from the "
        "final trainer_state.json (was the no-op of a finished run, rc 0: the evaluation was lost); without it the "
        "refusal says the run stopped before results.json and that the resume finishes it. LoopFormer's train "
        "writes nothing after its final save (train_results.json now comes before it)",
        "tests/training/test_final_save.py::test_an_fprm_run_interrupted_in_its_final_evaluation_is_evaluated_by_a_resume",
    ),
    Handled(
        "both trainers",
        "`--resume_from_checkpoint last` where the only checkpoint is incomplete (killed during the first save)",
        "trains from scratch (exit 0), after a warning that names the skipped checkpoint and what is wrong with it; "
        "nothing complete is overwritten",
        "tests/training/test_resume.py::test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint",
    ),
    Handled(
        "both trainers",
        "SIGTERM (a scheduler's `kill`)",
        "the run ends with status 143 and releases training.lock; a resume goes on from its last complete checkpoint",
        "tests/training/test_locks.py::test_a_run_ended_by_sigterm_releases_its_lock",
    ),
    Handled(
        "both trainers",
        "a training.lock that is empty or garbage",
        "refused while fresh (its writer may be filling it in), with a message that says how to take it over; "
        "taken over with a warning once 30 s old",
        "tests/training/test_locks.py::test_an_empty_or_garbage_lock_is_refused_while_fresh_and_taken_over_when_old",
    ),
    Handled(
        "both trainers",
        "`--overwrite_output_dir` on an --output_dir that holds a run",
        "trains a new run there after deleting the old run's checkpoint-N folders, final model and records (a "
        "warning lists them), so that no later resume takes the old run's checkpoints",
        "tests/training/test_output_dir.py::test_overwrite_output_dir_deletes_the_old_run_and_trains_a_new_one",
    ),
    Handled(
        "both trainers",
        "`--resume_from_checkpoint last` where the last checkpoint's loopformer_training.json "
        "(or any JSON file of it) is truncated",
        "that checkpoint is skipped with a warning naming the file, as a truncated model, optimizer, RNG, scheduler "
        "or trainer_state file is; the run resumes from the one before (given by path: `CheckpointError` naming "
        "the file)",
        "tests/training/test_resume.py::"
        "test_a_truncated_run_record_in_the_last_checkpoint_is_skipped_with_a_warning_naming_it",
    ),
    Handled(
        "both trainers",
        "Ctrl-C (SIGINT)",
        "one line `interrupted (Ctrl-C): the last complete checkpoint is ...` with `--resume_from_checkpoint last` "
        "to go on from it (or that nothing is saved to resume), exit 130, training.lock released (was a 42-line "
        "KeyboardInterrupt traceback, exit -2)",
        "tests/training/test_locks.py::test_ctrl_c_ends_a_run_in_one_line_that_names_its_last_checkpoint_with_exit_130",
    ),
    Handled(
        "fprm.train",
        "matplotlib not installed",
        "trains, saves and evaluates; the last line says that plots need matplotlib, the package's [train] extra",
        "tests/training/test_cli_faults.py::test_fprm_train_without_matplotlib_says_that_plots_need_the_train_extra",
    ),
    Handled(
        "both trainers",
        "no accelerator, without `--use_cpu`",
        "no pinned memory is asked for (`dataloader_pin_memory` off), so torch's pin_memory UserWarning is not "
        "printed",
        "tests/training/test_cli_faults.py::test_no_pin_memory_warning_without_an_accelerator",
    ),
    # issue 64
    Handled(
        "fprm.evaluate_authors",
        "`--output` in a folder that is not there yet",
        "the folder is created and the report written (was a FileNotFoundError traceback after every puzzle was "
        "solved, the report lost); a folder it may not write, or a path under a file, is refused before any work",
        "tests/training/fprm/test_fprm_evaluate_authors.py::"
        "test_an_output_in_a_folder_not_yet_there_is_created_and_the_report_written",
    ),
    Handled(
        "fprm.evaluate_authors, fprm.evaluate",
        "a rating cell left empty (NaN)",
        "that puzzle is in no by-rating bin (`unrated` counts it); every rated puzzle stays in its bin (the NaN "
        "became a bin edge and the top bin's puzzles were dropped without a word)",
        "tests/training/fprm/test_fprm_evaluate_authors.py::"
        "test_an_empty_rating_cell_leaves_every_rated_puzzle_in_the_by_rating_table",
    ),
    Handled(
        f"{LF} from_pretrained",
        "an authors' repo, whose config.json names no end of text",
        "eos_token_id and bos_token_id come from its tokenizer's files (<|endoftext|>): generate stops there, and "
        "a batched pipeline pads with `tokenizer.pad_token_id = model.config.eos_token_id` (both were None)",
        "tests/loopformer/test_authors_checkpoints_usage.py::"
        "test_an_authors_repo_stops_at_its_tokenizers_end_of_text_and_batched_pipelines_pad",
    ),
    Handled(
        f"{FP} from_pretrained",
        "a step file written by torch's legacy (non-zip) serialization",
        'loads with `weights_only=True` as the zip one does, not memory-mapped (was refused as "truncated or '
        'damaged?")',
        "tests/fprm/test_authors_checkpoints_fprm.py::test_a_step_file_in_torchs_legacy_serialization_loads_as_the_zip_one",
    ),
    Handled(
        f"{FP} config",
        "`FPRMConfig(hiden_size=64)` (a keyword that is no field)",
        "a warning naming the closest field (`did you mean 'hidden_size'?`), as LoopFormerConfig's (was silent)",
        "tests/fprm/test_fprm_conventions.py::test_an_unknown_config_keyword_is_a_warning_naming_the_closest_field",
    ),
    Handled(
        "finetune_lora",
        "transformers' FutureWarning `is_gradient_checkpointing is deprecated` on every run",
        "PEFT's (`get_peft_model` reads the attribute), not this package's: `add_lora` silences that one warning",
        "tests/test_peft.py::test_add_lora_prints_no_futurewarning_of_peft_about_gradient_checkpointing",
    ),
    Handled(
        LF,
        "a shortcut run killed and resumed (`log_trajectories_dir`)",
        "the trajectory log is appended: it holds every micro-batch of the run exactly once",
        "tests/training/test_resume.py::test_killed_run_resumes_to_the_same_loss_curve_and_trajectories",
    ),
]
