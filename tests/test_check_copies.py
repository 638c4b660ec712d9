"""The files one package copies from another (scripts/check_copies.py: `fprm_hf/looped_common.py`, copied from
`loopformer_hf/looped_common.py`) are their source under a "Copied from" line, as transformers' check_copies keeps
its "Copied from" code; the tree holds no symbolic link (a Windows checkout, git's `core.symlinks=false`, turns one
into a one-line text file and the package no longer imports)."""

import importlib.util
import os
import subprocess
import sys

from support import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "check_copies.py"


def _script():
    spec = importlib.util.spec_from_file_location("check_copies", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_copy_is_its_source_under_a_copied_from_line():
    check = _script()
    assert check.check_copies() == [], "run `python scripts/check_copies.py --fix_and_overwrite`"
    for copy, source in check.COPIES.items():
        first = (REPO_ROOT / copy).read_text().splitlines()[0]
        assert first.startswith(f"# Copied from {source}"), first


def test_a_copy_that_drifts_fails_the_check_and_is_rewritten_by_fix_and_overwrite(tmp_path):
    check = _script()
    for copy, source in check.COPIES.items():
        for path in (copy, source):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text((REPO_ROOT / path).read_text())
    copy = next(iter(check.COPIES))
    (tmp_path / copy).write_text((tmp_path / copy).read_text().replace("def rms_norm(", "def rms_norm_edited("))
    assert check.check_copies(root=tmp_path) == [copy]
    assert check.check_copies(fix_and_overwrite=True, root=tmp_path) == [copy]
    assert check.check_copies(root=tmp_path) == []
    assert (tmp_path / copy).read_text() == (REPO_ROOT / copy).read_text()


def test_the_command_exits_0_when_every_copy_matches():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_tree_holds_no_symbolic_link():
    links = []
    for folder, dirs, files in os.walk(REPO_ROOT):
        if folder == str(REPO_ROOT):  # git's own folder and the virtual environments are not the tree
            dirs[:] = [d for d in dirs if not d.startswith((".git", ".venv"))]
        links += [os.path.join(folder, name) for name in dirs + files if os.path.islink(os.path.join(folder, name))]
    assert links == [], links
