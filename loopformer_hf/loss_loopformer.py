"""LoopFormer's shortcut-consistency objective (spec, "Training: shortcut consistency"), computed by
`LoopFormerForCausalLM.forward` from the logits and final normed states of the full and the short trajectory:

    loss = CE_full + λ1·CE_short + λ2·D(stopgrad(h_full), h_short)

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CONSISTENCY_LOSSES = ("mse", "kl")


def check_labels(labels, shift_labels, shape, vocab_size):
    """Raise `ValueError` unless `labels` (and `shift_labels`, if given) are integer tensors of the input's `shape`
    (batch, seq_len) holding token ids in [0, vocab_size) or -100 (ignored): cross-entropy would fail with a raw
    torch error (a device-side assert on CUDA), or broadcast a wrong shape."""
    for name, value in (("labels", labels), ("shift_labels", shift_labels)):
        if value is None:
            continue
        if (
            not isinstance(value, torch.Tensor)
            or value.is_floating_point()
            or value.dtype == torch.bool
            or tuple(value.shape) != tuple(shape)
        ):
            got = (
                f"Tensor {tuple(value.shape)} {value.dtype}"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise ValueError(
                f"`{name}` must be an integer tensor of the shape of the input {tuple(shape)} (batch, "
                f"seq_len), got {got}."
            )
        bad = value[(value != -100) & ((value < 0) | (value >= vocab_size))]
        if bad.numel():
            raise ValueError(
                f"`{name}` must lie in [0, {vocab_size - 1}] (vocab_size={vocab_size}) or be -100 "
                f"(ignored), got {sorted(set(bad.unique()[:5].tolist()))}."
            )


def _next_token_pairs(logits, labels, shift_labels=None):
    """(logits, targets) of next-token prediction: `labels` shifted by one, or `shift_labels` as given (one target
    per position, the last one the token after the window), as transformers' `ForCausalLMLoss` takes them."""
    if shift_labels is not None:
        return logits, shift_labels.to(logits.device)
    return logits[:, :-1], labels[:, 1:].to(logits.device)


def _token_ce_sum(logits, labels, shift_labels=None):
    """Sum of next-token cross-entropies over labelled positions, and their number."""
    logits, labels = _next_token_pairs(logits, labels, shift_labels)
    logits = logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return ce, int((labels != -100).sum())


def check_lambdas(lambda_short, lambda_consistency):
    """λ1 and λ2 are finite numbers >= 0 (a NaN or a negative weight would train on a meaningless loss)."""
    for name, value in (("lambda_short", lambda_short), ("lambda_consistency", lambda_consistency)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")


def check_consistency_args(lambda_short, lambda_consistency, consistency_loss):
    check_lambdas(lambda_short, lambda_consistency)
    if consistency_loss not in CONSISTENCY_LOSSES:
        raise ValueError(f"`consistency_loss` must be one of {CONSISTENCY_LOSSES}, got {consistency_loss!r}.")


@dataclass(frozen=True)
class ShortcutConsistency:
    """The shortcut-consistency objective's inputs for one training forward with labels: the short trajectory (step
    sizes summing to 1), λ1, λ2 and the distance D (`"mse"` of the final normed hidden states, as the reference, or
    `"kl"` of the next-token distributions on labelled positions). looped_training's ShortcutConsistencyCallback hands
    one to each training forward; pass one yourself to compute the objective outside a Trainer."""

    short_step_schedule: tuple
    lambda_short: float = 0.1
    lambda_consistency: float = 0.1
    consistency_loss: str = "mse"

    def __post_init__(self):
        if isinstance(self.short_step_schedule, (list, tuple)):  # hashable and immutable, as the rest
            object.__setattr__(self, "short_step_schedule", tuple(self.short_step_schedule))
        check_consistency_args(self.lambda_short, self.lambda_consistency, self.consistency_loss)


# What `LoopFormerForCausalLM.forward` took before the objective's inputs became one `ShortcutConsistency`.
SHORTCUT_FORWARD_KWARGS = ("short_step_schedule", "lambda_short", "lambda_consistency", "consistency_loss")


def check_shortcut_consistency(value, kwargs, labels=None):
    """`value` if it is a `ShortcutConsistency` or None; a `TypeError` for anything else, or for the former separate
    arguments, which `**kwargs` would otherwise swallow and the objective silently not run; a `ValueError` without
    `labels`, which the objective needs."""
    old = [name for name in SHORTCUT_FORWARD_KWARGS if name in kwargs]
    if old:
        raise TypeError(
            f"`forward` got {old} as separate arguments; it takes the shortcut-consistency inputs as one "
            f"`shortcut_consistency=ShortcutConsistency(short_step_schedule, lambda_short=0.1, "
            f"lambda_consistency=0.1, consistency_loss='mse')`."
        )
    if value is not None and not isinstance(value, ShortcutConsistency):
        raise TypeError(f"`shortcut_consistency` must be a ShortcutConsistency or None, got {type(value).__name__}.")
    if value is not None and labels is None:
        raise ValueError(
            "`shortcut_consistency` is part of the shortcut-consistency loss and needs `labels` (a Trainer that "
            "computes the loss itself, e.g. with `label_smoothing_factor` or `compute_loss_func`, pops them): "
            "pass labels, or drop shortcut_consistency."
        )
    return value


def shortcut_consistency_loss(
    logits,
    h_full,
    short_logits,
    h_short,
    labels,
    lambda_short,
    lambda_consistency,
    consistency_loss,
    num_items_in_batch=None,
    shift_labels=None,
):
    """CE_full + λ1·CE_short + λ2·D, normalised as the Trainer expects of a loss with `num_items_in_batch`: CE sums
    are divided by it (the tokens of the whole accumulated batch), the per-batch D is weighed by this batch's
    share of those tokens. Returns (loss, the three detached terms as per-token means, labelled tokens)."""
    ce_full_sum, n_local = _token_ce_sum(logits, labels, shift_labels)
    ce_short_sum, _ = _token_ce_sum(short_logits, labels, shift_labels)
    denom = n_local if num_items_in_batch is None else num_items_in_batch
    denom = torch.as_tensor(denom, device=ce_full_sum.device, dtype=torch.float32).clamp(min=1)
    if consistency_loss == "mse":
        consistency = F.mse_loss(h_short.float(), h_full.detach().float())
    else:
        short_logits, targets = _next_token_pairs(short_logits, labels, shift_labels)
        full_logits, _ = _next_token_pairs(logits, labels, shift_labels)
        mask = targets != -100
        log_p_short = F.log_softmax(short_logits[mask].float(), dim=-1)
        log_p_full = F.log_softmax(full_logits[mask].detach().float(), dim=-1)
        # mean over labelled positions ("batchmean"), 0 where there are none (batchmean would give 0/0)
        consistency = F.kl_div(log_p_short, log_p_full, log_target=True, reduction="sum") / max(n_local, 1)
    loss = ce_full_sum / denom + lambda_short * ce_short_sum / denom
    loss = loss + lambda_consistency * consistency * (n_local / denom)
    tokens = max(n_local, 1)
    terms = {
        "ce_full": ce_full_sum.detach() / tokens,
        "ce_short": ce_short_sum.detach() / tokens,
        "consistency": consistency.detach(),
    }
    return loss, terms, n_local


__all__ = [
    "CONSISTENCY_LOSSES",
    "ShortcutConsistency",
    "check_consistency_args",
    "check_lambdas",
    "check_shortcut_consistency",
    "shortcut_consistency_loss",
]
