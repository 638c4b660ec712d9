"""ShortcutConsistencyCallback: the sampler, the loss it has the model compute, its logs and its user errors."""

import random

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import loopformer_hf
from loopformer_hf import ShortcutConsistency
from support.tiny_models import randomize_modulation, tiny_loopformer_config
from looped_training.loopformer.objective import (
    ShortcutConsistencyCallback,
    sample_early_exit_trajectory,
    sample_shortcut_trajectory,
)


def test_shortcut_sampler_follows_the_spec():
    L = 8
    rng = random.Random(0)
    lengths = set()
    for _ in range(2000):
        traj = sample_shortcut_trajectory(rng, L)
        units = [round(s * L) for s in traj]
        assert all(abs(s * L - u) < 1e-12 for s, u in zip(traj, units)), traj  # on the 1/L grid
        assert all(u >= 1 for u in units) and sum(units) == L
        assert 1 <= len(traj) <= L - 1
        lengths.add(len(traj))
    assert lengths == set(range(1, L))  # S is drawn from all of {1..L-1}


def test_shortcut_sampler_first_step_is_uniform_among_feasible_multiples():
    # S = 2 with L = 4: the first step is 1/4, 2/4 or 3/4, each with probability 1/3.
    rng = random.Random(1)
    counts = {}
    for _ in range(6000):
        traj = sample_shortcut_trajectory(rng, 4)
        if len(traj) == 2:
            counts[traj[0]] = counts.get(traj[0], 0) + 1
    total = sum(counts.values())
    assert set(counts) == {0.25, 0.5, 0.75}
    assert all(abs(c / total - 1 / 3) < 0.05 for c in counts.values()), counts


def test_early_exit_sampler_is_uniform_prefix():
    rng = random.Random(0)
    for _ in range(100):
        traj = sample_early_exit_trajectory(rng, 6)
        assert 1 <= len(traj) <= 5 and len(set(traj)) == 1 and abs(sum(traj) - 1) < 1e-12


def test_sampler_is_a_function_of_seed_and_index():
    a, b = ShortcutConsistencyCallback(seed=3), ShortcutConsistencyCallback(seed=3)
    c = ShortcutConsistencyCallback(seed=4)
    seq_a = [a.sample_trajectory(i, 8, "shortcut") for i in range(50)]
    assert seq_a == [b.sample_trajectory(i, 8, "shortcut") for i in range(50)]
    assert seq_a != [c.sample_trajectory(i, 8, "shortcut") for i in range(50)]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"lambda_short": -1}, "lambda_short"),
        ({"lambda_consistency": float("inf")}, "lambda_consistency"),
        ({"consistency": "l1"}, "'l1'"),
        ({"trajectory": "random"}, "'random'"),
        ({"warmup_steps": -2}, "-2"),
        ({"seed": 1.5}, "1.5"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ShortcutConsistencyCallback(**kwargs)


def _attached(model, **kwargs):
    cb = ShortcutConsistencyCallback(**kwargs)
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    cb.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    return cb


def _batch(vocab=97, batch=3, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    return ids, labels


def test_a_training_forward_with_labels_computes_ce_full_plus_weighted_short_ce_and_mse():
    torch.manual_seed(0)
    model = randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())).train()
    cb = _attached(model, lambda_short=0.3, lambda_consistency=0.7, seed=5)
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)  # the attached callback gives the short trajectory and the λs
    trajectory = cb.sample_trajectory(0, 4, "shortcut")
    assert cb.sampled == [(0, trajectory)] and cb.micro_batches_seen == 1

    model.eval()  # an eval-mode forward draws nothing: plain CE
    with torch.no_grad():
        full = model.model(input_ids=ids).last_hidden_state
        short = model.model(input_ids=ids, step_schedule=list(trajectory)).last_hidden_state
        ce_full = model(input_ids=ids, labels=labels)
        ce_short = model(input_ids=ids, labels=labels, step_schedule=list(trajectory)).loss
        expected = ce_full.loss + 0.3 * ce_short + 0.7 * F.mse_loss(short, full)
    assert ce_full.ce_full is None and cb.micro_batches_seen == 1
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.ce_short, ce_short, rtol=1e-5, atol=1e-6)
    window = cb._window
    assert window["micro_batches"] == 1 and window["tokens"] == int((labels[:, 1:] != -100).sum())


