"""Training code of the two models, by model: `looped_training.loopformer` and `looped_training.fprm`; shared by both:
`looped_training.arguments` (flags, config files, `TrainingArguments`), `looped_training.checkpoints` (checkpoint
checks, resume), `looped_training.run_folder` (the `--output_dir` lock, its claim, the final save),
`looped_training.failures` (a full disk, a refused write, Ctrl-C in one line), `looped_training.publish` (Hub) and
`looped_training.finetune_lora` (PEFT). Entry points run as `python -m looped_training.<model>.<script>`."""
