"""Dataset builders: synthetic reasoning and text for LoopFormer; Sudoku, mazes, state tracking and ARC for FPRM."""
