"""The optimizer of FPRM's authors' recipe: AdamW, with the prefix rows (the puzzle embeddings) trained by their sparse
SignSGD step (`FPRMTrainer.create_optimizer` builds it with `--puzzle_emb_optimizer signsgd`)."""

import torch


class SignSGDAdamW(torch.optim.AdamW):
    """AdamW for every param group but those marked `signsgd=True` (the prefix rows), which take the authors'
    sparse SignSGD step: p ← p·(1 − lr·wd) − lr·sign(g) on the rows of the batch only (`signsgd_rows`, set on the
    parameter by the trainer at every segment; all rows with a gradient when unset). The scheduler scales each
    group's lr, so the prefix rows follow the same schedule at their own lr, as theirs."""

    def step(self, closure=None):
        groups = self.param_groups
        sign_groups = [g for g in groups if g.get("signsgd")]
        with torch.no_grad():
            for group in sign_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    rows = getattr(p, "signsgd_rows", None)
                    if rows is None:
                        rows = p.grad.flatten(1).ne(0).any(-1).nonzero().squeeze(1)
                    lr, wd = group["lr"], group["weight_decay"]
                    p[rows] = p[rows] * (1.0 - lr * wd) - lr * torch.sign(p.grad[rows])
        self.param_groups = [g for g in groups if not g.get("signsgd")]
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups


__all__ = ["SignSGDAdamW"]
