"""The authors' TRM (GitHub nilskiKonjIzDunava/fprm: models/recursive_reasoning/trm.py, the ACTLossHead of
models/losses.py and the train step of pretrain.py), re-implemented as an oracle in this file's own words. It imports
nothing from `fprm_hf`; the block stack (their `FixedPointTransformer` as `L_level`) is `Reference.L_level` of
fprm_reference_oracle.py, checked against their code there. Weights are a state dict in their key layout
(`model.inner.` prefix), with TRM's `H_init` / `L_init` buffers and its Q-head. Used by tests/fprm/test_recursion_trm.py.
"""

import torch
import torch.nn.functional as F

from support.fprm_reference_oracle import BASE, Reference, reference_state_dict

# their config/arch/trm.yaml block (post-norm, plain residuals, no conv), at a tiny size
TRM_SETTINGS = {
    **BASE,
    "vocab_size": 9,
    "seq_len": 16,
    "num_puzzle_identifiers": 3,
    "H_cycles": 2,
    "L_cycles": 3,
    "n_backwards_L": 3,
    "L_layers": 2,
    "hidden_size": 32,
    "num_heads": 4,
    "expansion": 2,
    "pos_encodings": "rope",
    "puzzle_emb_ndim": 32 + 5,
    "puzzle_emb_len": 2,
    "norm_type": "post-norm",
    "norm_placement": "none",
    "conv_type": "none",
    "residual_scale": None,
    "halt_max_steps": 3,
    "halt_exploration_prob": 0.5,
    "no_ACT_continue": True,
}


