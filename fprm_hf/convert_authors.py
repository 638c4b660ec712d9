"""`python -m fprm_hf.convert_authors`: the converter of the authors' FPRM and TRM checkpoints, which lives in
`fprm_hf/authors/convert.py` (its docstring has the usage and the key table); this module keeps the command's name."""

import sys

from .authors.convert import convert, load_reference_state_dict, main, merge_settings, read_settings

__all__ = ["convert", "load_reference_state_dict", "main", "merge_settings", "read_settings"]

if __name__ == "__main__":
    sys.exit(main())
