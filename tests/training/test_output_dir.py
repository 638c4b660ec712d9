"""An --output_dir that holds a run is never trained over by re-running a command: as in transformers' example
scripts, it is refused unless the run resumes it (`--resume_from_checkpoint last`) or `--overwrite_output_dir` is
given. An --output_dir the run may not write (its parent read-only, itself read-only, or made read-only mid-run) ends
the command in one line naming it, exit 2, as a user without root's override of permission bits."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from looped_training.arguments import run_command
from looped_training.checkpoints import check_checkpoint
from looped_training.run_folder import LOCK_FILE

from support.bad_input_table import FPRM_TRAIN, TRAIN, made_read_only_mid_run, train_unwritable
from test_resume import (
    FPRM_TINY,
    REPO,
    TINY,
    folder_bytes,
    run,
    run_fprm,
    trained_steps,  # noqa: F401 (fixtures)
    uninterrupted,
)

BOTH_FLAGS = r"--resume_from_checkpoint last to continue it .*--overwrite_output_dir to delete it"


def test_rerunning_a_finished_runs_command_is_refused_naming_both_flags(uninterrupted, tmp_path, trained_steps):
    # it trained from scratch with rc 0: model.safetensors replaced, checkpoint-3 overwritten, the old checkpoint-6
    # left beside the new ones
    out = shutil.copytree(uninterrupted[0], tmp_path / "run")
    before = folder_bytes(out)
    for flags in (["--learning_rate", "1e-3"], ["--max_steps", "3"]):
        with pytest.raises(
            ValueError,
            match=rf"--output_dir '{out}' already holds a run \(trainer_state\.json, "
            rf"config\.json, model\.safetensors, checkpoint-3, checkpoint-6\): a new "
            rf"run would train over it\. Give {BOTH_FLAGS}",
        ):
            run(out, *flags)
    assert trained_steps == [] and folder_bytes(out) == before


def test_rerunning_a_finished_fprm_runs_command_is_refused(tmp_path, trained_steps):
    # FPRM's default keeps no checkpoint: model/ and results.json were replaced
    out = tmp_path / "run"
    run_fprm(out, "--save_strategy", "no")
    before = folder_bytes(out)
    trained_steps.clear()
    with pytest.raises(ValueError, match=rf"holds a run \(trainer_state\.json, results\.json, model\).*{BOTH_FLAGS}"):
        run_fprm(out, "--save_strategy", "no", "--learning_rate", "1e-3")
    assert trained_steps == [] and folder_bytes(out) == before


def test_an_unfinished_run_is_refused_without_a_resume_and_resumed_with_last(uninterrupted, tmp_path, trained_steps):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted[0] / "checkpoint-3", out / "checkpoint-3")
    with pytest.raises(ValueError, match=rf"holds a run \(checkpoint-3\).*{BOTH_FLAGS}"):
        run(out)
    assert trained_steps == []
    run(out, "--resume_from_checkpoint", "last")  # as before: it goes on from checkpoint-3
    assert trained_steps == [3, 4, 5]


def test_overwrite_output_dir_deletes_the_old_run_and_trains_a_new_one(uninterrupted, tmp_path, trained_steps, caplog):
    out = shutil.copytree(uninterrupted[0], tmp_path / "run")
    with caplog.at_level("WARNING", logger="looped_training.run_folder"):
        run(out, "--overwrite_output_dir", "--max_steps", "3")
    assert (
        f"--overwrite_output_dir: deleting the run in {out} (trainer_state.json, config.json, model.safetensors, "
        f"checkpoint-3, checkpoint-6)" in caplog.text
    )
    assert trained_steps == [0, 1, 2]
    # the old run's checkpoint-6 is gone: a later `--resume_from_checkpoint last` takes this run's checkpoint-3
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    check_checkpoint(str(out), for_resume=False)


def _one_line_exit_2(run, capsys):
    """The line `run()` ends in through the command-line wrapper, which must exit 2 without a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        run_command(run, "prog")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "where, train, argv",
    [("parent", TRAIN, ()), ("folder", FPRM_TRAIN, FPRM_TINY)],
    ids=["loopformer, in a read-only folder", "fprm, a read-only folder"],
)
def test_an_output_dir_the_run_may_not_write_is_one_line_and_exit_2(
    tmp_path, capsys, trained_steps, where, train, argv
):
    # a PermissionError traceback from run_folder.output_dir_lock
    line = _one_line_exit_2(lambda: train_unwritable(train, where, *argv)(tmp_path), capsys)
    folder = tmp_path / "read-only"
    if where == "parent":
        assert line == (
            f"prog: error: --output_dir {folder / 'run'} cannot be created: {folder} is not writable "
            f"(Permission denied); give an --output_dir in a folder you can write"
        )
    else:
        assert line == (
            f"prog: error: --output_dir {folder} is not writable (Permission denied: {folder / LOCK_FILE}); "
            f"make it writable (chmod u+w {folder}) or give another --output_dir"
        )
    assert trained_steps == [] and os.listdir(folder) == []


def test_an_output_dir_made_read_only_mid_run_names_the_last_whole_checkpoint(tmp_path, capsys, trained_steps):
    # a PermissionError traceback from Trainer._save
    line = _one_line_exit_2(lambda: made_read_only_mid_run(tmp_path), capsys)
    out = tmp_path / "run"
    assert line == (
        f"prog: error: A write in --output_dir {out} was refused during the run (Permission denied: "
        f"{out / 'checkpoint-6'}): the last complete checkpoint is {out / 'checkpoint-3'}. Make it "
        f"writable and run the same command with --resume_from_checkpoint last"
    )
    check_checkpoint(str(out / "checkpoint-3"), for_resume=True)
    # the read-only folder kept this process's lock; a run's process has ended by now, and an ended one's lock is taken
    # over (tests/training/test_resume.py)
    (out / LOCK_FILE).unlink()
    trained_steps.clear()
    run(out, "--resume_from_checkpoint", "last")
    assert trained_steps == [3, 4, 5] and (out / "model.safetensors").is_file()


SETPRIV = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps", "-all"]


def test_a_read_only_output_dir_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    # the command as a user runs it; root runs it without its override of permission bits
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: the read-only folder would be written")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    prefix = SETPRIV if os.geteuid() == 0 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "LOOPED_TRAINING_TRACEBACK": "0"}
    proc = subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "looped_training.loopformer.train",
            "--output_dir",
            str(folder / "run"),
            *TINY,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    folder.chmod(0o755)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"python -m looped_training.loopformer.train: error: --output_dir {folder / 'run'} cannot be created: {folder} "
        f"is not writable (Permission denied); give an --output_dir in a folder you can write"
    )


def test_a_finished_run_resumed_in_a_read_only_output_dir_says_it_is_finished(tmp_path, caplog, trained_steps):
    # the lock file could not be created: "not writable", exit 2, for a run that had nothing left to write (issue 55)
    from support.bad_input_table import read_only

    out = tmp_path / "run"
    run(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    trained_steps.clear()
    with read_only(out), caplog.at_level("WARNING", logger="looped_training.checkpoints"):
        assert run(out, "--resume_from_checkpoint", "last") is None
    assert f"{out / 'checkpoint-6'} is the end of a finished run" in caplog.text and "nothing written" in caplog.text
    assert trained_steps == [] and {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
