"""ShortcutConsistencyCallback: the sampler, the loss it installs, its logs and its user errors."""

import random

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

import loopformer_hf
from conftest import randomize_modulation, tiny_loopformer_config
from training.loopformer.objective import (ShortcutConsistencyCallback, sample_early_exit_trajectory,
                                sample_shortcut_trajectory)


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


@pytest.mark.parametrize("kwargs, needle", [
    ({"lambda_short": -1}, "lambda_short"),
    ({"lambda_consistency": float("inf")}, "lambda_consistency"),
    ({"consistency": "l1"}, "'l1'"),
    ({"trajectory": "random"}, "'random'"),
    ({"warmup_steps": -2}, "-2"),
    ({"seed": 1.5}, "1.5"),
])
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


def test_loss_is_ce_full_plus_weighted_short_ce_and_mse():
    torch.manual_seed(0)
    model = randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())).train()
    cb = _attached(model, lambda_short=0.3, lambda_consistency=0.7, seed=5)
    ids, labels = _batch()
    outputs = model(input_ids=ids)
    loss = cb.compute_loss(outputs, labels)
    trajectory = cb.sampled[-1][1]
    assert trajectory == cb.sample_trajectory(0, 4, "shortcut")

    with torch.no_grad():
        full = model.model(input_ids=ids).last_hidden_state
        short = model.model(input_ids=ids, step_schedule=list(trajectory)).last_hidden_state
        ce_full = model(input_ids=ids, labels=labels).loss
        ce_short = model(input_ids=ids, labels=labels, step_schedule=list(trajectory)).loss
        expected = ce_full + 0.3 * ce_short + 0.7 * F.mse_loss(short, full)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_consistency_gradient_stops_at_the_full_trajectory():
    # Only consistency (λ1 = 0): the gradient of λ2·MSE(stopgrad(h_full), h_short) wrt h_full must be zero,
    # so the loss minus CE_full has the same gradient as MSE through the short branch alone.
    torch.manual_seed(0)
    model = randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())).train()
    cb = _attached(model, lambda_short=0.0, lambda_consistency=1.0, seed=0)
    ids, labels = _batch()
    outputs = model(input_ids=ids)
    h_full = cb._captured_hidden
    h_full.retain_grad()
    loss = cb.compute_loss(outputs, labels)
    ce_full = model.loss_function(logits=outputs.logits, labels=labels, vocab_size=97)
    (loss - ce_full).backward()
    assert h_full.grad is None or torch.count_nonzero(h_full.grad) == 0


def test_kl_option_matches_manual_kl_on_labelled_positions():
    torch.manual_seed(0)
    model = randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())).train()
    cb = _attached(model, lambda_short=0.0, lambda_consistency=1.0, consistency="kl", seed=2)
    ids, labels = _batch()
    outputs = model(input_ids=ids)
    loss = cb.compute_loss(outputs, labels)
    trajectory = list(cb.sampled[-1][1])
    with torch.no_grad():
        ce_full = model(input_ids=ids, labels=labels).loss
        short = model(input_ids=ids, step_schedule=trajectory).logits[:, :-1]
        full = outputs.logits[:, :-1]
        mask = labels[:, 1:] != -100
        kl = F.kl_div(F.log_softmax(short[mask], -1), F.log_softmax(full[mask], -1), log_target=True,
                      reduction="batchmean")
    assert kl > 0
    torch.testing.assert_close(loss.detach(), ce_full + kl, rtol=1e-5, atol=1e-6)


def test_early_exit_models_get_uniform_prefixes_and_shortcut_is_refused():
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(loop_conditioning="timestep")).train()
    cb = _attached(model)  # auto -> early_exit
    ids, labels = _batch()
    cb.compute_loss(model(input_ids=ids), labels)
    traj = cb.sampled[-1][1]
    assert len(set(traj)) == 1
    with pytest.raises(ValueError, match="loop_conditioning='shortcut'"):
        _attached(model, trajectory="shortcut")


def test_compute_loss_without_the_callback_registered_is_a_clear_error():
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())
    ids, labels = _batch()
    with pytest.raises(ValueError, match="trainer_kwargs"):
        ShortcutConsistencyCallback().compute_loss(model(input_ids=ids), labels)


def test_non_looped_model_is_refused():
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(num_loops=1, loop_conditioning="none"))
    with pytest.raises(ValueError, match="num_loops=1"):
        _attached(model)


def _trainer(tmp_path, callback=None, steps=3, **args):
    torch.manual_seed(0)
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config())
    ids, labels = _batch(batch=16, seed=1)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    targs = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=steps,
                              per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                              disable_tqdm=True, learning_rate=1e-3, **args)
    extra = callback.trainer_kwargs() if callback else {}
    return Trainer(model=model, args=targs, train_dataset=ds, **extra), model


def test_trainer_logs_the_three_terms_and_runs_two_trajectories(tmp_path):
    cb = ShortcutConsistencyCallback(warmup_steps=2, seed=0)
    trainer, model = _trainer(tmp_path, cb, gradient_accumulation_steps=2)
    calls = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw.get("step_schedule")), with_kwargs=True)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h in logs:
        assert {"ce_full", "ce_short", "consistency", "lambda_short", "lambda_consistency"} <= set(h)
    # warm-up over 2 steps: λ = λ_max · step / 2 at optimizer steps 0, 1, 2
    assert [h["lambda_short"] for h in logs] == pytest.approx([0.0, 0.05, 0.1])
    # 3 steps x 2 micro-batches, each: the Trainer's full forward (no schedule) then one shortcut forward
    assert len(calls) == 12 and calls[0::2] == [None] * 6
    assert [tuple(c) for c in calls[1::2]] == [t for _, t in cb.sampled]
    assert [i for i, _ in cb.sampled] == list(range(6)) and cb.micro_batches_seen == 6


def test_without_the_callback_training_is_plain_looped_lm(tmp_path):
    trainer, model = _trainer(tmp_path, steps=2)
    calls = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw.get("step_schedule")), with_kwargs=True)
    trainer.train()
    assert calls == [None, None]  # one full-trajectory forward per step, nothing else
    assert "ce_short" not in trainer.state.log_history[0]
