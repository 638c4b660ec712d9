"""Training-step oracle: the package's LoopFormer training path against the authors' train.py, step by step.

The package side is exactly what `python -m looped_training.loopformer.train` runs: its text windows (`TokenWindows`),
`build_trainer` (the stock Trainer, the shortcut-consistency callback and its collator, the reference warm-up), the
Trainer's AdamW and `cosine_with_min_lr` schedule, on a model converted from random weights in the authors' layout.
The authors' side is re-written here from their train.py and models/: get_lr (warm-up (s+1)/(W+1), cosine to min_lr),
AdamW over two groups (every tensor of 2 or more dimensions decayed, the rest not), betas (0.9, 0.95), gradient
clipping at 1.0, and the step

    loss = CE(full) + 0.1 * CE(short) + 0.1 * MSE(x_full.detach(), x_short)    (LoopFormer; Base-Loop: CE(full))

on windows x = data[i:i+T], y = data[i+1:i+T+1]. Both see the same batches and short trajectories (the package's
sampler draws them; the reference takes them from the batch the model received).
"""

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import TrainerCallback, TrainingArguments

from looped_training.loopformer.data import TokenWindows
from looped_training.loopformer.objective import ShortcutConsistencyCallback
from looped_training.loopformer.arguments import ModelArguments, ScheduleArguments, ShortcutArguments
from looped_training.loopformer.train import build_trainer
from loopformer_hf.convert_authors import convert, map_reference_state_dict
from support.reference_oracle import _embedder, _reference_block, reference_state_dict

N_LAYER, N_LOOPS, D, N_HEAD, VOCAB, T = 2, 4, 32, 4, 61, 16
STEPS, WARMUP, PEAK_LR, MIN_LR_RATE, WEIGHT_DECAY, CLIP, BATCH = 40, 10, 1e-3, 0.1, 0.2, 1.0, 4
MODEL_TYPES = {"loopformer": "loopformer", "base_loop": "base_loop"}  # package variant -> authors' model type


# ---- the authors' training, in this test's words --------------------------------------------------------------------


def authors_get_lr(it):
    """train.py get_lr with lr_decay_iters = max_iters and min_lr = lr / 10 (their configs)."""
    min_lr = PEAK_LR * MIN_LR_RATE
    if it < WARMUP:
        return PEAK_LR * (it + 1) / (WARMUP + 1)
    if it > STEPS:
        return min_lr
    ratio = (it - WARMUP) / (STEPS - WARMUP)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (PEAK_LR - min_lr)


def authors_hidden(params, idx, trajectory, model_type):
    """x of their forward: the final RMSNorm's output (what their MSE compares), from the blocks looped along
    `trajectory` (LoopFormer: step sizes; Base-Loop: only its length, the loop count)."""
    blocks = [f"transformer.h.blocks.{j}." for j in range(N_LAYER)]
    x = params["transformer.wte.weight"][idx] + params["transformer.wpe.weight"][: idx.shape[1]][None]
    t = 0.0
    for dt in trajectory:
        c = None
        if model_type == "loopformer":
            c = _embedder(params, "time_embedder", t) + _embedder(params, "dt_embedder", dt)
        for p in blocks:
            x = _reference_block(params, p, x, c, N_HEAD)
        t += dt
    return F.rms_norm(x, (D,), params["transformer.norm_f.weight"])


def authors_ce(params, x, y):
    logits = F.linear(x, params["transformer.wte.weight"])  # lm_head tied to wte
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def authors_train(state_dict, batches, model_type):
    """Their loop over `batches` of (X, Y, short trajectory or None): per-step terms and parameters after each step."""
    params = {k: v.clone().requires_grad_(True) for k, v in state_dict.items() if k != "lm_head.weight"}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
    )
    full = [1 / N_LOOPS] * N_LOOPS
    terms, snapshots = [], []
    for it, (x, y, short) in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = authors_get_lr(it)
        h_full = authors_hidden(params, x, full, model_type)
        ce_full = authors_ce(params, h_full, y)
        step = {"ce_full": ce_full.item()}
        loss = ce_full
        if short is not None:
            h_short = authors_hidden(params, x, short, model_type)
            ce_short = authors_ce(params, h_short, y)
            consistency = F.mse_loss(h_full.detach(), h_short)
            loss = ce_full + 0.1 * ce_short + 0.1 * consistency
            step.update(ce_short=ce_short.item(), consistency=consistency.item())
        step["loss"] = loss.item()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        terms.append(step)
        snapshots.append({k: v.detach().clone() for k, v in params.items()})
    return terms, snapshots


# ---- the package's training path, recorded ----------------------------------------------------------------------------


class Snapshots(TrainerCallback):
    def __init__(self):
        self.params = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({k: v.detach().clone() for k, v in model.state_dict().items()})


def token_stream(seed=0, windows=STEPS * BATCH):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(windows * T + 1)]


class RunClmWindows(torch.utils.data.Dataset):
    """`windows` as run_clm.py's rows: labels = input_ids, so a window of T tokens trains T - 1 targets (a recipe knob
    the oracle must see)."""

    def __init__(self, windows):
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        ids = self.windows[i]["input_ids"]
        return {"input_ids": ids, "labels": ids}