def test_kl_option_matches_manual_kl_on_labelled_positions():
    torch.manual_seed(0)
    model = randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())).train()
    cb = _attached(model, lambda_short=0.0, lambda_consistency=1.0, consistency="kl", seed=2)
    ids, labels = _batch()
    loss = model(input_ids=ids, labels=labels).loss
    trajectory = list(cb.sampled[0][1])
    model.eval()
    with torch.no_grad():
        ce_full = model(input_ids=ids, labels=labels).loss
        short = model(input_ids=ids, step_schedule=trajectory).logits[:, :-1]
        full = model(input_ids=ids).logits[:, :-1]
        mask = labels[:, 1:] != -100
        kl = F.kl_div(
            F.log_softmax(short[mask], -1), F.log_softmax(full[mask], -1), log_target=True, reduction="batchmean"
        )
    assert kl > 0
    torch.testing.assert_close(loss.detach(), ce_full + kl, rtol=1e-5, atol=1e-6)


def test_early_exit_models_get_uniform_prefixes_and_shortcut_is_refused():
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(loop_conditioning="timestep")).train()
    cb = _attached(model)  # auto -> early_exit
    traj = cb.next_shortcut_consistency().short_step_schedule
    assert len(set(traj)) == 1
    with pytest.raises(ValueError, match="loop_conditioning='shortcut'"):
        _attached(model, trajectory="shortcut")


def test_lambda_warmup_follows_the_optimizer_step_of_each_micro_batch():
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())
    cb = ShortcutConsistencyCallback(lambda_short=0.2, lambda_consistency=0.4, warmup_steps=2)
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none", gradient_accumulation_steps=2)
    cb.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    fields = [cb.next_shortcut_consistency() for _ in range(6)]  # micro-batches of optimizer steps 0, 0, 1, 1, 2, 2
    assert [f.lambda_short for f in fields] == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.2, 0.2])
    assert [f.lambda_consistency for f in fields] == pytest.approx([0.0, 0.0, 0.2, 0.2, 0.4, 0.4])


def test_a_model_that_does_not_compute_the_objective_is_refused():
    with pytest.raises(ValueError, match="LoopFormerForCausalLM .* Linear"):
        _attached(torch.nn.Linear(2, 2))


def test_non_looped_model_is_refused():
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(num_loops=1, loop_conditioning="none"))
    with pytest.raises(ValueError, match="num_loops=1"):
        _attached(model)


def _trainer(tmp_path, callback=None, steps=3, evaluate=False, others=(), **args):
    torch.manual_seed(0)
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())
    ids, labels = _batch(batch=16, seed=1)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    if evaluate:
        args = {**dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8), **args}
        extra_datasets = {"eval_dataset": ds}
    else:
        extra_datasets = {}
    targs = TrainingArguments(
        **{
            **dict(
                output_dir=str(tmp_path),
                use_cpu=True,
                report_to="none",
                max_steps=steps,
                per_device_train_batch_size=4,
                logging_steps=1,
                save_strategy="no",
                disable_tqdm=True,
                learning_rate=1e-3,
            ),
            **args,
        }
    )
    callbacks = [callback, *others] if callback else list(others)
    return Trainer(model=model, args=targs, train_dataset=ds, **extra_datasets, callbacks=callbacks), model


class _StepCounter(TrainerCallback):
    steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def _inner_calls(model):
    """(training?, step_schedule) of each LoopFormerModel forward: a shortcut training forward runs the full
    trajectory (None) and then the short one."""
    calls = []
    model.model.register_forward_pre_hook(
        lambda m, a, kw: calls.append((m.training, kw.get("step_schedule"))), with_kwargs=True
    )
    return calls


