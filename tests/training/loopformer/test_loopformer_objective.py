"""The shortcut-consistency objective inside `LoopFormerForCausalLM.forward` (labels + `shortcut_consistency`)."""

import pytest
import torch
import torch.nn.functional as F

from loopformer_hf import ShortcutConsistency

SHORT = [0.5, 0.25, 0.25]


@pytest.fixture
def model(tiny_model):  # conftest's tiny model, in training mode
    return tiny_model.train()


def _batch(batch=3, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    return ids, labels


def _reference(model, ids, labels, short, lambda_short, lambda_consistency, kind, num_items=None):
    """The objective from separate forwards: CE sums over labelled tokens / num_items (default: this batch's),
    D = mean MSE of the final normed states (or KL on labelled positions) weighed by this batch's token share."""
    full, small = model(input_ids=ids), model(input_ids=ids, step_schedule=short)
    h_full, h_short = (
        model.model(input_ids=ids).last_hidden_state,
        model.model(input_ids=ids, step_schedule=short).last_hidden_state,
    )
    n = int((labels[:, 1:] != -100).sum())
    denom = n if num_items is None else num_items

    def ce_sum(logits):
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )

    if kind == "mse":
        d = F.mse_loss(h_short, h_full.detach())
    else:
        mask = labels[:, 1:] != -100
        d = F.kl_div(
            F.log_softmax(small.logits[:, :-1][mask], -1),
            F.log_softmax(full.logits[:, :-1][mask], -1),
            log_target=True,
            reduction="batchmean",
        )
    return (ce_sum(full.logits) + lambda_short * ce_sum(small.logits)) / denom + lambda_consistency * d * n / denom, {
        "ce_full": ce_sum(full.logits) / n,
        "ce_short": ce_sum(small.logits) / n,
        "consistency": d,
    }


@pytest.mark.parametrize("kind", ["mse", "kl"])
@pytest.mark.parametrize("num_items", [None, 50])
def test_forward_returns_the_combined_loss_and_its_terms(model, kind, num_items):
    ids, labels = _batch()
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    out = model(
        input_ids=ids, labels=labels, shortcut_consistency=ShortcutConsistency(SHORT, 0.3, 0.7, kind), **kwargs
    )
    with torch.no_grad():
        expected, terms = _reference(model, ids, labels, SHORT, 0.3, 0.7, kind, num_items)
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)
    for name, value in terms.items():
        torch.testing.assert_close(getattr(out, name), value, rtol=1e-5, atol=1e-6)
    assert terms["consistency"] > 0 and out.loss.requires_grad and not out.consistency.requires_grad


def test_without_a_short_trajectory_the_loss_is_the_plain_ce(model):
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    assert out.ce_full is None and out.ce_short is None and out.consistency is None
    torch.testing.assert_close(out.loss, model.loss_function(logits=out.logits, labels=labels, vocab_size=97))


def test_consistency_gradient_stops_at_the_full_trajectory(model):
    # λ1 = 0: the loss minus CE_full is λ2·MSE(stopgrad(h_full), h_short); no gradient may reach h_full through it.
    ids, labels = _batch()
    h_full = {}

    def record_first(module, args, output):  # the full trajectory runs first
        h_full.setdefault("h", output)

    hook = model.model.norm.register_forward_hook(record_first)
    try:
        out = model(input_ids=ids, labels=labels, shortcut_consistency=ShortcutConsistency(SHORT, 0.0, 1.0))
    finally:
        hook.remove()
    h_full["h"].retain_grad()
    ce_full = model.loss_function(
        logits=out.logits, labels=labels, vocab_size=97
    )  # with its graph, unlike out.ce_full
    (out.loss - ce_full).backward()
    assert torch.count_nonzero(model.model.layers[0].self_attn.q_proj.weight.grad) > 0  # the short branch does
    assert h_full["h"].grad is None or torch.count_nonzero(h_full["h"].grad) == 0


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"lambda_short": -1}, "lambda_short"),
        ({"lambda_consistency": float("inf")}, "lambda_consistency"),
        ({"consistency_loss": "l1"}, "'l1'"),
        ({"short_step_schedule": [0.5, 0.4]}, "sum to 1"),
    ],
)
def test_bad_objective_arguments_raise(model, kwargs, needle):
    ids, labels = _batch()
    with pytest.raises(ValueError, match=needle):
        model(
            input_ids=ids,
            labels=labels,
            shortcut_consistency=ShortcutConsistency(**{"short_step_schedule": SHORT, **kwargs}),
        )


@pytest.mark.parametrize("name", ["short_step_schedule", "lambda_short", "lambda_consistency", "consistency_loss"])
def test_the_former_separate_objective_arguments_are_refused_not_swallowed(model, name):
    """`**kwargs` took them silently once they left the signature: the objective would not have run."""
    ids, labels = _batch()
    with pytest.raises(TypeError, match=f"'{name}'.*ShortcutConsistency"):
        model(input_ids=ids, labels=labels, **{name: getattr(ShortcutConsistency(SHORT), name)})


def test_shortcut_consistency_is_a_frozen_value():
    value = ShortcutConsistency([0.5, 0.5], 0.2)
    assert value.short_step_schedule == (0.5, 0.5) and hash(value) == hash(ShortcutConsistency((0.5, 0.5), 0.2))
    with pytest.raises(AttributeError):
        value.lambda_short = 1.0


def test_a_dict_for_shortcut_consistency_is_refused(model):
    ids, labels = _batch()
    with pytest.raises(TypeError, match="ShortcutConsistency or None, got dict"):
        model(input_ids=ids, labels=labels, shortcut_consistency={"short_step_schedule": SHORT})
