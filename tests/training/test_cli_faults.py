"""Command-line faults that once ended silently or in a raw traceback, each reproduced here with the named error it
now ends in."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from loopformer_hf.convert_authors import main as convert_main
from looped_training.loopformer import evaluate as evaluate_elastic
from looped_training.loopformer import train as train_loopformer

from support.bad_input_table import CASES, FPRM_TINY  # the tiny FPRM run of the table's fprm.train rows
from support.tiny_runs import TINY


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    for variant in ("loopformer", "base"):
        train_loopformer.main(["--output_dir", str(root / variant), "--variant", variant, *TINY])
    return root


def test_convert_authors_refuses_an_existing_file_as_output(tmp_path, capsys):
    # save_pretrained only logs an error for a file path, so the converter printed "saved" and wrote nothing
    target = tmp_path / "taken.bin"
    target.write_bytes(b"keep me")
    missing_ckpt = tmp_path / "never-read.pt"  # the check must come before any work, so the checkpoint is not needed
    with pytest.raises(SystemExit) as exit_info:
        convert_main(
            [
                "--checkpoint",
                str(missing_ckpt),
                "--output",
                str(target),
                "--n-layer",
                "1",
                "--n-loops",
                "2",
                "--n-embd",
                "8",
                "--n-head",
                "2",
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(target) in err and "not a folder" in err and "saved" not in err
    assert target.read_bytes() == b"keep me"


def test_evaluate_without_uniform_schedule_still_scores_and_summarises(checkpoints, tmp_path, capsys):
    # the tables and the Base comparison are at the uniform schedule; without it the summary ended in IndexError
    paths = [str(checkpoints / "loopformer"), str(checkpoints / "base")]
    records = evaluate_elastic.main(
        [*paths, "--output_dir", str(tmp_path), "--max_rows", "8", "--repr_rows", "4", "--schedules", "coarse_to_fine"]
    )
    loop = {(r["schedule"], r["budget"]) for r in records[0]["results"]}
    assert {("coarse_to_fine", m) for m in range(1, 5)} <= loop
    assert {("uniform", m) for m in range(1, 5)} <= loop  # added as the reference the tables are read against
    assert "fine_to_coarse" not in {s for s, _ in loop}
    captured = capsys.readouterr()
    assert "uniform" in captured.err and "Exact match" in captured.out


@pytest.mark.parametrize("budget", ["0", "-2"])
def test_evaluate_rejects_a_generate_budget_below_one_before_any_work(tmp_path, budget):
    # it failed only after the whole evaluation; a checkpoint that does not exist shows the check comes first
    with pytest.raises(ValueError, match=rf"--generate_budgets.*{budget}.*>= 1"):
        evaluate_elastic.main(
            [
                str(tmp_path / "no-such-checkpoint"),
                "--output_dir",
                str(tmp_path / "out"),
                "--generate_budgets",
                "2",
                budget,
            ]
        )
    assert not (tmp_path / "out").exists()


def test_evaluate_rejects_a_generate_budget_above_num_loops_before_any_work(checkpoints, tmp_path, capsys):
    # a budget above L was silently dropped from the generations
    paths = [str(checkpoints / "loopformer"), str(checkpoints / "base")]
    with pytest.raises(
        ValueError,
        match=r"--generate_budgets \[9\]: .*loopformer.* num_loops L=4, so the allowed "
        r"budgets are 1\.\.4",
    ):
        evaluate_elastic.main([*paths, "--output_dir", str(tmp_path / "out"), "--generate_budgets", "2", "9"])
    assert not (tmp_path / "out").exists() and "evaluating" not in capsys.readouterr().err


# FPRM training: a flag read only by the evaluation or a callback failed after the whole run, or was ignored


def _fprm_train_refuses(tmp_path, capsys, *flags):
    """`python -m looped_training.fprm.train ... FLAGS` as a user runs it: exit status 2 and one line on stderr,
    the refusal (argparse's 195-line usage came before it once), before any work."""
    from support.bad_inputs.shared import run_as_command

    with pytest.raises(SystemExit) as exit_info:
        run_as_command("looped_training.fprm.train", [*FPRM_TINY, "--output_dir", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert not (tmp_path / "out").exists() and "data:" not in captured.out  # refused before any work
    assert len(captured.err.strip().splitlines()) == 1, captured.err[:2000]
    return captured.err


# the refused flags of fprm.train are rows of the refusal table (tests/support/bad_input_table.py); here each must also stop
# the run before any work (it used to train to the end, then fail in the evaluation, or train 0 steps and succeed)
FPRM_FLAG_ROWS = [case for case in CASES if case.area == "fprm.train" and case.setting]


@pytest.mark.parametrize("case", FPRM_FLAG_ROWS, ids=[case.given for case in FPRM_FLAG_ROWS])
def test_fprm_train_rejects_a_bad_flag_before_any_work(tmp_path, capsys, case):
    err = _fprm_train_refuses(tmp_path, capsys, *case.setting)
    assert re.search(rf"error: .*{case.message}", err)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--step", "10"], r"`--step` names a folder or step of `--model_name_or_path`, which is not given"),
        (["--eval_before_training", "true"], r"`--eval_before_training` evaluates on the test split of `--data`"),
        (["--variant", "trm", "--eval_batching", "continuous"], r"--eval_batching continuous: --variant trm runs"),
    ],
    ids=["step-without-model", "eval_before_training-without-data", "trm-continuous"],
)
def test_fprm_train_answers_contradicting_flags_in_one_line(tmp_path, capsys, flags, message):
    err = _fprm_train_refuses(tmp_path, capsys, *flags)
    assert re.search(rf"^python -m looped_training\.fprm\.train: error: {message}", err)


def test_fprm_train_takes_a_zero_time_budget_as_none_over_a_presets():
    from looped_training.fprm import train as train_fprm

    eval_args = train_fprm.parse_args(["--preset", "sudoku-cpu", "--time_budget_minutes", "0"])[2]
    assert eval_args.time_budget_minutes == 0  # `main` adds no TimeBudgetCallback for it


def _fprm_train(tmp_path, *flags):
    from looped_training.fprm import train as train_fprm

    threads = torch.get_num_threads()
    try:  # --torch_threads 1 sets it for the whole process: later tests compare against a fresh process's logits
        return train_fprm.main([*FPRM_TINY, "--output_dir", str(tmp_path), *flags])
    finally:
        torch.set_num_threads(threads)


def test_fprm_train_saves_the_model_before_the_evaluation(tmp_path, monkeypatch):
    # save_pretrained was the last line: any evaluation error lost the trained model
    from fprm_hf import FPRMForReasoning
    from looped_training.fprm import train as train_fprm

    def failing_evaluate(model, *args):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(train_fprm, "evaluate", failing_evaluate)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        _fprm_train(tmp_path)
    assert FPRMForReasoning.from_pretrained(tmp_path / "model").config.hidden_size == 32


def test_fprm_train_without_matplotlib_says_that_plots_need_the_train_extra(tmp_path, monkeypatch, capsys):
    # its last line was "wrote .../results.json, model/ and plots: " with an empty list
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed: import raises ImportError
    _fprm_train(tmp_path)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        f"wrote {tmp_path}/results.json, model/ (no plots: they need matplotlib, the package's [train] extra)"
    )
    assert not list(tmp_path.glob("*.png"))