def test_trainer_logs_the_three_terms_and_runs_two_trajectories_in_one_forward(tmp_path):
    """`Trainer(..., callbacks=[ShortcutConsistencyCallback(), anything_else])`: no collator or other argument."""
    cb, other = ShortcutConsistencyCallback(warmup_steps=2, seed=0), _StepCounter()
    trainer, model = _trainer(tmp_path, cb, evaluate=True, gradient_accumulation_steps=2, others=[other])
    outer = []
    model.register_forward_pre_hook(lambda m, a, kw: outer.append(m.training), with_kwargs=True)
    calls = _inner_calls(model)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and other.steps == 3
    for h in logs:
        assert {"ce_full", "ce_short", "consistency", "lambda_short", "lambda_consistency"} <= set(h)
    # warm-up over 2 steps: λ = λ_max · step / 2 at optimizer steps 0, 1, 2
    assert [h["lambda_short"] for h in logs] == pytest.approx([0.0, 0.05, 0.1])
    # 3 steps x 2 micro-batches: one forward each (the Trainer's), which runs the full and the short trajectory;
    # the evaluations (after steps 2 and 3, 2 batches each) run the full one and draw nothing from the sampler
    assert outer.count(True) == 6 and outer.count(False) == 4
    assert [s for training, s in calls if training] == [s for _, t in cb.sampled for s in (None, list(t))]
    assert [s for training, s in calls if not training] == [None] * 4
    assert [i for i, _ in cb.sampled] == list(range(6)) and cb.micro_batches_seen == 6
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2, 3]
    assert len(model._forward_pre_hooks) == 1 and not model._forward_hooks  # the test's own: the callback's are gone
    ids, labels = _batch()  # so a later training-mode forward is plain CE and draws nothing
    assert model.train()(input_ids=ids, labels=labels).ce_full is None and cb.micro_batches_seen == 6


def test_without_the_callback_training_is_plain_looped_lm(tmp_path):
    trainer, model = _trainer(tmp_path, steps=2)
    calls = []
    model.model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw.get("step_schedule")), with_kwargs=True)
    trainer.train()
    assert calls == [None, None]  # one full-trajectory forward per step, nothing else
    assert "ce_short" not in trainer.state.log_history[0]


def test_an_epoch_end_evaluation_gets_no_trajectory_and_draws_none(tmp_path):
    """`eval_strategy="epoch"`: the evaluation batches used to carry a short trajectory (eval_loss was the training
    objective's) and to use up sampler indices, shifting every later training trajectory."""
    cb = ShortcutConsistencyCallback(lambda_short=5.0, lambda_consistency=0.0)
    trainer, model = _trainer(
        tmp_path, cb, steps=-1, evaluate=True, num_train_epochs=2, eval_strategy="epoch", learning_rate=0.0
    )
    calls = _inner_calls(model)
    trainer.train()
    training = [s for is_training, s in calls if is_training]
    assert [s for is_training, s in calls if not is_training] == [None] * 4  # 2 evaluations x 2 batches
    assert len(training) == 16 and training == [s for _, t in cb.sampled for s in (None, list(t))]
    assert [i for i, _ in cb.sampled] == list(range(8)) and cb.micro_batches_seen == 8
    eval_losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert eval_losses == pytest.approx([trainer.evaluate()["eval_loss"]] * 2)  # lr 0: plain CE, as evaluate()


def test_resuming_with_restored_callback_states_keeps_the_trajectories(tmp_path):
    """`restore_callback_states_from_checkpoint=True` makes the Trainer replace the callback by a new instance: the
    new one is the one the model asks."""

    def run(out, resume=None, **args):
        cb = ShortcutConsistencyCallback(seed=3)
        trainer, _ = _trainer(
            out, cb, steps=4, save_strategy="steps", save_steps=2, restore_callback_states_from_checkpoint=True, **args
        )
        trainer.train(resume_from_checkpoint=resume)
        return [cb_ for cb_ in trainer.callback_handler.callbacks if isinstance(cb_, ShortcutConsistencyCallback)][0]

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "full", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.sampled == full.sampled[2:]


def test_label_smoothing_which_takes_the_labels_from_the_model_is_refused(tmp_path):
    """The Trainer computes a label-smoothed loss itself (it pops `labels`): the shortcut objective was silently
    dropped. Refused at train start; a forward given `shortcut_consistency` without labels is refused too."""
    trainer, model = _trainer(tmp_path, ShortcutConsistencyCallback(), label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1"):
        trainer.train()
    ids, _ = _batch()
    with pytest.raises(ValueError, match="`shortcut_consistency` .* needs `labels`"):
        model(ids, shortcut_consistency=ShortcutConsistency([0.5, 0.5]))


def test_kl_consistency_of_a_batch_without_labelled_tokens_is_zero_not_nan():
    torch.manual_seed(0)
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())
    ids, _ = _batch()
    labels = torch.full_like(ids, -100)
    for consistency in ("kl", "mse"):
        out = model(
            ids,
            labels=labels,
            shortcut_consistency=ShortcutConsistency([0.5, 0.5], consistency_loss=consistency),
            num_items_in_batch=torch.tensor(10),
        )
        assert out.loss.item() == 0.0 and torch.isfinite(out.consistency), consistency
