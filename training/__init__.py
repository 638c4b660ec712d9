"""Training code of the two models, by model: `training.loopformer` and `training.fprm`; shared by both:
`training.arguments` (flags and config files), `training.checkpoints` (checkpoint checks), `training.publish` (Hub)
and `training.finetune_lora` (PEFT). Entry points run as `python -m training.<model>.<script>`."""
