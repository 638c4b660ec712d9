"""The authors' FPRM and TRM formats (GitHub nilskiKonjIzDunava/fprm; the Hub's fixed-point-reasoners/fprm folders
of step files), read on their loading path only: `FPRMConfig(**d)` and `FPRMConfig.from_dict` never enter this
folder.

- `layout.py`: their arch field names onto `FPRMConfig`'s, their weight keys onto `FPRMForReasoning`'s;
- `settings.py`: the one derivation of their settings from a checkpoint's files, each value with its source;
- `checkpoints.py`: their step-file folders through `FPRMForReasoning.from_pretrained` / `FPRMConfig.from_pretrained`
  (`from_pretrained_authors`, `authors_checkpoint_config_dict`: the two hooks `fprm_hf/__init__.py` registers);
- `convert.py`: `python -m fprm_hf.convert_authors` (a checkpoint of theirs, FPRM or TRM, saved in this package's
  format).
"""
