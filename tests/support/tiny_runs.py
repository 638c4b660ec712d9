"""Command-line flags of tiny training runs (seconds on a CPU) that the tests train checkpoints with."""

# `python -m looped_training.loopformer.train` on the synthetic task: d = 32, one block looped L = 4 times, 2 steps
TINY = ["--hidden_size", "32", "--num_attention_heads", "2", "--num_loops", "4", "--num_blocks", "1",
        "--num_train_problems", "64", "--num_eval_problems", "24", "--max_depth", "3",
        "--per_device_train_batch_size", "8", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--max_steps", "2", "--save_strategy", "no", "--seed", "0"]