def test_no_pin_memory_warning_without_an_accelerator(tmp_path, recwarn):
    # torch's UserWarning "'pin_memory' argument is set as true but no accelerator is found" (no --use_cpu given)
    _fprm_train(tmp_path)
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]
    args = train_loopformer.TrainingArguments(output_dir="unused", report_to="none")  # LoopFormer's, without --use_cpu
    assert args.dataloader_pin_memory is (args.device.type != "cpu")


# LoRA fine-tuning: a loop flag of the other model type, or below 1, was ignored or failed at a training step
@pytest.fixture(scope="module")
def lora_inputs(tmp_path_factory):
    from support.hub_helpers import CORPUS, fprm_task_rows, make_fprm, save_checkpoint

    root = tmp_path_factory.mktemp("lora")
    save_checkpoint(root / "loopformer", seed=0)
    make_fprm(seed=0).save_pretrained(root / "fprm")
    (root / "corpus.txt").write_text("\n".join(CORPUS))
    (root / "task.jsonl").write_text("\n".join(json.dumps(r) for r in fprm_task_rows()))
    return {
        "loopformer": [
            "--model",
            str(root / "loopformer"),
            "--train_files",
            str(root / "corpus.txt"),
            "--block_size",
            "16",
        ],
        "fprm": ["--model", str(root / "fprm"), "--task_data", str(root / "task.jsonl")],
    }


