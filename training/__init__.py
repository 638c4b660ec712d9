"""Training code of the two models, by model: `looped_training.loopformer` and `looped_training.fprm`; shared by both:
`looped_training.arguments` (flags and config files), `looped_training.checkpoints` (checkpoint checks), `looped_training.publish` (Hub)
and `looped_training.finetune_lora` (PEFT). Entry points run as `python -m training.<model>.<script>`."""
