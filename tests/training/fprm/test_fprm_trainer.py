"""FPRM training: truncated BPTT + deep supervision through FPRMTrainer, memory flat in the loop cap, the script."""

import json

import pytest
import torch
from datasets import Dataset
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file
from transformers import TrainerCallback as TransformersCallback

from support.bad_input_table import REPO
from looped_training.fprm.arguments import FPRMTrainingArguments
from looped_training.fprm.losses import stablemax_cross_entropy
from looped_training.fprm.trainer import FPRMTrainer
from support.instruments import train_memory
from support.tiny_models import sequence_fprm_config, tiny_fprm

pytestmark = pytest.mark.usefixtures("one_thread")


def training_fprm(seed=0):
    """A tiny grid FPRM in training mode, z0 drawn at std 1 and a cap of 64 iterations."""
    return tiny_fprm(seed, init_std=1.0, max_loops=64).train()


def numbered_dataset(rows=64):
    """Row i has token (i % 5) + 2 in its first cell, so tests can tell which sample occupies a carry slot."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (rows, 16), generator=g)
    ids[:, 0] = torch.arange(rows) % 5 + 2
    return Dataset.from_dict(
        {"input_ids": ids.tolist(), "labels": torch.randint(2, 7, (rows, 16), generator=g).tolist()}
    )


def make_trainer(tmp_path, model, steps, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=8,
        max_steps=steps,
        n_backward=3,
        max_segments=2,
        train_halt_eps=1e-12,
        learning_rate=1e-3,
        weight_decay=0.1,
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_drop_last=True,
        seed=0,
    )
    kwargs.update(overrides)
    return FPRMTrainer(model=model, args=FPRMTrainingArguments(**kwargs), train_dataset=numbered_dataset())


def test_alpha_parameters_get_no_weight_decay(tmp_path):
    trainer = make_trainer(tmp_path, training_fprm(), 1)
    trainer.create_optimizer()
    decay_of = {}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            decay_of[names[id(p)]] = group["weight_decay"]
    assert decay_of["model.residual_scaling.alpha1_logit"] == 0.0
    assert decay_of["model.residual_scaling.alpha2_logit"] == 0.0
    assert decay_of["model.layers.0.mlp.down_proj.weight"] == 0.1


def test_each_step_is_one_segment_with_detached_carry_and_replacement(tmp_path):
    model = training_fprm()
    trainer = make_trainer(tmp_path, model, 1)
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda mod, args: calls.append(1))
    segment_inputs, segment_states = [], []
    original = trainer.compute_loss

    def spy(m, inputs, *args, **kwargs):
        loss = original(m, inputs, *args, **kwargs)
        segment_inputs.append(trainer.carry.inputs["input_ids"][:, 0].clone())
        segment_states.append(trainer.carry.state)
        return loss

    trainer.compute_loss = spy
    trainer.args.max_steps = 5
    trainer.train()
    assert trainer.state.global_step == 5  # one optimizer step per segment
    assert len(calls) == 5 * 3  # n_backward iterations per segment, never more
    for state in segment_states:
        assert not state.hidden.requires_grad and state.hidden.grad_fn is None  # detached between segments
    iterations = [s.iterations.tolist() for s in segment_states]
    # max_segments=2: a sample runs 3 then 6 iterations, then its slot is refilled from the next batch
    assert iterations[0] == [3] * 8 and iterations[1] == [6] * 8 and iterations[2] == [3] * 8
    assert torch.equal(segment_inputs[0], segment_inputs[1])  # the same samples continue in segment 2
    assert not torch.equal(segment_inputs[1], segment_inputs[2])  # new samples in segment 3


def test_a_halted_sample_is_replaced_at_the_next_segment(tmp_path):
    model = training_fprm()
    trainer = make_trainer(tmp_path, model, 1, max_segments=100, train_halt_eps=1e3)  # everything halts at once
    trainer.train()
    # the authors' halting: the segment runs its n_backward = 3 iterations, then every sample halts
    assert trainer.carry.state.halted.all() and (trainer.carry.state.iterations == 3).all()
    before = trainer.carry.inputs["input_ids"].clone()
    trainer._refill(model, {k: torch.tensor(v) for k, v in numbered_dataset()[8:16].items()})
    assert not trainer.carry.state.halted.any() and (trainer.carry.segments == 0).all()
    assert not torch.equal(before, trainer.carry.inputs["input_ids"])


def test_truncated_bptt_memory_is_flat_in_the_loop_cap_and_full_bptt_is_not(tmp_path):
    """Small version of benchmarks/bench_fprm_memory.py (its instrument): saved activations at 8 vs 64 loops."""
    kw = dict(hidden=32, batch=4, size=4, output_dir=str(tmp_path))
    t8, t64 = train_memory(8, "truncated", **kw), train_memory(64, "truncated", **kw)
    f8, f64 = train_memory(8, "full", **kw), train_memory(64, "full", **kw)
    assert t8["iterations_per_sample"] == 8 and t64["iterations_per_sample"] == 64 == f64["iterations_per_sample"]
    assert t64["saved_activation_bytes"] / t8["saved_activation_bytes"] <= 1.2
    assert f64["saved_activation_bytes"] / f8["saved_activation_bytes"] > 4


def test_the_model_reference_says_that_gradient_checkpointing_is_refused_and_why():
    # docs/fprm_model.md did not say it, nor that truncated BPTT bounds the memory instead (the test above)
    with pytest.raises(ValueError, match="does not support activation checkpointing") as refusal:
        tiny_fprm().gradient_checkpointing_enable()
    doc = " ".join((REPO / "docs" / "fprm_model.md").read_text().split())
    assert f"`model.gradient_checkpointing_enable()` raises `ValueError: {refusal.value}`" in doc
    assert "truncated BPTT keeps the autograd graph of `--n_backward` solver iterations per step" in doc


def test_stablemax_cross_entropy_matches_its_definition():
    logits = torch.tensor([[[2.0, -1.0, 0.5]], [[-3.0, 0.0, 1.0]]])
    labels = torch.tensor([[0], [-100]])
    s = torch.tensor([3.0, 0.5, 1.5])
    expected = -torch.log(s[0] / s.sum())
    torch.testing.assert_close(stablemax_cross_entropy(logits, labels), expected)


def test_training_arguments_are_validated(tmp_path):
    with pytest.raises(ValueError, match=r"`n_backward` must be an integer >= 1, got 0"):
        FPRMTrainingArguments(output_dir=str(tmp_path), n_backward=0, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"`loss_type` must be one of \('softmax', 'stablemax'\), got 'mse'"):
        FPRMTrainingArguments(output_dir=str(tmp_path), loss_type="mse", use_cpu=True, report_to="none")


@pytest.mark.parametrize(
    "task_flags, expected_keys, plots",
    [
        (
            ["--task", "sudoku", "--sudoku_size", "4", "--num_prefix_tokens", "2", "--eval_iterations_curve", "2,4"],
            ["iterations_vs_num_blanks", "iterations_vs_rating", "accuracy_vs_iterations"],
            ["iterations_vs_num_blanks.png"],
        ),
        (
            ["--task", "s5", "--train_length", "8", "--test_length", "16"],
            ["per_prefix_accuracy", "iterations_vs_length", "accuracy_at_length"],
            ["per_prefix_accuracy.png"],
        ),
    ],
)
def test_train_script_end_to_end(tmp_path, task_flags, expected_keys, plots):
    from looped_training.fprm.train import main

    results = main(
        task_flags
        + [
            "--output_dir",
            str(tmp_path),
            "--num_train",
            "64",
            "--num_test",
            "8",
            "--hidden_size",
            "32",
            "--num_attention_heads",
            "4",
            "--intermediate_size",
            "64",
            "--max_steps",
            "4",
            "--n_backward",
            "2",
            "--max_segments",
            "2",
            "--per_device_train_batch_size",
            "8",
            "--eval_max_loops",
            "6",
            "--use_cpu",
            "true",
            "--disable_tqdm",
            "true",
            "--logging_steps",
            "2",
        ]
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ["halting", "always_cap", "halting_vs_cap"] + expected_keys:
        assert key in saved, key
    assert saved["halting"]["mean_iterations"] <= 6 and saved["always_cap"]["mean_iterations"] == 6
    assert 0 <= saved["halting"]["cell_accuracy"] <= 1 and saved["train_steps"] == 4
    assert results["halting"] == saved["halting"]
    if "per_prefix_accuracy" in expected_keys:
        assert saved["max_train_length"] == 8
    if "accuracy_vs_iterations" in expected_keys:
        assert saved["accuracy_vs_iterations"]["iterations"] == [2, 4]
    for name in plots + ["training_loss.png"]:
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "model" / "model.safetensors").exists()


def test_presets_are_defaults_that_flags_override():
    from looped_training.fprm.train import parse_args

    model_args, data_args, eval_args, train_args = parse_args(
        ["--preset", "s5-cpu", "--max_steps", "7", "--n_backward", "2"]
    )
    assert data_args.task == "s5" and train_args.max_steps == 7 and train_args.n_backward == 2
    assert model_args.init_std == 6.0 and train_args.max_segments == 16  # the file's values where no flag is given
    assert train_args.output_dir.endswith("fprm-s5-cpu")


def test_train_script_passes_min_train_length_to_state_tracking():
    from looped_training.fprm.tasks import build_task
    from looped_training.fprm.train import parse_args

    _, data_args, _, _ = parse_args(
        [
            "--task",
            "s5",
            "--train_length",
            "8",
            "--min_train_length",
            "2",
            "--num_train",
            "200",
            "--num_test",
            "2",
            "--test_length",
            "16",
        ]
    )
    ds, _, _ = build_task(data_args, seed=0)
    lengths = set(ds["train"]["length"])
    assert min(lengths) == 2 and max(lengths) == 8 and len(lengths) == 7
    # padded to the test length by default, as the authors' build_state_tracking_dataset; pad labels ignored
    assert all(len(row) == 16 for row in ds["train"]["input_ids"])
    for ids, labels, length in zip(ds["train"]["input_ids"], ds["train"]["labels"], ds["train"]["length"]):
        assert ids[length:] == [0] * (16 - length) and labels[length:] == [-100] * (16 - length)
        assert -100 not in labels[:length]
    _, unpadded, _, _ = parse_args(
        [
            "--task",
            "s5",
            "--train_length",
            "8",
            "--min_train_length",
            "2",
            "--num_train",
            "20",
            "--num_test",
            "2",
            "--test_length",
            "16",
            "--pad_train_to_test_length",
            "false",
        ]
    )
    ds, _, _ = build_task(unpadded, seed=0)
    assert all(len(row) == 8 for row in ds["train"]["input_ids"])  # padded to train_length only


def test_length_curriculum_grows_by_half_when_accuracy_reaches_the_threshold(tmp_path):
    from types import SimpleNamespace

    from looped_training.fprm.tasks.state_tracking import StateTrackingStream
    from looped_training.fprm.callbacks import LengthCurriculumCallback

    stream = StateTrackingStream("S3", min_length=2, max_length=4)
    args = FPRMTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", n_backward=2, max_segments=3
    )
    cb = LengthCurriculumCallback(stream, 9, threshold=0.9, check_steps=10, trainer_args=args)
    accuracies = [0.5, 0.95, 0.91, 0.99, 1.0]
    cb.accuracy_at_max_length = lambda model: accuracies.pop(0)  # scripted: the growth rule is what is tested
    assert args.max_segments == 3  # ceil((4 + 2) / 2) = 3 segments reach position 4
    lengths = []
    for step in range(10, 70, 5):
        cb.on_step_end(args, SimpleNamespace(global_step=step), None, model=None)
        lengths.append(stream.max_length)
    # checked every 10 steps only; 0.5 keeps 4; 0.95: 4 -> 6; 0.91: 6 -> 9 (= final); no checks after the final length
    assert lengths == [4, 4, 6, 6, 9, 9, 9, 9, 9, 9, 9, 9]
    assert args.max_segments == 6  # ceil((9 + 2) / 2)
    assert [h["max_length"] for h in cb.history] == [4, 4, 6]


def test_curriculum_and_time_budget_resume_where_the_checkpoint_left_them(tmp_path):
    """The curriculum's length, history and probe RNG and the time spent ride in trainer_state.json
    (`stateful_callbacks`): a resumed run goes on at the length the checkpoint reached (it restarted at the first
    length) and with the budget it had left (it restarted the clock)."""
    from looped_training.fprm.train import main

    flags = [
        "--task",
        "s3",
        "--train_length",
        "6",
        "--min_train_length",
        "2",
        "--curriculum_start_length",
        "2",
        "--curriculum_threshold",
        "0.01",
        "--curriculum_check_steps",
        "2",
        "--num_train",
        "0",
        "--num_test",
        "4",
        "--test_length",
        "6",
        "--hidden_size",
        "16",
        "--num_attention_heads",
        "2",
        "--intermediate_size",
        "32",
        "--n_backward",
        "2",
        "--max_segments",
        "1",
        "--per_device_train_batch_size",
        "8",
        "--eval_max_loops",
        "8",
        "--output_dir",
        str(tmp_path),
        "--use_cpu",
        "true",
        "--disable_tqdm",
        "true",
        "--conv_kernel_size",
        "2",
        "--save_strategy",
        "steps",
        "--save_steps",
        "4",
        "--time_budget_minutes",
        "60",
        "--report_to",
        "none",
    ]
    first = main([*flags, "--max_steps", "4"])
    saved = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["stateful_callbacks"]
    reached = saved["LengthCurriculumCallback"]["attributes"]["max_length"]
    assert reached == first["curriculum"][-1]["max_length"] * 3 // 2 > 2 and len(first["curriculum"]) == 2
    spent = saved["TimeBudgetCallback"]["attributes"]["elapsed_s"]
    assert spent > 0
    resumed = main([*flags, "--max_steps", "8", "--resume_from_checkpoint", "last"])
    assert resumed["curriculum"][:2] == first["curriculum"]
    assert [h["step"] for h in resumed["curriculum"]][:3] == [2, 4, 6]  # then the final length: no more checks
    assert resumed["curriculum"][2]["max_length"] == reached
    saved = json.loads((tmp_path / "checkpoint-8" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["TimeBudgetCallback"]["attributes"]["elapsed_s"] > spent


def test_train_script_length_curriculum_end_to_end(tmp_path):
    """The real probe on a model that trains for a few steps: the curriculum runs inside Trainer, raises the
    Trainer's own max_segments and is recorded in results.json."""
    from looped_training.fprm.train import main

    results = main(
        [
            "--task",
            "s3",
            "--train_length",
            "6",
            "--min_train_length",
            "2",
            "--curriculum_start_length",
            "2",
            "--curriculum_threshold",
            "0.01",
            "--curriculum_check_steps",
            "2",
            "--num_train",
            "0",
            "--num_test",
            "4",
            "--test_length",
            "8",
            "--hidden_size",
            "32",
            "--num_attention_heads",
            "4",
            "--intermediate_size",
            "64",
            "--max_steps",
            "8",
            "--n_backward",
            "2",
            "--max_segments",
            "1",
            "--per_device_train_batch_size",
            "16",
            "--eval_max_loops",
            "10",
            "--output_dir",
            str(tmp_path),
            "--use_cpu",
            "true",
            "--disable_tqdm",
            "true",
            "--conv_kernel_size",
            "2",
        ]
    )
    lengths = [h["max_length"] for h in results["curriculum"]]
    assert lengths[0] == 2 and lengths == sorted(lengths) and len(set(lengths)) > 1
    assert results["max_train_length"] >= lengths[-1] > 2  # the plot's "longest training length" line
    assert json.loads((tmp_path / "results.json").read_text())["curriculum"] == results["curriculum"]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["conv_kernel_size"] == 2 and config["vocab_size"] == 7


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--task", "sudoku", "--curriculum_start_length", "4", "--max_steps", "5"],
            r"`--curriculum_start_length` is for state tracking .*, got task 'sudoku'",
        ),
        (
            ["--task", "s5", "--train_length", "8", "--curriculum_start_length", "12", "--max_steps", "5"],
            r"`--curriculum_start_length` must lie in \[min_train_length=1, train_length=8\], got 12",
        ),
        (
            ["--task", "s5", "--curriculum_start_length", "4", "--curriculum_threshold", "1.5", "--max_steps", "5"],
            r"`--curriculum_threshold` must lie in \(0, 1\], got 1.5",
        ),
        (["--task", "s5", "--curriculum_start_length", "4"], r"set `--max_steps`"),
    ],
)
def test_curriculum_flags_are_validated(tmp_path, flags, message):
    from looped_training.fprm.train import parse_args

    with pytest.raises(ValueError, match=message):
        parse_args(flags + ["--output_dir", str(tmp_path)])