def package_train(tmp_path, variant, state_dict, lr_warmup="reference", window_targets=True, max_grad_norm=CLIP):
    torch.save(state_dict, tmp_path / "ckpt.pt")
    model = convert(
        tmp_path / "ckpt.pt",
        tmp_path / "hf",
        n_layer=N_LAYER,
        n_loops=N_LOOPS,
        n_embd=D,
        n_head=N_HEAD,
        vocab_size=VOCAB,
        block_size=T,
        model_type=MODEL_TYPES[variant],
    ).train()
    stream = token_stream()
    np.asarray(stream, dtype=np.uint16).tofile(tmp_path / "train.bin")  # the token file train reads
    windows = TokenWindows(tmp_path / "train.bin", T, "uint16")
    windows = windows if window_targets else RunClmWindows(windows)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=PEAK_LR,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATE},
        warmup_steps=WARMUP,
        weight_decay=WEIGHT_DECAY,
        adam_beta2=0.95,
        max_grad_norm=max_grad_norm,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = build_trainer(
        model,
        None,
        windows,
        None,
        ModelArguments(variant=variant),
        ShortcutArguments(),
        ScheduleArguments(lr_warmup=lr_warmup),
        args,
    )
    snapshots = Snapshots()
    trainer.add_callback(snapshots)
    seen, terms = [], []

    def record_inputs(module, args_, kwargs):
        seen.append(kwargs["input_ids"].clone())

    def record_terms(module, args_, kwargs, out):
        step = {"loss": out.loss.item(), "ce_full": out.loss.item()}
        if out.ce_full is not None:
            step.update(ce_full=out.ce_full.item(), ce_short=out.ce_short.item(), consistency=out.consistency.item())
        terms.append(step)

    hooks = [
        model.register_forward_pre_hook(record_inputs, with_kwargs=True),
        model.register_forward_hook(record_terms, with_kwargs=True),
    ]
    trainer.train()
    for hook in hooks:
        hook.remove()
    # the short trajectory of each training forward: drawn by the shortcut callback, in training order
    sampler = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ShortcutConsistencyCallback)]
    shorts = [list(t) for _, t in sampler[0].sampled] if sampler else [None] * len(seen)
    seen = list(zip(seen, shorts, strict=True))
    # the authors' targets of each window the model saw: the T tokens after its first (their y)
    next_tokens = {
        tuple(stream[i * T : (i + 1) * T]): stream[i * T + 1 : (i + 1) * T + 1] for i in range(len(stream) // T)
    }
    batches = [(ids, torch.tensor([next_tokens[tuple(r.tolist())] for r in ids]), short) for ids, short in seen]
    return terms, snapshots.params, batches, model.config


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def run_oracle(tmp_path, variant, **perturbation):
    """(worst relative difference of a loss term, worst absolute difference of a parameter) over all steps."""
    sd = reference_state_dict(seed=1, d=D, n_layer=N_LAYER, vocab=VOCAB, block=T, model_type=MODEL_TYPES[variant])
    ours, our_params, batches, config = package_train(tmp_path, variant, sd, **perturbation)
    assert len(ours) == len(batches) == len(our_params) == STEPS
    if variant == "loopformer":  # the sampler drew short trajectories of several lengths
        assert len({len(short) for _, _, short in batches}) > 1
    theirs, their_params = authors_train(sd, batches, MODEL_TYPES[variant])
    worst_term = max(relative(o[k], t[k]) for o, t in zip(ours, theirs) for k in t)
    worst_param = 0.0
    for mine, ref in zip(our_params, their_params):
        ref = dict(ref, **{"lm_head.weight": ref["transformer.wte.weight"]})
        # their parameters in our layout, through the converter
        for name, value in map_reference_state_dict(ref, config, MODEL_TYPES[variant]).items():
            worst_param = max(worst_param, float((mine[name] - value).abs().max()))
    return worst_term, worst_param


@pytest.mark.parametrize("variant", ["loopformer", "base_loop"])
def test_training_matches_the_authors_step_for_step(tmp_path, variant):
    worst_term, worst_param = run_oracle(tmp_path, variant)
    assert worst_term < 1e-5, f"a loss term differs from the authors' by {worst_term:.2e} (relative)"
    assert worst_param < 1e-5, f"a parameter differs from the authors' by {worst_param:.2e}"


@pytest.mark.parametrize(
    "perturbation",
    [{"lr_warmup": "trainer"}, {"window_targets": False}, {"max_grad_norm": 0}],
    ids=["trainer-warmup", "run_clm-windows", "no-clipping"],
)
def test_the_oracle_sees_one_changed_recipe_knob(tmp_path, perturbation):
    """Guards the oracle: each knob that differs from the authors' recipe moves the run beyond its tolerance."""
    worst_term, worst_param = run_oracle(tmp_path, "loopformer", **perturbation)
    assert worst_term > 1e-4 or worst_param > 1e-4, (worst_term, worst_param)
