"""Check (or rewrite) the files one package copies from another, as transformers' utils/check_copies.py does.

    python scripts/check_copies.py                       # exit 1 naming every copy that differs from its source
    python scripts/check_copies.py --fix_and_overwrite   # rewrite those copies from their sources

A copy is its source's text under one marker line, `# Copied from <source>: ...`, so that a reader of the copy knows
where to edit and a `trust_remote_code` folder (which holds one package's files alone) carries the whole file. No
symbolic links: a Windows checkout (git's `core.symlinks=false`) turns a link into a one-line text file.
tests/test_check_copies.py runs the check.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# copy -> source, both relative to the checkout's root
COPIES = {"fprm_hf/looped_common.py": "loopformer_hf/looped_common.py"}
MARKER = "# Copied from {source}: edit there, then `python scripts/check_copies.py --fix_and_overwrite`\n"


def expected_copy(source, root=ROOT):
    """The text the copy of `source` must hold: the marker line, then the source's text."""
    return MARKER.format(source=source) + (root / source).read_text(encoding="utf-8")


def check_copies(fix_and_overwrite=False, root=ROOT, copies=COPIES):
    """The copies (paths relative to `root`) whose text differs from `expected_copy` of their source; rewritten from
    it with `fix_and_overwrite`."""
    differ = []
    for copy, source in sorted(copies.items()):
        path, want = root / copy, expected_copy(source, root)
        have = path.read_text(encoding="utf-8") if path.is_file() and not path.is_symlink() else None
        if have != want:
            differ.append(copy)
            if fix_and_overwrite:
                path.unlink(missing_ok=True)  # a link is replaced, never written through
                path.write_text(want, encoding="utf-8")
    return differ


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python scripts/check_copies.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fix_and_overwrite", action="store_true", help="rewrite the copies that differ")
    args = parser.parse_args(argv)
    differ = check_copies(args.fix_and_overwrite)
    for copy in differ:
        source = COPIES[copy]
        if args.fix_and_overwrite:
            print(f"{copy}: rewritten from {source}")
        else:
            print(f"{copy} differs from {source} (under its `# Copied from` line)", file=sys.stderr)
    if differ and not args.fix_and_overwrite:
        print("run `python scripts/check_copies.py --fix_and_overwrite` to rewrite them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
