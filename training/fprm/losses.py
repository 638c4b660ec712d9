"""The losses of FPRM's (and TRM's) training step, as their models/losses.py computes them: stablemax
cross-entropy (TRM's), the per-sample normalisation, and the Q-halt loss."""

import torch
import torch.nn.functional as F

STABLEMAX_EPS = 1e-30  # their s(x) = 1 / (1 − x + ε) for x < 0


def stablemax_token_losses(logits, labels, ignore_index=-100):
    """Per-token cross-entropy (float64, 0 where ignored) with s(x) = x + 1 (x ≥ 0), 1 / (1 − x + 1e-30) (x < 0) in
    place of exp (TRM's stablemax, their models/losses.py)."""
    logits = logits.double()
    # their s(x): the epsilon keeps 1/(1 − x) finite in the unused branch of torch.where at x = 1, whose infinite
    # gradient (times the 0 of `where`) would make every gradient NaN
    s = torch.where(logits < 0, 1 / (1 - logits + STABLEMAX_EPS), logits + 1)
    logprobs = torch.log(s / s.sum(-1, keepdim=True))
    valid = labels != ignore_index
    picked = torch.gather(logprobs, -1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return -torch.where(valid, picked, 0)  # not picked·valid: an ignored −inf would give NaN


def stablemax_cross_entropy(logits, labels, ignore_index=-100):
    """The mean of `stablemax_token_losses` over the labelled tokens."""
    valid = labels != ignore_index
    return stablemax_token_losses(logits, labels, ignore_index).sum().float() / valid.sum().clamp(min=1)


def token_loss(logits, labels, loss_type, normalization="token"):
    """The segment's cross-entropy: `token` = the mean over every labelled token; `sample` = each sample's mean over
    its labelled tokens (0 for a sample without labels), then the mean over the batch (the authors')."""
    if normalization == "token":
        if loss_type == "stablemax":
            return stablemax_cross_entropy(logits, labels)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    if loss_type == "stablemax":
        losses = stablemax_token_losses(logits, labels)
    else:
        losses = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
        ).view(labels.shape)
    counts = (labels != -100).sum(-1).clamp(min=1)
    return (losses.sum(-1) / counts).mean().float()


def q_halt_loss(q_halt_logits, logits, labels):
    """Their Q-halt loss: BCE(q_halt_logits, every labelled token of the sample predicted right), mean over the batch
    (their sum / global batch)."""
    with torch.no_grad():
        valid = labels != -100
        correct = ((logits.argmax(-1) == labels) | ~valid).all(-1)
    return F.binary_cross_entropy_with_logits(q_halt_logits.float(), correct.float())


__all__ = ["STABLEMAX_EPS", "stablemax_token_losses", "stablemax_cross_entropy", "token_loss", "q_halt_loss"]
