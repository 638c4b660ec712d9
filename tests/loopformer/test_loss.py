"""loss_loopformer.py: the shortcut-consistency objective `CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)`,
checked against a direct computation of each term with torch's functional losses, and the checks of its inputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from loopformer_hf.loss_loopformer import (
    ShortcutConsistency,
    check_consistency_args,
    check_labels,
    check_shortcut_consistency,
    shortcut_consistency_loss,
)

VOCAB, BATCH, SEQ, HIDDEN = 11, 2, 5, 4


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=g)
    short_logits = torch.randn(BATCH, SEQ, VOCAB, generator=g)
    h_full = torch.randn(BATCH, SEQ, HIDDEN, generator=g, requires_grad=True)
    h_short = torch.randn(BATCH, SEQ, HIDDEN, generator=g, requires_grad=True)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, 2] = -100
    return logits, h_full, short_logits, h_short, labels


def _mean_ce(logits, labels):  # next-token CE, the mean over labelled targets, written out position by position
    terms = [
        -F.log_softmax(logits[b, i], -1)[labels[b, i + 1]]
        for b in range(BATCH)
        for i in range(SEQ - 1)
        if labels[b, i + 1] != -100
    ]
    return torch.stack(terms).mean(), len(terms)


def test_mse_objective_is_the_weighted_sum_of_its_three_terms():
    logits, h_full, short_logits, h_short, labels = _inputs()
    loss, terms, tokens = shortcut_consistency_loss(logits, h_full, short_logits, h_short, labels, 0.3, 0.7, "mse")
    ce_full, n = _mean_ce(logits, labels)
    ce_short, _ = _mean_ce(short_logits, labels)
    mse = ((h_short - h_full) ** 2).mean()
    assert tokens == n == BATCH * (SEQ - 1) - 1
    torch.testing.assert_close(loss, ce_full + 0.3 * ce_short + 0.7 * mse)
    torch.testing.assert_close(terms["ce_full"], ce_full)
    torch.testing.assert_close(terms["ce_short"], ce_short)
    torch.testing.assert_close(terms["consistency"], mse)


def test_the_full_trajectorys_states_are_a_stopgrad_target():
    logits, h_full, short_logits, h_short, labels = _inputs()
    loss, _, _ = shortcut_consistency_loss(logits, h_full, short_logits, h_short, labels, 0.1, 1.0, "mse")
    loss.backward()
    assert h_full.grad is None and h_short.grad is not None and h_short.grad.abs().sum() > 0


def test_kl_objective_compares_next_token_distributions_on_labelled_positions():
    logits, h_full, short_logits, h_short, labels = _inputs(seed=1)
    _, terms, _ = shortcut_consistency_loss(logits, h_full, short_logits, h_short, labels, 0.0, 1.0, "kl")
    kls = [
        (F.softmax(logits[b, i], -1) * (F.log_softmax(logits[b, i], -1) - F.log_softmax(short_logits[b, i], -1))).sum()
        for b in range(BATCH)
        for i in range(SEQ - 1)
        if labels[b, i + 1] != -100
    ]
    torch.testing.assert_close(terms["consistency"], torch.stack(kls).mean())


def test_num_items_in_batch_divides_the_cross_entropy_sums():
    logits, h_full, short_logits, h_short, labels = _inputs()
    alone, _, n = shortcut_consistency_loss(logits, h_full, short_logits, h_short, labels, 0.5, 0.0, "mse")
    scaled, _, _ = shortcut_consistency_loss(
        logits, h_full, short_logits, h_short, labels, 0.5, 0.0, "mse", num_items_in_batch=4 * n
    )
    torch.testing.assert_close(scaled, alone / 4)


def test_shift_labels_are_taken_as_the_targets_of_each_position():
    logits, h_full, short_logits, h_short, labels = _inputs()
    shifted = torch.cat([labels[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    by_labels, _, _ = shortcut_consistency_loss(logits, h_full, short_logits, h_short, labels, 0.2, 0.0, "mse")
    by_shift, _, _ = shortcut_consistency_loss(
        logits, h_full, short_logits, h_short, None, 0.2, 0.0, "mse", shift_labels=shifted
    )
    torch.testing.assert_close(by_shift, by_labels)


def test_check_labels_refuses_wrong_shapes_types_and_ids():
    check_labels(torch.tensor([[1, -100]]), None, (1, 2), VOCAB)
    for bad, message in (
        (torch.tensor([[1.0, 2.0]]), "integer tensor"),
        (torch.tensor([[1, 2, 3]]), r"shape of the input \(1, 2\)"),
        (torch.tensor([[1, VOCAB]]), f"got \\[{VOCAB}\\]"),
        (torch.tensor([[-5, 1]]), r"got \[-5\]"),
        ([[1, 2]], "got list"),
    ):
        with pytest.raises(ValueError, match=message):
            check_labels(bad, None, (1, 2), VOCAB)
    with pytest.raises(ValueError, match="`shift_labels`"):
        check_labels(None, torch.tensor([[True, False]]), (1, 2), VOCAB)


def test_shortcut_consistency_is_frozen_and_checks_its_weights():
    value = ShortcutConsistency([0.5, 0.5], lambda_short=0.2)
    assert value.short_step_schedule == (0.5, 0.5) and hash(value) == hash(ShortcutConsistency((0.5, 0.5), 0.2))
    with pytest.raises(AttributeError):
        value.lambda_short = 1.0
    for kwargs in ({"lambda_short": -1}, {"lambda_consistency": math.inf}, {"lambda_short": True}):
        with pytest.raises(ValueError, match="finite number >= 0"):
            ShortcutConsistency((1.0,), **kwargs)
    with pytest.raises(ValueError, match="one of"):
        check_consistency_args(0.1, 0.1, "l1")


def test_check_shortcut_consistency_refuses_the_former_arguments_and_a_missing_label():
    value = ShortcutConsistency((1.0,))
    assert check_shortcut_consistency(None, {}) is None
    assert check_shortcut_consistency(value, {}, labels=torch.zeros(1, 1)) is value
    with pytest.raises(TypeError, match="lambda_short"):
        check_shortcut_consistency(None, {"lambda_short": 0.1})
    with pytest.raises(TypeError, match="got dict"):
        check_shortcut_consistency({"short_step_schedule": (1.0,)}, {})
    with pytest.raises(ValueError, match="needs `labels`"):
        check_shortcut_consistency(value, {})
