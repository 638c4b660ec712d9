"""FPRMTrainer trains as the authors' pretrain.py trains (GitHub nilskiKonjIzDunava/fprm: pretrain.py, create_model.py,
models/losses.py, models/fixed_point_reasoning/{fprm,model_utils}.py, their SignSGD and EMA helpers).

Their training step, replayed here in this test's own words on random weights in their key layout: the carry of
samples in flight (a halted sample's slot takes the next batch's row, with a fresh z0, η = η0, patience P, best and
residual inf; the others keep their state), `n_backwards_L` solver iterations with gradient, the loss (each
sample's stablemax token mean, the batch mean, + q_loss_coeff × the batch mean of BCE(q_halt, sequence correct)), no
clipping, AdamW with their weight-decay groups (all but the α logits) at lr·min(1, (s+1)/W), then halting per
sample (segments ≥ max_iter, residual < fp_thresh, η < 1e-3), and on Sudoku their SignSGD for the puzzle
embedding (the rows of the batch only) and an EMA of the dense parameters. The forward is `Reference` of
tests/fprm/test_convert_authors_fprm.py (checked there against the converter).

The package's side is its own training path: `convert` of the same weights, then `FPRMTrainer` with
`FPRMTrainingArguments` as a preset sets them. z0 draws and batches are taken from the package's run and handed to
the replay. Per step: loss within 1e-5 relative, every gradient within 1e-4 of its largest entry, every parameter
within 1e-2 × lr, and residuals, η and halting flags equal.
"""

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from fprm_hf.authors.layout import _map_key
from fprm_hf.convert_authors import convert
from looped_training.fprm.arguments import FPRMTrainingArguments
from looped_training.fprm.trainer import FPRMTrainer
from support.fprm_reference_oracle import BASE, Reference, reference_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = 32
LR = 1e-3


# ---- their training step ---------------------------------------------------------------------------------------------