def _finetune(lora_inputs, model_type, out, *flags):
    from looped_training.finetune_lora import main as finetune_main

    return finetune_main(
        [*lora_inputs[model_type], "--output", str(out), "--batch_size", "4", "--max_steps", "1", *flags]
    )


@pytest.mark.parametrize(
    "model_type, flag, value",
    [
        ("fprm", "--max_loops", "0"),  # 0 was read as "not given": the config's cap
        ("fprm", "--max_loops", "-1"),  # failed at the first training step
        ("fprm", "--loop_budgets", "0,x"),  # ignored on FPRM
        ("loopformer", "--loop_budgets", "2,0"),
    ],
)
def test_finetune_lora_rejects_a_loop_count_below_one_before_any_work(
    lora_inputs, tmp_path, capsys, model_type, flag, value
):
    with pytest.raises(SystemExit) as exit_info:
        _finetune(lora_inputs, model_type, tmp_path / "out", flag, value)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(rf"error: `?{flag}`? must be .*(integer >= 1|positive integers), got '?{value}'?", err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "model_type, flags, message",
    [
        ("fprm", ["--loop_budgets", "2,4"], r"--loop_budgets: only for LoopFormer models, .* model_type 'fprm'"),
        ("loopformer", ["--max_loops", "3"], r"--max_loops: only for FPRM models, .* model_type 'loopformer'"),
        ("fprm", ["--dataset", "some/name"], r"--dataset: only for LoopFormer models, .* model_type 'fprm'"),
    ],
)
def test_finetune_lora_refuses_a_flag_of_the_other_model_type(lora_inputs, tmp_path, model_type, flags, message):
    # the flag was silently ignored and the fine-tuning reported success
    with pytest.raises(ValueError, match=message):
        _finetune(lora_inputs, model_type, tmp_path / "out", *flags)
    assert not (tmp_path / "out").exists()


def test_finetune_lora_rejects_a_loop_budget_above_the_models_cap_before_training(lora_inputs, tmp_path):
    # a budget is drawn per batch: one above max_loop_budget failed at whichever step first drew it
    with pytest.raises(ValueError, match=r"--loop_budgets 64: .*exceeds the largest loop budget .*max_loop_budget=32"):
        _finetune(lora_inputs, "loopformer", tmp_path / "out", "--loop_budgets", "2,64")
    assert not (tmp_path / "out").exists()


# FPRM training: resuming with other flags, a training set that gives no batch


