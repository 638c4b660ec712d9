"""LoopFormer training: `train` (Trainer + the shortcut-consistency objective in `objective`), `data` (synthetic
reasoning, text, tokenizer), `evaluate` (elastic-depth evaluation), `representations`, `lm_eval` (the
report over these runs is a lab script, benchmarks/report.py)."""
