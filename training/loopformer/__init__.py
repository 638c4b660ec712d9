"""LoopFormer training: `arguments` (the commands' flags), `train` (Trainer + the shortcut-consistency objective in
`objective`), `data` (synthetic reasoning, text, tokenizer), `evaluate` (elastic-depth evaluation: `metrics` measures,
`report` tables, verdicts and plots), `representations`, `lm_eval`, `prepare` (token files; the report over these
runs is a lab script, benchmarks/report.py)."""