def _s3_rows(count, min_length, max_length, pad_to, seed):
    """S3 running products in the state-tracking format (token = element + 1, pad 0, padded labels -100)."""
    from looped_training.fprm.tasks.state_tracking import build_state_tracking_dataset

    ds = build_state_tracking_dataset(
        "S3",
        num_train=count,
        num_test=0,
        train_length=max_length,
        min_train_length=min_length,
        pad_train_to=pad_to,
        seed=seed,
    )["train"]
    return ds["input_ids"], ds["labels"]


def test_state_tracking_config_learns_s3_running_products(tmp_path):
    """Regression for 'S5 does not learn at all': the state-tracking configuration (causal, no positions, causal
    conv carrying the previous position's state) trained through FPRMTrainer must learn the composition table of a
    small non-abelian group and chain it over a few positions. With 16 segments per sample the optimizer memorises
    the in-flight batch instead (the 4-element product falls from 0.97 to 0.56). On the authors' step 300 steps
    were not enough (2-, 3-, 4-element products 1.0, 0.70, 0.40); 600 reach 1.0, 1.0, 0.79 (a fresh z0 per
    sample with α 0.5/0.5: 1.0, 0.985, 0.58)."""
    ids, labels = _s3_rows(4096, 2, 6, 6, seed=0)
    # one stored z0 (fixed_init) and α 0.75/0.25, on the authors' step (the conv on the state, no final norm)
    model = tiny_fprm(
        0,
        config=sequence_fprm_config(
            init_std=1.0, patience=10, gamma_train=0.95, max_loops=64, fixed_init=True, alpha1=0.75, alpha2=0.25
        ),
    ).train()
    args = FPRMTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=32,
        max_steps=600,
        n_backward=4,
        max_segments=3,
        train_halt_eps=1e-6,
        learning_rate=3e-3,
        weight_decay=0.01,
        adam_beta2=0.95,
        warmup_steps=20,
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_drop_last=True,
        seed=0,
    )
    FPRMTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": labels})).train()
    model.eval()
    test_ids, test_labels = _s3_rows(200, 6, 6, 6, seed=1)
    with torch.no_grad():
        logits = model(torch.tensor(test_ids), max_loops=16, halting=False).logits
    acc = (logits.argmax(-1) == torch.tensor(test_labels)).float().mean(0)
    assert acc[0] > 0.99  # the first running product is the element itself
    assert acc[1:4].mean() > 0.9, acc.tolist()  # 2-, 3- and 4-element products (chance 1/6)