@pytest.fixture(scope="module")
def fprm_checkpoint(tmp_path_factory):
    from looped_training.fprm import train as train_fprm

    root = tmp_path_factory.mktemp("fprm_run")
    threads = torch.get_num_threads()
    try:
        train_fprm.main(
            [
                *FPRM_TINY,
                "--output_dir",
                str(root),
                "--save_strategy",
                "steps",
                "--save_steps",
                "2",
                "--eval_max_loops",
                "4",
                "--compare_cap",
                "false",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    return root / "checkpoint-2"


@pytest.mark.parametrize(
    "flags, keys",
    [
        (
            ["--hidden_size", "64"],
            r"\['hidden_size'\] \(e\.g\. hidden_size: 32 there, 64 here\)",
        ),  # was a size mismatch
        (["--sudoku_size", "6"], r"\['grid_size', 'vocab_size'\]"),  # another grid: deep in load_state_dict
        (["--task", "maze", "--maze_size", "5"], r"\['conv_kernel_size', 'conv_type', 'grid_size'\]"),
        (["--residual_scaling", "fixed"], r"\['residual_scaling'\]"),  # dropped the α weights, then an optimizer error
        (["--halt_eps", "0.05"], r"\['halt_eps'\] \(e\.g\. halt_eps: 0\.1 there, 0\.05 here\)"),  # trained on silently
    ],
)
def test_fprm_train_refuses_to_resume_with_flags_that_build_another_model(fprm_checkpoint, tmp_path, flags, keys):
    from looped_training.fprm import train as train_fprm

    with pytest.raises(
        ValueError,
        match=rf"model config that differs from .*checkpoint-2's in {keys}.*resume with "
        r"the model and data flags of the run that wrote it",
    ):
        train_fprm.main(
            [*FPRM_TINY, "--output_dir", str(tmp_path), "--resume_from_checkpoint", str(fprm_checkpoint), *flags]
        )


def test_fprm_train_resumes_with_another_evaluation_cap(fprm_checkpoint, tmp_path):
    from looped_training.fprm import train as train_fprm

    threads = torch.get_num_threads()
    try:  # --eval_max_loops is the config's max_loops, which only the evaluation reads
        results = train_fprm.main(
            [
                *FPRM_TINY,
                "--output_dir",
                str(tmp_path),
                "--resume_from_checkpoint",
                str(fprm_checkpoint),
                "--max_steps",
                "3",
                "--eval_max_loops",
                "3",
                "--compare_cap",
                "false",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert results["train_steps"] == 3 and results["halting"]["mean_iterations"] <= 3


def test_fprm_results_are_strict_json():
    # NaN / Infinity (an empty bin's accuracy, a diverged residual) went into results.json as is: not JSON
    from looped_training.fprm.evaluate import _strict_json

    value = {"acc": float("nan"), "curve": [0.5, float("inf"), (float("-inf"), 1)], "n": 3, "name": "x"}
    assert _strict_json(value) == {"acc": None, "curve": [0.5, None, [None, 1]], "n": 3, "name": "x"}
    json.dumps(_strict_json(value), allow_nan=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["looped_training.loopformer.train", "--variant", "nope", "--output_dir", "{tmp}/run", "--use_cpu"],
            "`variant` must be one of",
        ),
        (["looped_training.fprm.train", "--task", "nope", "--output_dir", "{tmp}/run", "--use_cpu"], "nope"),
        (["looped_training.loopformer.evaluate", "{tmp}/missing", "--output_dir", "{tmp}/eval"], "missing"),
    ],
    ids=["loopformer.train", "fprm.train", "loopformer.evaluate"],
)
def test_a_user_error_is_one_line_and_exit_2(tmp_path, argv, message):
    """As argparse does for a bad flag: no traceback from inside the package for a bad value."""
    env = dict(os.environ, LOOPED_TRAINING_TRACEBACK="0")
    proc = subprocess.run(
        [sys.executable, "-m", *[a.format(tmp=tmp_path) for a in argv]],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and message in lines[-1] and lines[-1].startswith("python -m "), lines


# A saved model that lacks a tensor: transformers initialises it at random and only logs it, so an evaluation scored a
# half-random model, a LoRA run fine-tuned one and a publish pushed one. Each command now refuses it, naming the tensor.


def _without(folder, tmp_path, prefix):
    """A copy of the saved model `folder` (and its run's files beside it) whose weights lack the first tensor whose
    name starts with `prefix`; returns (copy of the model folder, the tensor's name)."""
    import shutil

    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(folder.parent if folder.name == "model" else folder, run)
    model = run / "model" if folder.name == "model" else run
    state = load_file(model / "model.safetensors")
    name = next(k for k in sorted(state) if k.startswith(prefix))
    del state[name]
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    return model, name


def test_evaluate_refuses_a_checkpoint_that_lacks_a_tensor(checkpoints, tmp_path):
    model, name = _without(checkpoints / "loopformer", tmp_path, "model.layers.0.")
    with pytest.raises(ValueError, match=rf"model.safetensors lacks 1 tensor\(s\) that .*config.json needs: {name}\."):
        evaluate_elastic.main([str(model), "--output_dir", str(tmp_path / "eval"), "--max_rows", "4"])
    assert not (tmp_path / "eval" / "elastic_eval.json").exists()


def test_fprm_evaluate_refuses_a_model_that_lacks_a_tensor(fprm_checkpoint, tmp_path):
    from looped_training.fprm import evaluate as evaluate_fprm

    model, name = _without(fprm_checkpoint.parent / "model", tmp_path, "model.layers.0.")
    with pytest.raises(ValueError, match=rf"model.safetensors lacks 1 tensor\(s\) that .*config.json needs: {name}\."):
        evaluate_fprm.main([str(model.parent), "--output_dir", str(tmp_path / "eval"), "--num_test", "2"])
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("model_type", ["loopformer", "fprm"])
def test_finetune_lora_refuses_a_base_model_that_lacks_a_tensor(lora_inputs, tmp_path, model_type):
    from pathlib import Path

    inputs = list(lora_inputs[model_type])
    model, name = _without(Path(inputs[1]), tmp_path, "model.")
    inputs[1] = str(model)
    with pytest.raises(ValueError, match=rf"lacks 1 tensor\(s\) that .*config.json needs: {name}\."):
        _finetune({model_type: inputs}, model_type, tmp_path / "out")
    assert not (tmp_path / "out").exists()