def trm_state_dict(s, seed=0):
    """Random weights of their TRM (their keys, `model.inner.` first): the FPRM oracle's block stack and heads, the
    Q-head away from its init so that it halts some samples, and H_init / L_init."""
    sd = reference_state_dict(s, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    d = s["hidden_size"]
    sd["model.inner.q_head.weight"] = torch.randn(2, d, generator=g) * 0.5 * d**-0.5
    sd["model.inner.q_head.bias"] = torch.tensor([0.0, 0.0])
    sd["model.inner.H_init"] = torch.randn(d, generator=g)
    sd["model.inner.L_init"] = torch.randn(d, generator=g)
    return sd


def stablemax_token_losses(logits, labels):
    x = logits.double()
    s = torch.where(x < 0, 1 / (1 - x + 1e-30), x + 1)
    logp = torch.log(s / s.sum(-1, keepdim=True))
    valid = labels != -100
    picked = torch.gather(logp, -1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return -torch.where(valid, picked, 0)


class TheirTRM:
    """Their TinyRecursiveReasoningModel_ACTV1 (inner forward, carry, ACT halting) on a state dict."""

    def __init__(self, sd, s):
        self.s = s
        self.ref = Reference(sd, s)
        self.w = self.ref.w

    def inner(self, z_H, z_L, data):
        s, ref = self.s, self.ref
        x = ref.input_embeddings(data["inputs"], data["puzzle_identifiers"])
        cos_sin = ref.cos_sin(x.shape[1])
        with torch.no_grad():
            for _ in range(s["H_cycles"] - 1):
                for _ in range(s["L_cycles"]):
                    z_L = ref.L_level(z_L, z_H + x, cos_sin)
                z_H = ref.L_level(z_H, z_L, cos_sin)
        for _ in range(s["n_backwards_L"]):
            z_L = ref.L_level(z_L, z_H + x, cos_sin)
        z_H = ref.L_level(z_H, z_L, cos_sin)
        logits = ref.logits(z_H)
        q = F.linear(z_H[:, 0], self.w["q_head.weight"], self.w["q_head.bias"]).float()
        return z_H.detach(), z_L.detach(), logits, q[..., 0]

    def reset(self, halted, z_H, z_L):
        keep = ~halted.view(-1, 1, 1)
        return torch.where(keep, z_H, self.w["H_init"]), torch.where(keep, z_L, self.w["L_init"])

    @torch.no_grad()
    def evaluate(self, data):
        """Their evaluation: from an all-halted carry, ACT steps until every sample halts, which in evaluation is
        at `halt_max_steps`; the logits of the last step."""
        B, n = data["inputs"].shape[0], data["inputs"].shape[1] + self.ref.prefix
        d = self.s["hidden_size"]
        z_H, z_L = self.reset(torch.ones(B, dtype=torch.bool), torch.empty(B, n, d), torch.empty(B, n, d))
        steps = torch.zeros(B, dtype=torch.long)
        while True:
            z_H, z_L, logits, _ = self.inner(z_H, z_L, data)
            steps = steps + 1
            if bool((steps >= self.s["halt_max_steps"]).all()):
                return logits, steps


class TheirTRMTraining:
    """Their train step for TRM: the carry, one ACT step, the ACTLossHead loss / global batch, AdamW (weight decay
    on every dense parameter) at lr·s/W, SignSGD on the rows of the batch of the puzzle embedding, then the ACT
    halting with the exploration draws handed in (`min_halt_steps`, recorded from the package's run)."""

    def __init__(self, sd, s, lr, warmup, weight_decay, puzzle_emb_lr, puzzle_emb_weight_decay):
        self.model = TheirTRM(sd, s)
        self.s, self.base_lr, self.warmup = s, lr, warmup
        self.puzzle_emb_lr, self.puzzle_emb_wd = puzzle_emb_lr, puzzle_emb_weight_decay
        w = self.model.w
        self.trainable = [k for k in w if not k.endswith(".mask") and k not in ("H_init", "L_init")]
        for k in self.trainable:
            w[k] = w[k].clone().requires_grad_(True)
        dense = [k for k in self.trainable if k != "puzzle_emb.weights"]
        self.adamw = torch.optim.AdamW(
            [w[k] for k in dense], lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay
        )
        self.step_count = 0
        self.halted = None

    def lr(self, base):
        return base * self.step_count / self.warmup if self.step_count < self.warmup else base

    def train_batch(self, batch, min_halt_steps):
        s, model, w = self.s, self.model, self.model.w
        self.step_count += 1
        B = batch["inputs"].shape[0]
        if self.halted is None:  # their initial_carry: every slot halted
            n, d = batch["inputs"].shape[1] + model.ref.prefix, s["hidden_size"]
            self.halted = torch.ones(B, dtype=torch.bool)
            self.steps = torch.zeros(B, dtype=torch.long)
            self.data = {k: torch.empty_like(v) for k, v in batch.items()}
            self.z_H, self.z_L = torch.empty(B, n, d), torch.empty(B, n, d)
        z_H, z_L = model.reset(self.halted, self.z_H, self.z_L)
        steps = torch.where(self.halted, 0, self.steps)
        mask = self.halted
        self.data = {k: torch.where(mask.view(-1, *[1] * (v.dim() - 1)), batch[k], v) for k, v in self.data.items()}
        z_H, z_L, logits, q_halt = model.inner(z_H, z_L, self.data)
        labels = self.data["labels"]
        valid = labels != -100
        counts = valid.sum(-1)
        lm = (stablemax_token_losses(logits, labels) / counts.clamp_min(1).unsqueeze(-1)).sum()
        correct = ((logits.argmax(-1) == labels) & valid).sum(-1) == counts
        q_loss = F.binary_cross_entropy_with_logits(q_halt, correct.float(), reduction="sum")
        loss = (lm + 0.5 * q_loss) / B
        loss.backward()
        grads = {k: w[k].grad.detach().clone() for k in self.trainable if w[k].grad is not None}
        with torch.no_grad():
            if "puzzle_emb.weights" in w:  # their CastedSparseEmbeddingSignSGD
                ids = self.data["puzzle_identifiers"].unique()
                lr, table = self.lr(self.puzzle_emb_lr), w["puzzle_emb.weights"]
                table[ids] = table[ids] * (1.0 - lr * self.puzzle_emb_wd) - lr * torch.sign(table.grad[ids])
                table.grad = None
            for group in self.adamw.param_groups:
                group["lr"] = self.lr(self.base_lr)
            self.adamw.step()
            self.adamw.zero_grad()
            steps = steps + 1
            halted = steps >= s["halt_max_steps"]
            if s["halt_max_steps"] > 1:
                halted = (halted | (q_halt > 0)) & (steps >= min_halt_steps)
        self.z_H, self.z_L, self.steps, self.halted = z_H, z_L, steps, halted
        return float(loss.detach()), grads