def test_time_budget_decays_the_learning_rate_over_its_last_fraction_and_stops():
    from types import SimpleNamespace

    from transformers import get_constant_schedule_with_warmup

    from looped_training.fprm.callbacks import TimeBudgetCallback

    now = [0.0]
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=0)
    cb = TimeBudgetCallback(minutes=10, decay_fraction=0.25, clock=lambda: now[0])
    control = SimpleNamespace(should_training_stop=False)
    cb.on_train_begin(None, None, control, lr_scheduler=scheduler)
    used = []
    for seconds in (0, 300, 450, 525, 600, 660):
        now[0] = seconds
        cb.on_step_begin(None, None, control, optimizer=optimizer, lr_scheduler=scheduler)
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        assert scheduler.get_last_lr()[0] == pytest.approx(used[-1])  # what the Trainer logs is what was used
        cb.on_step_end(None, None, control)
    # full lr until 75% of the budget, then linear to 0 at 100%
    assert used == pytest.approx([1e-3, 1e-3, 1e-3, 5e-4, 0.0, 0.0])
    assert control.should_training_stop
    with pytest.raises(ValueError, match=r"`time_budget_decay_fraction` must lie in \[0, 1\], got 2"):
        TimeBudgetCallback(minutes=1, decay_fraction=2)


