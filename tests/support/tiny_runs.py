"""Command-line flags of tiny training runs (seconds on a CPU) that the tests train checkpoints with."""

# `python -m looped_training.loopformer.train` on the synthetic task: d = 32, one block looped L = 4 times, 2 steps
TINY = ["--hidden_size", "32", "--num_attention_heads", "2", "--num_loops", "4", "--num_blocks", "1",
        "--num_train_problems", "64", "--num_eval_problems", "24", "--max_depth", "3",
        "--per_device_train_batch_size", "8", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--max_steps", "2", "--save_strategy", "no", "--seed", "0"]

# runs that checkpoint (steps 3 and 6) and log every step, for resuming, killing and locking them: LoopFormer ...
CHECKPOINTED = ["--hidden_size", "32", "--num_attention_heads", "2", "--num_loops", "4", "--num_blocks", "1",
                "--num_train_problems", "256", "--num_eval_problems", "16", "--max_depth", "3",
                "--per_device_train_batch_size", "8", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
                "--logging_steps", "1", "--learning_rate", "3e-3", "--seed", "0", "--max_steps", "6", "--save_steps",
                "3", "--log_trajectories", "true", "--consistency_warmup_steps", "2"]
# ... and FPRM, which keeps a sample for up to max_segments (2) steps: a resume must restore the samples in flight
FPRM_CHECKPOINTED = ["--task", "s3", "--train_length", "4", "--num_train", "96", "--num_test", "4", "--test_length",
                     "4", "--hidden_size", "16", "--num_attention_heads", "2", "--intermediate_size", "32",
                     "--conv_kernel_size", "2", "--n_backward", "2", "--max_segments", "2",
                     "--per_device_train_batch_size", "8", "--eval_max_loops", "4", "--eval_batch_size", "4",
                     "--compare_cap", "false", "--use_cpu", "true", "--disable_tqdm", "true", "--report_to", "none",
                     "--logging_steps", "1", "--learning_rate", "3e-3", "--seed", "0", "--max_steps", "6",
                     "--save_strategy", "steps", "--save_steps", "3"]


def run_checkpointed(output_dir, *extra):
    from looped_training.loopformer.train import main

    return main(["--output_dir", str(output_dir), *CHECKPOINTED, *extra])


def run_fprm(output_dir, *extra):
    from looped_training.fprm.train import main

    return main(["--output_dir", str(output_dir), *FPRM_CHECKPOINTED, *extra])
