"""FPRM training: `train` (entry point and presets), `trainer` (deep-supervision `FPRMTrainer`), `callbacks`,
`tasks` (Sudoku, maze, state-tracking and ARC dataset builders), `evaluate` (solver evaluation and plots)."""