# ---- the authors' recipes ----------------------------------------------------------------------------------------


def test_after_segment_halting_runs_every_iteration_then_halts_per_sample(tmp_path):
    """The authors' training halting: a segment always runs its n_backward iterations (no freezing inside it); after
    it, a sample halts where its last residual < τ (or η < min_eta) and is then replaced."""

    def segment(tau, **kw):
        model = training_fprm()
        calls = []
        model.model.layers[0].register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[0]))
        trainer = make_trainer(tmp_path, model, 1, train_halt_eps=tau, n_backward=3, max_segments=50, **kw)
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.model.train()
        trainer.compute_loss(trainer.model, batch)
        return trainer.carry.state, calls

    first, _ = segment(1e-12)
    tau = float(first.residuals.median())  # splits the batch (same seed, same z0 draws)
    state, calls = segment(tau)
    assert calls == [8, 8, 8]  # all rows, all 3 iterations
    assert (state.iterations == 3).all()
    assert torch.equal(state.halted, state.residuals < tau)
    assert state.halted.any() and not state.halted.all(), "τ = the median residual should split this batch"


def test_length_generalisation_is_the_authors_metric():
    from looped_training.fprm.evaluate import length_generalisation

    correct = torch.tensor([[True, True, False, True], [True, True, True, True]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    lg = length_generalisation(correct, valid)
    assert lg["ks"] == [1, 2, 3, 4]
    # accuracy over positions 1..k, averaged over sequences; sequence accuracy: all of 1..k right
    assert lg["accuracy"] == pytest.approx([1.0, 1.0, (2 / 3 + 1) / 2, (3 / 4 + 1) / 2])
    assert lg["sequence_accuracy"] == pytest.approx([1.0, 1.0, 0.5, 0.5])


def _parse_preset(name, tmp_path):
    """The preset's arguments; an accelerator preset (`forward_dtype: bfloat16`, bf16 autocast, which a machine without
    an accelerator refuses: tests/training/fprm/test_presets_authors.py) is parsed with `--forward_dtype float32`, and
    a -gpu one fits 10 minutes."""
    import yaml

    from looped_training.fprm.train import PRESETS_DIR, parse_args

    with open(f"{PRESETS_DIR}/{name}.yaml") as f:
        accelerator = yaml.safe_load(f).get("forward_dtype") == "bfloat16"
    args = parse_args(["--preset", name, *(["--forward_dtype", "float32"] if accelerator else [])])
    if name.endswith("-gpu"):
        assert accelerator
        assert args[2].time_budget_minutes <= 10
    return args


@pytest.mark.parametrize("name", ["s5", "a5", "s5-cpu", "a5-cpu", "s5-gpu", "a5-gpu"])
def test_state_tracking_presets_read_like_the_authors_configs(name, tmp_path):
    model_args, data_args, eval_args, train_args = _parse_preset(name, tmp_path)
    assert data_args.task == name[:2]
    # train on length exactly 32, test 1000 sequences of length 128
    assert (data_args.train_length, data_args.min_train_length, data_args.curriculum_start_length) == (32, None, None)
    assert (data_args.num_test, data_args.test_length) == (1000, 128)
    assert (model_args.init_std, model_args.alpha1, model_args.alpha2, model_args.conv_kernel_size) == (
        6.0,
        0.5,
        0.5,
        4,
    )
    assert model_args.fixed_init is False
    assert (train_args.n_backward, train_args.loss_type) == (4, "stablemax")
    assert (model_args.patience, model_args.gamma_train) == ((10, 0.95) if name.startswith("s5") else (5, 0.9))
    assert eval_args.eval_max_loops == 160
    if name.endswith("-cpu"):
        assert eval_args.time_budget_minutes <= 12


@pytest.mark.parametrize("name", ["sudoku", "sudoku-cpu", "sudoku-gpu", "maze", "maze-cpu", "maze-gpu"])
def test_grid_presets_read_like_the_authors_configs(name, tmp_path):
    model_args, data_args, eval_args, train_args = _parse_preset(name, tmp_path)
    assert (model_args.alpha1, model_args.alpha2, model_args.init_std) == (0.75, 0.25, 6.0)
    assert (train_args.n_backward, train_args.loss_type) == (6, "stablemax")
    assert train_args.max_segments == (12 if name.startswith("sudoku") else 24)
    assert model_args.norm_placement == ("none" if name.startswith("sudoku") else "output")


# ---- review fixes: resume, Trainer arguments, the evaluation ------------------------------------------------------


def test_time_budget_decay_resumes_at_the_learning_rate_the_uninterrupted_run_uses():
    """The scheduler's state in a checkpoint holds the base learning rates the callback had already scaled down; a
    resumed run took those as its base and scaled them again (lr = base · f_saved · f_now, too low)."""
    from transformers import get_constant_schedule_with_warmup
    from transformers.trainer_callback import TrainerState

    from looped_training.fprm.callbacks import TimeBudgetCallback

    def run(seconds, resume_from=None):
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=0)
        now = [seconds[0]]
        cb = TimeBudgetCallback(minutes=10, decay_fraction=0.5, clock=lambda: now[0])
        state = TrainerState(stateful_callbacks=[cb])
        if resume_from is not None:
            optimizer.load_state_dict(resume_from["optimizer"])
            scheduler.load_state_dict(resume_from["scheduler"])  # as Trainer does, before on_train_begin
            state = TrainerState(stateful_callbacks=resume_from["callbacks"])
        cb.on_train_begin(None, state, None, lr_scheduler=scheduler)
        used = []
        for t in seconds:
            now[0] = t
            cb.on_step_begin(None, state, None, optimizer=optimizer, lr_scheduler=scheduler)
            used.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        saved = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "callbacks": {"TimeBudgetCallback": cb.state()},
        }
        return used, saved

    uninterrupted, _ = run([0, 400, 450])
    first, saved = run([0, 400])  # the decay (over the last 300 s) has begun: lr 2/3 of the base at 400 s
    resumed, _ = run([400, 450], resume_from=saved)  # the resumed process's clock starts again at 400 s of spent time
    assert first == pytest.approx(uninterrupted[:2])
    assert resumed[1] == pytest.approx(uninterrupted[2])  # 1e-3 · (600 - 450) / 300 = 5e-4


