"""LoopFormer training: `train` (Trainer + the shortcut-consistency objective in `objective`), `data` (synthetic
reasoning, text, tokenizer), `evaluate` (elastic-depth evaluation), `report`, `representations`, `lm_eval`."""
