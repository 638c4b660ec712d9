"""FPRM: placeholder until its issue lands."""