def test_label_smoothing_and_compute_loss_func_which_fprm_trainer_does_not_apply_are_refused(tmp_path):
    # label_smoothing_factor trained silently without smoothing (compute_loss is FPRM's own segment loss)
    with pytest.raises(ValueError, match=r"`label_smoothing_factor` .*got 0\.1.* use 0"):
        FPRMTrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"`compute_loss_func` .*got <lambda>.*loss_type"):
        FPRMTrainer(
            model=training_fprm(),
            args=FPRMTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
            train_dataset=numbered_dataset(),
            compute_loss_func=lambda outputs, labels, **kw: outputs.loss,
        )


def test_a_training_batch_without_labels_is_a_clear_error(tmp_path):
    # was KeyError: 'labels' deep in the segment step
    trainer = make_trainer(tmp_path, training_fprm(), 1)
    trainer.train_dataset = numbered_dataset().remove_columns("labels")
    with pytest.raises(ValueError, match=r"needs `labels` .*got \['input_ids'\]"):
        trainer.train()


def test_eval_gamma_applies_to_the_iterations_curve_too(tmp_path):
    """`--eval_gamma` set γ for every evaluation but the stability curve (`--eval_iterations_curve`), which ran with
    the config's gamma_eval: its numbers came from another solver than the rest of results.json."""
    from types import SimpleNamespace

    from datasets import DatasetDict

    from looped_training.fprm.evaluate import evaluate

    model = training_fprm().eval()
    gammas = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: gammas.append(kwargs.get("gamma")), with_kwargs=True)
    test = numbered_dataset(4).add_column("num_blanks", [1, 2, 3, 4])
    data_args = SimpleNamespace(task="sudoku", test_length=0, arc_max_grid=0)
    eval_args = SimpleNamespace(
        eval_max_loops=4,
        eval_halt_eps=None,
        eval_gamma=0.5,
        eval_batch_size=2,
        eval_batching=None,
        compare_cap=False,
        eval_iterations_curve="2,4",
    )
    results = evaluate(model, DatasetDict({"test": test}), data_args, eval_args, ["num_blanks"])
    assert results["accuracy_vs_iterations"]["gamma"] == 0.5
    assert gammas[1:] == [0.5] * (len(gammas) - 1)  # every call after the warm-up


