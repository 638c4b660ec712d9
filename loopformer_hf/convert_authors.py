"""`python -m loopformer_hf.convert_authors`: the converter of the authors' checkpoints, which lives in
`loopformer_hf/authors/convert.py` (its docstring has the usage and the key table); this module keeps the command's
name."""

import sys

from .authors.convert import convert, convert_hub_repo, load_reference_state_dict, main, map_reference_state_dict

__all__ = ["convert", "convert_hub_repo", "load_reference_state_dict", "main", "map_reference_state_dict"]

if __name__ == "__main__":
    sys.exit(main())
