"""The bad-input registry's rows by area (`loopformer`, `fprm`, `commands`, `handled`) and what they build rows with
(`shared`); tests/support/bad_input_table.py assembles them and renders docs/bad_inputs.md."""
