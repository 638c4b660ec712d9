"""Moved to tiny_models.py, the one home of the test model factories; this name is kept for the test files that
still import it."""

from tiny_models import grid_inputs, sequence_fprm_config, tiny_fprm, tiny_fprm_config  # noqa: F401