def their_stablemax_token_losses(logits, labels):
    x = logits.double()
    s = torch.where(x < 0, 1 / (1 - x + 1e-30), x + 1)
    logp = torch.log(s / s.sum(-1, keepdim=True))
    valid = labels != -100
    picked = torch.gather(logp, -1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return -torch.where(valid, picked, 0)


class TheirTraining:
    """Their TrainState + ACTLossHead + FixedPointReasoningModel_ACTV1 training forward, on `Reference`."""

    def __init__(self, sd, s, recipe):
        self.s, self.recipe = s, recipe
        self.ref = Reference(sd, s)
        w = self.ref.w
        self.trainable = [
            k for k in w if not k.endswith(".mask") and not (s["residual_scale"] == "fixed" and "alpha" in k)
        ]
        for k in self.trainable:
            w[k] = w[k].clone().requires_grad_(True)
        self.sparse = "puzzle_emb.weights" if "puzzle_emb.weights" in w else None
        dense = [k for k in self.trainable if k != self.sparse]
        no_decay = [k for k in dense if re_alpha_param(k)]
        self.adamw = torch.optim.AdamW(
            [
                {"params": [w[k] for k in dense if k not in no_decay], "weight_decay": recipe["weight_decay"]},
                {"params": [w[k] for k in no_decay], "weight_decay": 0.0},
            ],
            lr=0.0,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=recipe["weight_decay"],
        )
        self.ema = {k: w[k].detach().clone() for k in dense} if recipe.get("ema") else None
        self.step_count = 0
        self.halted = None

    def lr(self, base):
        warmup = self.recipe["warmup"]
        s = self.step_count  # their train_state.step, incremented before compute_lr
        return base * s / warmup if s < warmup else base  # cosine with lr_min_ratio 1.0: constant

    def train_batch(self, batch, z0):
        s, ref, w = self.s, self.ref, self.ref.w
        self.step_count += 1
        B = batch["inputs"].shape[0]
        if self.halted is None:  # initial_carry: every slot halted
            self.halted = torch.ones(B, dtype=torch.bool)
            self.steps = torch.zeros(B, dtype=torch.long)
            self.data = {k: torch.empty_like(v) for k, v in batch.items()}
            self.state = ref.reset(z0)
        reset = self.halted
        fresh = ref.reset(z0)
        self.state = {k: torch.where(reset.view(-1, *[1] * (v.dim() - 1)), fresh[k], v) for k, v in self.state.items()}
        self.steps = torch.where(reset, 0, self.steps)
        self.data = {k: torch.where(reset.view(-1, *[1] * (v.dim() - 1)), batch[k], v) for k, v in self.data.items()}
        x = ref.input_embeddings(self.data["inputs"], self.data["puzzle_identifiers"])
        cos_sin = ref.cos_sin(x.shape[1])
        state = self.state
        for _ in range(s["n_backwards_L"]):
            state = ref.step(state, ref.L_level(state["y"], x, cos_sin), training=True)
        logits = ref.logits(state["y"])
        labels = self.data["labels"]
        mask = labels != -100
        counts = mask.sum(-1)
        lm = (their_stablemax_token_losses(logits, labels) / counts.clamp_min(1).unsqueeze(-1)).sum()
        q_halt = F_linear(w, "q_head", state["y"][:, 0]).float()[..., 0]
        correct = ((logits.argmax(-1) == labels) & mask).sum(-1) == counts
        q_loss = torch.nn.functional.binary_cross_entropy_with_logits(q_halt, correct.float(), reduction="sum")
        loss = (lm + self.recipe["q_loss_coeff"] * q_loss) / B
        loss.backward()
        grads = {k: w[k].grad.detach().clone() for k in self.trainable if w[k].grad is not None}
        with torch.no_grad():
            if self.sparse is not None:  # CastedSparseEmbeddingSignSGD: sum by id, sign, decoupled decay
                ids = self.data["puzzle_identifiers"].unique()
                lr, wd = self.lr(self.recipe["puzzle_emb_lr"]), self.recipe["puzzle_emb_weight_decay"]
                table = w[self.sparse]
                table[ids] = table[ids] * (1.0 - lr * wd) - lr * torch.sign(table.grad[ids])
                table.grad = None
            for group in self.adamw.param_groups:
                group["lr"] = self.lr(LR)
            self.adamw.step()
            self.adamw.zero_grad()
            if self.ema is not None:
                mu = self.recipe["ema"]
                for k in self.ema:
                    self.ema[k] = (1.0 - mu) * w[k].detach() + mu * self.ema[k]
            self.state = {k: v.detach() for k, v in state.items()}
            self.steps = self.steps + 1
            self.halted = (
                (self.steps >= s["max_iter"])
                | (self.state["residues"] < s["fp_thresh"])
                | (self.state["stepsize"].view(-1) < 1e-3)
            )
        return float(loss.detach()), grads


def re_alpha_param(key):
    return key.startswith("L_level.alpha_") and key.endswith("_param")


def F_linear(w, name, x):
    return torch.nn.functional.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


# ---- the package's run, recorded ----------------------------------------------------------------------------------


class Recorder(TrainerCallback):
    def __init__(self):
        self.grads, self.params = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})


def run_package(model, dataset, steps, **args):
    kwargs = dict(
        output_dir="unused",
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_drop_last=True,
        seed=0,
        max_steps=steps,
        learning_rate=LR,
        adam_beta2=0.95,
        loss_type="stablemax",
        lr_schedule="authors",
    )
    kwargs.update(args)
    trainer = FPRMTrainer(model=model, args=FPRMTrainingArguments(**kwargs), train_dataset=dataset)
    recorder = Recorder()
    trainer.add_callback(recorder)
    core = model.model
    draws, batches, losses, states, done, segments = [], [], [], [], [], []
    initial_z = core.initial_z

    def recorded_z(x, generator=None):
        z = initial_z(x, generator)
        draws.append(z.clone())
        return z

    core.initial_z = recorded_z
    compute_loss = trainer.compute_loss

    def spy(m, inputs, *a, **k):
        batches.append({key: v.clone() for key, v in inputs.items()})
        loss = compute_loss(m, inputs, *a, **k)
        losses.append(float(loss.detach()))
        states.append(trainer.carry.state)
        done.append(trainer.carry.done(trainer.args.max_segments).clone())
        segments.append(trainer.carry.segments.clone())
        return loss

    trainer.compute_loss = spy
    trainer.train()
    return dict(
        trainer=trainer,
        draws=draws,
        batches=batches,
        losses=losses,
        states=states,
        done=done,
        segments=segments,
        grads=recorder.grads,
        params=recorder.params,
    )


