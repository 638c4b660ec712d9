"""FPRM training: `arguments` (the commands' flags), `train` (entry point and presets), `trainer` (deep-supervision
`FPRMTrainer`, with its `losses`, `optimizer` and `callbacks`), `tasks` (Sudoku, maze, state-tracking and ARC dataset
builders), `evaluate` (solver evaluation; `report` prints it and plots)."""