def test_evaluation_sees_every_sample_with_the_drop_last_that_training_needs(tmp_path):
    """dataloader_drop_last (the carry keeps one batch shape) also dropped the last partial batch of an evaluation:
    eval_loss and compute_metrics covered 16 of 20 samples."""
    seen = []

    def metrics(eval_pred):
        seen.append(eval_pred.label_ids.shape[0])
        return {}

    trainer = make_trainer(tmp_path, training_fprm(), 1, per_device_eval_batch_size=8)
    trainer.compute_metrics = metrics
    trainer.evaluate(numbered_dataset(20))
    assert seen == [20]
    trainer.train_dataset = numbered_dataset(20)
    assert len(trainer.get_train_dataloader()) == 2  # training keeps it: 2 full batches of 8


def test_train_script_evaluates_during_training_when_asked(tmp_path):
    # --eval_strategy steps failed after the data was built: "you didn't pass an eval_dataset to Trainer"
    from looped_training.fprm.train import main

    threads = torch.get_num_threads()
    try:
        results = main(
            [
                "--task",
                "sudoku",
                "--sudoku_size",
                "4",
                "--output_dir",
                str(tmp_path),
                "--num_train",
                "32",
                "--num_test",
                "10",
                "--hidden_size",
                "32",
                "--intermediate_size",
                "64",
                "--max_steps",
                "2",
                "--per_device_train_batch_size",
                "8",
                "--per_device_eval_batch_size",
                "4",
                "--eval_max_loops",
                "4",
                "--use_cpu",
                "true",
                "--disable_tqdm",
                "true",
                "--compare_cap",
                "false",
                "--eval_strategy",
                "steps",
                "--eval_steps",
                "1",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    evals = [e for e in results["log_history"] if "eval_loss" in e]
    assert [e["step"] for e in evals] == [1, 2]
    last = evals[-1]
    # the metrics of the test split, as the final evaluation computes them (every sample, the same solver cap)
    assert last["eval_cell_accuracy"] == pytest.approx(results["halting"]["cell_accuracy"])
    assert last["eval_exact_accuracy"] == pytest.approx(results["halting"]["exact_accuracy"])
    assert last["eval_mean_iterations"] == pytest.approx(results["halting"]["mean_iterations"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(lr_schedule="cosine"), r"`lr_schedule` must be one of \('trainer', 'authors'\), got 'cosine'"),
        (dict(loss_normalization="batch"), r"`loss_normalization` must be one of \('sample', 'token'\), got 'batch'"),
        (dict(puzzle_emb_optimizer="sgd"), r"`puzzle_emb_optimizer` must be one of \('adamw', 'signsgd'\), got 'sgd'"),
        (dict(ema_decay=1.0), r"`ema_decay` must be None \(off\) or a number in \(0, 1\).*got 1.0"),
        (dict(puzzle_emb_lr=-1e-3), r"`puzzle_emb_lr` must be None or a finite number >= 0, got -0.001"),
        (dict(q_loss_coefficient=float("nan")), r"`q_loss_coefficient` must be None or a finite number >= 0, got nan"),
    ],
)
def test_authors_recipe_arguments_are_validated(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        FPRMTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)


def test_authors_recipe_options_that_the_model_cannot_follow_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"`q_loss_coefficient=0.5` needs a model with a Q-head"):
        make_trainer(tmp_path, training_fprm(), 1, q_loss_coefficient=0.5)
    no_prefix = tiny_fprm(0, num_prefix_tokens=0).train()
    with pytest.raises(ValueError, match=r"`puzzle_emb_optimizer='signsgd'` trains the prefix rows"):
        make_trainer(tmp_path, no_prefix, 1, puzzle_emb_optimizer="signsgd")
    with pytest.raises(
        StrictDataclassError, match=r"`puzzle_emb_ndim` \(65\) must be at most num_prefix_tokens × hidden_size"
    ):
        tiny_fprm(0, puzzle_emb_ndim=65)
    with pytest.raises(StrictDataclassError, match=r"(?s)field .puzzle_emb_ndim.*positive integer, got 0"):
        tiny_fprm(0, puzzle_emb_ndim=0)