def ours_of(key, tensor, config):
    """Their tensor in this package's layout: the key and, for the puzzle embedding, the zero-padded rows."""
    if key in ("q_head.weight", "q_head.bias"):
        return key, tensor
    name = _map_key(key, config)
    if name == "model.prefix":
        p, d = config.num_prefix_tokens, config.hidden_size
        tensor = torch.nn.functional.pad(tensor, (0, p * d - tensor.shape[1])).view(-1, p, d)
    return name, tensor


def compare(ours, theirs, config, lr_of_step):
    """The per-step checks; returns the largest discrepancies seen (loss, gradient, parameter / lr)."""
    worst = dict(loss=0.0, grad=0.0, param=0.0)
    assert len(ours["losses"]) == len(theirs) > 0
    for step, (loss, grads, params, state, done, ref) in enumerate(
        zip(ours["losses"], ours["grads"], ours["params"], ours["states"], ours["done"], theirs)
    ):
        rel = abs(loss - ref["loss"]) / abs(ref["loss"])
        worst["loss"] = max(worst["loss"], rel)
        assert rel <= 1e-5, f"step {step}: loss {loss} vs theirs {ref['loss']}"
        torch.testing.assert_close(state.residuals, ref["residues"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.eta, ref["stepsize"], rtol=1e-6, atol=1e-7)
        assert done.tolist() == ref["halted"].tolist(), f"step {step}: halting flags"
        for key, g_ref in ref["grads"].items():
            if key.startswith("q_head.") and not config.use_q_head:
                continue  # dropped by the converter: theirs gets a zero gradient (q_loss_coeff 0) and decays
            name, g_ref = ours_of(key, g_ref, config)
            scale = float(g_ref.abs().max())
            if scale == 0:
                continue
            err = float((grads[name] - g_ref).abs().max()) / scale
            worst["grad"] = max(worst["grad"], err)
            assert err <= 1e-4, f"step {step}: gradient of {name} ({key}) off by {err:.2e} of its largest entry"
        for key, p_ref in ref["params"].items():
            if key.startswith("q_head.") and not config.use_q_head:
                continue
            name, p_ref = ours_of(key, p_ref, config)
            err = float((params[name] - p_ref).abs().max()) / lr_of_step[step]
            worst["param"] = max(worst["param"], err)
            assert err <= 1e-2, f"step {step}: {name} ({key}) off by {err:.2e} x lr"
    return worst


def replay(theirs, ours):
    out = []
    for batch, z0 in zip(ours["batches"], ours["draws"]):
        B = batch["input_ids"].shape[0]
        data = {
            "inputs": batch["input_ids"],
            "labels": batch["labels"],
            "puzzle_identifiers": batch.get("puzzle_identifiers", torch.zeros(B, dtype=torch.long)),
        }
        loss, grads = theirs.train_batch(data, z0)
        w = theirs.ref.w
        out.append(
            dict(
                loss=loss,
                grads=grads,
                params={k: w[k].detach().clone() for k in theirs.trainable},
                residues=theirs.state["residues"].clone(),
                stepsize=theirs.state["stepsize"].view(-1).clone(),
                halted=theirs.halted.clone(),
            )
        )
    return out


# ---- state tracking: halting active over several steps -------------------------------------------------------------

STATE_TRACKING = {
    **BASE,
    "vocab_size": 7,
    "seq_len": 12,
    "num_puzzle_identifiers": 1,
    "causal": True,
    "pos_encodings": "none",
    "puzzle_emb_ndim": 0,
    "puzzle_emb_len": 0,
    "conv_type": "conv1d",
    "conv_kernel_size": 4,
    "n_backwards_L": 2,
    "max_iter": 3,
    "fp_thresh": 0.25,
    "decay_patience": 1,
    "stepsize_decay_train": 0.6,
}
ST_RECIPE = dict(warmup=3, weight_decay=0.1, q_loss_coeff=0.0)
ST_STEPS = 6


def state_tracking_rows(n=48, seed=0):
    """Running-product-like rows padded to the test length with ignored labels (their dataset's layout)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 7, (n, 12), generator=g)
    labels = torch.randint(1, 7, (n, 12), generator=g)
    lengths = torch.randint(5, 9, (n,), generator=g)
    pad = torch.arange(12)[None] >= lengths[:, None]
    ids[pad], labels[pad] = 0, -100
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def state_tracking_runs(tmp_path, **ours_overrides):
    s = dict(STATE_TRACKING)
    sd = reference_state_dict(s, seed=21)
    model = convert(sd, [s], tmp_path / "st").train()
    args = dict(
        per_device_train_batch_size=4,
        n_backward=s["n_backwards_L"],
        max_segments=s["max_iter"],
        weight_decay=ST_RECIPE["weight_decay"],
        warmup_steps=ST_RECIPE["warmup"],
    )
    args.update(ours_overrides)
    torch.manual_seed(0)
    ours = run_package(model, state_tracking_rows(), ST_STEPS, **args)
    theirs = replay(TheirTraining(sd, s, ST_RECIPE), ours)
    lrs = [LR * min(1.0, (k + 1) / ST_RECIPE["warmup"]) for k in range(ST_STEPS)]
    return ours, theirs, model.config, lrs


def test_state_tracking_steps_with_halting_match_their_training(tmp_path):
    ours, theirs, config, lrs = state_tracking_runs(tmp_path)
    worst = compare(ours, theirs, config, lrs)
    print(f"state tracking, {ST_STEPS} steps: worst {worst}")
    # the run exercised what it claims to: resets by the residual and by the cap, η decay, carried samples
    segments = torch.stack(ours["segments"])
    done = torch.stack(ours["done"])
    by_residual = torch.stack([s.converged for s in ours["states"]]) & (segments < STATE_TRACKING["max_iter"])
    by_cap = segments >= STATE_TRACKING["max_iter"]
    assert bool(by_residual.any()) and bool(by_cap.any()), "residual or cap halting did not happen"
    assert bool((~done[:-1]).any()), "no sample was carried to a next segment"
    assert min(float(s.eta.min()) for s in ours["states"]) < 1.0, "η never decayed"
    assert lrs[0] == LR / 3  # their first step: lr/W


def test_state_tracking_oracle_sees_gradient_clipping(tmp_path):
    """The oracle is sharp: Trainer's default clipping (max_grad_norm 1.0, which FPRM presets no longer use) is
    caught."""
    ours, theirs, config, lrs = state_tracking_runs(tmp_path, max_grad_norm=0.05)
    with pytest.raises(AssertionError):
        compare(ours, theirs, config, lrs)


# ---- Sudoku: Q-head, EMA and SignSGD on the puzzle embedding, one step ---------------------------------------------

SUDOKU = {
    **BASE,
    "vocab_size": 9,
    "seq_len": 16,
    "num_puzzle_identifiers": 3,
    "conv_type": "conv2d",
    "conv_kernel_size": 3,
    "pos_encodings": "rope",
    "puzzle_emb_ndim": HIDDEN + 7,
    "puzzle_emb_len": 2,
    "alpha_1_init": 0.75,
    "alpha_2_init": 0.25,
    "n_backwards_L": 3,
    "max_iter": 12,
    "fp_thresh": 0.1,
}
SUDOKU_RECIPE = dict(
    warmup=4, weight_decay=0.05, q_loss_coeff=0.5, ema=0.999, puzzle_emb_lr=1e-2, puzzle_emb_weight_decay=0.5
)


def sudoku_rows(n=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 9, (n, 16), generator=g)
    labels = torch.randint(1, 9, (n, 16), generator=g)
    labels[torch.rand(n, 16, generator=g) < 0.4] = -100  # different label counts per sample
    labels[1] = -100  # a sample without labels: "correct" for the Q-head, 0 for the token loss
    puzzles = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])  # row 2 of the table is never in a batch: SignSGD leaves it
    return Dataset.from_dict(
        {"input_ids": ids.tolist(), "labels": labels.tolist(), "puzzle_identifiers": puzzles[:n].tolist()}
    )


def sudoku_runs(tmp_path, **ours_overrides):
    s = dict(SUDOKU)
    sd = reference_state_dict(s, seed=22)
    model = convert(sd, [s], tmp_path / "sudoku", keep_q_head=True).train()
    r = SUDOKU_RECIPE
    args = dict(
        per_device_train_batch_size=4,
        n_backward=s["n_backwards_L"],
        max_segments=s["max_iter"],
        weight_decay=r["weight_decay"],
        warmup_steps=r["warmup"],
        q_loss_coefficient=r["q_loss_coeff"],
        ema_decay=r["ema"],
        puzzle_emb_optimizer="signsgd",
        puzzle_emb_lr=r["puzzle_emb_lr"],
        puzzle_emb_weight_decay=r["puzzle_emb_weight_decay"],
    )
    args.update(ours_overrides)
    torch.manual_seed(0)
    ours = run_package(model, sudoku_rows(), 1, **args)
    initial = {k[len("model.inner.") :]: v.clone() for k, v in sd.items()}
    their = TheirTraining(sd, s, r)
    theirs = replay(their, ours)
    return ours, theirs, their, model.config, initial


def check_sudoku(ours, theirs, their, config, initial):
    lr = LR / SUDOKU_RECIPE["warmup"]  # their first step
    worst = compare(ours, theirs, config, [lr])
    shadow = ours["trainer"].ema
    assert "model.prefix" not in shadow  # theirs is a buffer, outside the EMA
    moved = {"ours": [0.0, 0.0], "theirs": [0.0, 0.0]}  # Σ (shadow − p0)·(p1 − p0), Σ (p1 − p0)²
    for key, value in their.ema.items():
        name, value = ours_of(key, value, config)
        assert float((shadow[name] - value).abs().max()) <= 1e-2 * lr, f"EMA of {name}"
        _, p0 = ours_of(key, initial[key], config)
        for side, ema, p1 in (
            ("ours", shadow[name], ours["params"][0][name]),
            ("theirs", value, ours_of(key, theirs[0]["params"][key], config)[1]),
        ):
            moved[side][0] += float(((ema - p0) * (p1 - p0)).sum())
            moved[side][1] += float(((p1 - p0) ** 2).sum())
    # the EMA's share of the step, 1 − μ, from thousands of entries (one entry's is below float32 resolution)
    share = {side: num / den for side, (num, den) in moved.items()}
    assert abs(share["ours"] - share["theirs"]) <= 1e-2 * share["theirs"], f"EMA weight of the step: {share}"
    return worst


def test_sudoku_step_with_q_head_ema_and_signsgd_matches_their_training(tmp_path):
    ours, theirs, their, config, initial = sudoku_runs(tmp_path)
    worst = check_sudoku(ours, theirs, their, config, initial)
    print(f"sudoku, 1 step: worst {worst}")
    batch = ours["batches"][0]
    model = ours["trainer"].model
    # not vacuous: the Q-head and the puzzle embedding got gradients, a row outside the batch stayed as it was
    assert float(ours["grads"][0]["q_head.weight"].abs().max()) > 0
    assert float(ours["grads"][0]["model.prefix"].abs().max()) > 0
    assert 2 not in batch["puzzle_identifiers"].tolist()
    torch.testing.assert_close(
        model.model.prefix[2].flatten()[: SUDOKU["puzzle_emb_ndim"]],
        their.ref.w["puzzle_emb.weights"][2].detach(),
        rtol=0,
        atol=0,
    )
    assert float(model.model.prefix.detach().flatten(1)[:, SUDOKU["puzzle_emb_ndim"] :].abs().max()) == 0


@pytest.mark.parametrize(
    "perturbation",
    [
        dict(puzzle_emb_optimizer="adamw"),  # the puzzle embedding trained by the dense AdamW
        dict(puzzle_emb_weight_decay=0.0),  # no weight decay on the puzzle embedding
        dict(q_loss_coefficient=0.0),  # no Q-halt loss
        dict(loss_normalization="token"),  # the per-token mean of earlier versions
        dict(ema_decay=0.99),
    ],
)
def test_sudoku_oracle_sees_each_perturbation(tmp_path, perturbation):
    ours, theirs, their, config, initial = sudoku_runs(tmp_path, **perturbation)
    with pytest.raises(AssertionError):
        check_sudoku(ours, theirs, their, config, initial)
