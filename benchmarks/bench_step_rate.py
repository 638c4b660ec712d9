"""The GPU cost of the authors' LoopFormer run, from a measured step rate: `train --preset authors-3blk-8loops` (3 blocks
x 8 loops, 2048 wide, the shortcut-consistency objective, 12 x 1024 tokens x 5 accumulated per step) on random
GPT-2-sized token files, on this machine's accelerator, timed after its first steps; the run's 50,000 steps on 8
GPUs are then 50,000 x (seconds per step) x 8 GPU-seconds (data-parallel: each GPU runs the per-device step).

    python -m benchmarks.bench_step_rate --bf16              # on one GPU (their autocast dtype): ~3 minutes
    python -m benchmarks.bench_step_rate --tiny --steps 4    # the same path at toy size on a CPU (checks the script)

Prints seconds per step, tokens/s, and the projected GPU-hours; writes benchmarks/results/step_rate.json (not with --tiny).
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(__file__), "results", "step_rate.json")
RUN_STEPS, RUN_GPUS = 50_000, 8
TINY = ["--hidden_size", "64", "--num_attention_heads", "2", "--intermediate_size", "256", "--num_blocks", "1",
        "--num_loops", "4", "--block_size", "64", "--vocab_size", "1024", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "1", "--use_cpu"]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_step_rate")
    parser.add_argument("--steps", type=int, default=12, help="steps to run; the first 2 are not timed")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as their run")
    parser.add_argument("--tiny", action="store_true", help="toy shape on the CPU")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error(f"--steps {args.steps}: give at least 4 (2 untimed, then the timed ones)")
    import transformers

    from looped_training.loopformer import train

    marks = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            marks.append(time.monotonic())

    original = train.build_trainer

    def with_times(*a, **kw):
        trainer = original(*a, **kw)
        trainer.add_callback(StepTimes())
        return trainer

    train.build_trainer = with_times
    from looped_training.loopformer.data.tokenizer import train_bpe_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        # The step costs the same whatever the ids: random ids below 1024 and a local tokenizer of that size (no
        # download; the model keeps the preset's vocabulary of 50,304, so the head costs what theirs costs).
        data, tok = os.path.join(tmp, "data"), os.path.join(tmp, "tokenizer")
        os.makedirs(data)
        np.random.default_rng(0).integers(0, 1024, 4_000_000, dtype=np.uint16).tofile(os.path.join(data, "train.bin"))
        train_bpe_tokenizer([f"word{i} " * 8 for i in range(4000)], 1024).save_pretrained(tok)
        argv = ["--preset", "authors-3blk-8loops", "--data_dir", data, "--tokenizer_name", tok,
                "--output_dir", os.path.join(tmp, "run"), "--max_steps", str(args.steps), "--save_strategy", "no",
                "--eval_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1000"]  # fmt: skip
        if args.tiny:
            argv += TINY
        if args.bf16:
            argv.append("--bf16")
        train.main(argv)
    seconds = (marks[-1] - marks[1]) / (len(marks) - 2)
    import torch

    per_step = 2 * 64 if args.tiny else 12 * 1024 * 5
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
        "shape": "tiny" if args.tiny else "authors-3blk-8loops",
        "bf16": args.bf16,
        "seconds_per_step": seconds,
        "tokens_per_s_per_device": per_step / seconds,
        "projected_gpu_hours": RUN_STEPS * seconds * RUN_GPUS / 3600,
        "projected_wall_hours_on_8": RUN_STEPS * seconds / 3600,
    }
    print(json.dumps(result, indent=2))
    if args.tiny:
        return  # a check of the script, not a figure
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