def test_defaults_do_not_clip_and_the_authors_lr_rule_starts_at_lr_over_w(tmp_path):
    trainer = make_trainer(tmp_path, training_fprm(), 3, lr_schedule="authors", warmup_steps=4)
    assert trainer.args.max_grad_norm == 0
    lrs = []
    trainer.add_callback(
        type(
            "LR",
            (TransformersCallback,),
            {
                "on_pre_optimizer_step": lambda self, args, state, control, optimizer=None, **k: lrs.append(
                    optimizer.param_groups[0]["lr"]
                )
            },
        )()
    )
    trainer.train()
    assert lrs == pytest.approx([1e-3 / 4, 2e-3 / 4, 3e-3 / 4])


def test_ema_is_what_evaluation_and_the_saved_model_use_and_survives_a_resume(tmp_path):
    model = tiny_fprm(0, puzzle_emb_ndim=40, use_q_head=True).train()
    trainer = make_trainer(
        tmp_path, model, 2, ema_decay=0.5, puzzle_emb_optimizer="signsgd", save_strategy="steps", save_steps=2
    )
    start = {n: p.detach().clone() for n, p in trainer.ema_parameters()}
    trainer.train()
    assert {n for n, _ in trainer.ema_parameters()} == set(trainer.ema) and "model.prefix" not in trainer.ema
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(trainer.ema[name], start[name])
    assert not torch.equal(trainer.ema[name], dict(trainer.ema_parameters())[name])
    saved = load_file(str(tmp_path / "checkpoint-2" / "fprm_ema.safetensors"))
    torch.testing.assert_close(saved[name], trainer.ema[name])
    trained, ema = dict(trainer.ema_parameters())[name].clone(), trainer.ema[name].clone()
    trainer.swap_ema()
    torch.testing.assert_close(dict(trainer.ema_parameters())[name], ema)
    trainer.swap_ema()
    torch.testing.assert_close(dict(trainer.ema_parameters())[name], trained)
    # a resumed run starts from the checkpoint's shadow, not from its own weights
    resumed = make_trainer(
        tmp_path,
        tiny_fprm(0, puzzle_emb_ndim=40, use_q_head=True).train(),
        2,
        ema_decay=0.5,
        puzzle_emb_optimizer="signsgd",
    )
    seen = []
    resumed.add_callback(
        type(
            "Seen",
            (TransformersCallback,),
            {"on_train_begin": lambda self, args, state, control, **k: seen.append(resumed.ema[name].clone())},
        )()
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    torch.testing.assert_close(seen[0], ema)
    with pytest.raises(ValueError, match=r"has no fprm_ema.safetensors"):
        plain = make_trainer(tmp_path / "plain", training_fprm(), 1, save_strategy="steps", save_steps=1)
        plain.train()
        make_trainer(tmp_path / "plain", training_fprm(), 1, ema_decay=0.9).train(
            resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1")
        )


def test_stablemax_gradient_is_finite_at_a_logit_of_one():
    """Their s(x) = 1/(1 − x + 1e-30) for x < 0: at x = 1 the unused branch of torch.where stays finite, where
    1/(1 − x) made every gradient NaN (a logit of exactly 1.0 is common in bf16)."""
    logits = torch.tensor([[[1.0, -2.0, 0.5], [-1e30, 3.0, 1.0]]], requires_grad=True)
    labels = torch.tensor([[0, -100]])
    loss = stablemax_cross_entropy(logits, labels)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()


def test_variant_trm_trains_evaluates_and_resumes(tmp_path):
    """`--variant trm`: TRMTrainer trains the TRM config; the evaluation runs halt_max_steps ACT steps for every
    sample (flat iterations) and reports the per-prefix curve; a checkpoint holds TRM's carry (TRMState)."""
    from support.tiny_runs import run_fprm

    trm = ["--variant", "trm", "--H_cycles", "2", "--L_cycles", "1", "--halt_max_steps", "2", "--conv_type", "none"]
    results = run_fprm(tmp_path / "run", *trm)
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert (config["recursion"], config["conv_type"], config["n_backwards_L"]) == ("trm", "none", 1)
    assert results["recursion"] == "trm" and "always_cap" not in results
    per_step = (2 - 1) * (1 + 1) + 1 + 1
    assert results["halting"]["mean_iterations"] == 2 * per_step
    assert all(row["mean_iterations"] == 2 * per_step for row in results["iterations_vs_length"])
    assert len(results["per_prefix_accuracy"]) == 4
    # the checkpoint's carry reads back as TRM's state (what a resume restores)
    from safetensors.torch import load_file

    from fprm_hf.recursion_trm import TRMState
    from looped_training.fprm.trainer import Carry

    carry = Carry.from_tensors(load_file(tmp_path / "run" / "checkpoint-3" / "fprm_carry.safetensors"), TRMState)
    assert carry.state.z_L.shape == carry.state.hidden.shape and carry.state.steps.max() <= 2
    assert torch.equal(carry.segments, carry.state.steps)
