"""Representation metrics per loop step (spec, "Representation analysis used in the paper").

Every function takes token matrices: `x` of shape (N tokens, D), or a sequence (T, D) where order matters.

- linear CKA:     ||XᵀY||²_F / (||XᵀX||_F ||YᵀY||_F) on column-centred X, Y (same tokens, two loop steps)
- anisotropy:     mean pairwise cosine similarity of the token vectors (i != j)
- curvature:      mean angle (radians) between successive direction vectors v_t = x_{t+1} - x_t along a sequence
- prompt entropy: matrix Rényi (α=1) entropy of the trace-normalised Gram matrix of centred, L2-normalised token
                  vectors, -Σ λ log λ over its eigenvalues; `normalize=True` divides by log(min(N, D))
"""

import math

import torch
import torch.nn.functional as F


def linear_cka(x, y):
    x = x.double() - x.double().mean(0, keepdim=True)
    y = y.double() - y.double().mean(0, keepdim=True)
    cross = (x.T @ y).norm() ** 2
    denom = (x.T @ x).norm() * (y.T @ y).norm()
    return float(cross / denom) if denom > 0 else float("nan")


def anisotropy(x):
    n = x.shape[0]
    if n < 2:
        return float("nan")
    u = F.normalize(x.double(), dim=-1)
    sims = u @ u.T
    return float((sims.sum() - sims.diagonal().sum()) / (n * (n - 1)))


def curvature(x):
    if x.shape[0] < 3:
        return float("nan")
    v = F.normalize((x[1:] - x[:-1]).double(), dim=-1)
    cos = (v[1:] * v[:-1]).sum(-1).clamp(-1.0, 1.0)
    return float(torch.arccos(cos).mean())


def prompt_entropy(x, normalize=True):
    n, d = x.shape
    if n < 2:
        return float("nan")
    z = x.double() - x.double().mean(0, keepdim=True)
    z = F.normalize(z, dim=-1)
    gram = z @ z.T
    gram = gram / gram.trace()
    eig = torch.linalg.eigvalsh(gram).clamp(min=0)
    eig = eig[eig > 1e-12]
    entropy = float(-(eig * eig.log()).sum())
    return entropy / math.log(min(n, d)) if normalize else entropy


def per_step_metrics(hidden_states, attention_mask):
    """Metrics for each entry of `hidden_states` (embeddings, then the state after each loop step).

    hidden_states: sequence of (B, T, D) tensors; attention_mask: (B, T). Anisotropy, curvature and prompt entropy
    are per prompt (its real tokens) and averaged over prompts; CKA pools every real token of the batch.
    Returns {"anisotropy": [...], "curvature": [...], "prompt_entropy": [...], "cka": [[...]] (steps x steps),
    "cka_to_previous": [...] (step i vs i-1; NaN for the embeddings)}.
    """
    mask = attention_mask.bool()
    out = {"anisotropy": [], "curvature": [], "prompt_entropy": []}
    pooled = []
    for h in hidden_states:
        h = h.detach().float().cpu()
        per = {"anisotropy": [], "curvature": [], "prompt_entropy": []}
        for b in range(h.shape[0]):
            tokens = h[b][mask[b].cpu()]
            per["anisotropy"].append(anisotropy(tokens))
            per["curvature"].append(curvature(tokens))
            per["prompt_entropy"].append(prompt_entropy(tokens))
        for name, values in per.items():
            finite = [v for v in values if math.isfinite(v)]
            out[name].append(sum(finite) / len(finite) if finite else float("nan"))
        pooled.append(h[mask.cpu()])
    out["cka"] = [[linear_cka(a, b) for b in pooled] for a in pooled]
    out["cka_to_previous"] = [float("nan")] + [out["cka"][i][i - 1] for i in range(1, len(pooled))]
    return out
