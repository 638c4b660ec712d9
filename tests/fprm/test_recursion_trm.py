"""TRM, the paper's baseline, is `FPRMConfig(recursion="trm")`: it computes what the authors' trm.py computes and trains
as their pretrain.py trains it (the oracle: tests/support/trm_reference_oracle.py, on the same weights).

- Evaluation: `halt_max_steps` ACT steps of H_cycles × L_cycles from H_init / L_init; logits within 1e-4.
- Training: `TRMTrainer` steps (carry, one ACT step with the gradient through the last cycle, stablemax + Q-halt
  loss, AdamW + SignSGD puzzle embedding, Q-head halting with exploration) against their step replayed on the same
  batches and exploration draws: loss, gradients and parameters after every step agree.
"""

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from fprm_hf import FPRMConfig, FPRMForReasoning
from fprm_hf.authors.layout import _map_key
from fprm_hf.recursion_trm import applications_per_step
from looped_training.fprm.arguments import FPRMTrainingArguments
from looped_training.fprm.trainer_trm import TRMTrainer
from support.trm_reference_oracle import TRM_SETTINGS, TheirTRM, TheirTRMTraining, trm_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")

LR, WARMUP = 1e-3, 2


def trm_config(s, **overrides):
    """Their TRM settings as this package's configuration."""
    d = s["hidden_size"]
    fields = dict(
        recursion="trm",
        vocab_size=s["vocab_size"],
        hidden_size=d,
        num_attention_heads=s["num_heads"],
        expansion=s["expansion"],
        num_hidden_layers=s["L_layers"],
        conv_type="none",
        residual_scaling="none",
        norm_type="post",
        position_embedding_type="rope",
        num_prefix_tokens=s["puzzle_emb_len"],
        puzzle_emb_ndim=s["puzzle_emb_ndim"],
        num_puzzle_identifiers=s["num_puzzle_identifiers"],
        H_cycles=s["H_cycles"],
        L_cycles=s["L_cycles"],
        n_backwards_L=s["n_backwards_L"],
        halt_max_steps=s["halt_max_steps"],
        halt_exploration_prob=s["halt_exploration_prob"],
    )
    fields.update(overrides)
    return FPRMConfig(**fields)


def ours_of(key, tensor, config):
    """Their tensor under this package's name (the puzzle embedding zero-padded into the prefix rows)."""
    extra = {"H_init": "model.H_init", "L_init": "model.L_init", "q_head.weight": "q_head.weight"}
    extra["q_head.bias"] = "q_head.bias"
    name = extra.get(key) or _map_key(key, config)
    if name == "model.prefix":
        p, d = config.num_prefix_tokens, config.hidden_size
        tensor = torch.nn.functional.pad(tensor, (0, p * d - tensor.shape[1])).view(-1, p, d)
    return name, tensor


def load_theirs(sd, config):
    model = FPRMForReasoning(config)
    mapped = dict(ours_of(k[len("model.inner.") :], v, config) for k, v in sd.items() if not k.endswith(".mask"))
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model


def data(n=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    s = TRM_SETTINGS
    ids = torch.randint(0, s["vocab_size"], (n, s["seq_len"]), generator=g)
    labels = torch.randint(1, s["vocab_size"], (n, s["seq_len"]), generator=g)
    labels[torch.rand(n, s["seq_len"], generator=g) < 0.3] = -100
    puzzles = torch.randint(0, 2, (n,), generator=g)  # row 2 of the table never in a batch
    return {"inputs": ids, "labels": labels, "puzzle_identifiers": puzzles}


def test_trm_evaluation_matches_their_forward():
    s = TRM_SETTINGS
    sd = trm_state_dict(s, seed=5)
    config = trm_config(s)
    model = load_theirs(sd, config).eval()
    batch = data()
    theirs, their_steps = TheirTRM(sd, s).evaluate(batch)
    with torch.no_grad():
        out = model(batch["inputs"], puzzle_identifiers=batch["puzzle_identifiers"])
    torch.testing.assert_close(out.logits, theirs, rtol=0, atol=1e-4)
    assert float(theirs.abs().max()) > 0.5  # logits worth comparing
    assert their_steps.tolist() == [s["halt_max_steps"]] * 8
    per_step = (s["H_cycles"] - 1) * (s["L_cycles"] + 1) + s["n_backwards_L"] + 1
    assert applications_per_step(config) == per_step
    assert out.iterations.tolist() == [s["halt_max_steps"] * per_step] * 8  # flat: always the maximum
    # the oracle is sharp: one ACT step fewer, or another cycle count, computes other logits
    with torch.no_grad():
        short = model(batch["inputs"], puzzle_identifiers=batch["puzzle_identifiers"], max_loops=2).logits
    assert float((short - theirs).abs().max()) > 1e-2
    other = load_theirs(sd, trm_config(s, L_cycles=2, n_backwards_L=3)).eval()
    with torch.no_grad():
        assert (
            float((other(batch["inputs"], puzzle_identifiers=batch["puzzle_identifiers"]).logits - theirs).abs().max())
            > 1e-2
        )


def test_trm_carries_its_state_across_calls():
    """Two calls of one and two ACT steps (the second from the first's state) equal one call of three."""
    s = TRM_SETTINGS
    model = load_theirs(trm_state_dict(s, seed=6), trm_config(s)).eval()
    batch = data(4)
    kwargs = dict(puzzle_identifiers=batch["puzzle_identifiers"])
    with torch.no_grad():
        whole = model(batch["inputs"], max_loops=3, **kwargs)
        first = model(batch["inputs"], max_loops=1, **kwargs)
        rest = model(batch["inputs"], max_loops=2, solver_state=first.solver_state, **kwargs)
    torch.testing.assert_close(rest.logits, whole.logits, rtol=0, atol=1e-6)
    assert rest.solver_state.steps.tolist() == [3] * 4
    with pytest.raises(ValueError, match="other inputs"):
        model(batch["inputs"].flip(0), max_loops=1, solver_state=first.solver_state, **kwargs)


class Recorder(TrainerCallback):
    def __init__(self):
        self.grads, self.params = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})


def run_both(tmp_path, steps, config_overrides=None):
    s = TRM_SETTINGS
    sd = trm_state_dict(s, seed=7)
    model = load_theirs(sd, trm_config(s, **(config_overrides or {}))).train()
    rows = data(16, seed=11)
    dataset = Dataset.from_dict(
        {
            "input_ids": rows["inputs"].tolist(),
            "labels": rows["labels"].tolist(),
            "puzzle_identifiers": rows["puzzle_identifiers"].tolist(),
        }
    )
    args = FPRMTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_drop_last=True,
        seed=0,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=LR,
        adam_beta2=0.95,
        weight_decay=0.1,
        warmup_steps=WARMUP,
        loss_type="stablemax",
        lr_schedule="authors",
        loss_normalization="sample",
        puzzle_emb_optimizer="signsgd",
        puzzle_emb_lr=1e-2,
        puzzle_emb_weight_decay=0.5,
    )
    trainer = TRMTrainer(model=model, args=args, train_dataset=dataset)
    recorder = Recorder()
    trainer.add_callback(recorder)
    batches, explored, losses, halted = [], [], [], []
    compute_loss, explore = trainer.compute_loss, trainer.explore

    def spy_loss(m, inputs, *a, **k):
        batches.append({key: v.clone() for key, v in inputs.items()})
        loss = compute_loss(m, inputs, *a, **k)
        losses.append(float(loss.detach()))
        halted.append(trainer.carry.state.halted.clone())
        return loss

    def spy_explore(q, steps_so_far):
        drawn = explore(q, steps_so_far)
        explored.append(drawn.clone())
        return drawn

    trainer.compute_loss, trainer.explore = spy_loss, spy_explore
    trainer.train()
    theirs = TheirTRMTraining(sd, s, LR, WARMUP, 0.1, 1e-2, 0.5)
    replay = []
    for batch, drawn in zip(batches, explored):
        loss, grads = theirs.train_batch(
            {
                "inputs": batch["input_ids"],
                "labels": batch["labels"],
                "puzzle_identifiers": batch["puzzle_identifiers"],
            },
            drawn,
        )
        params = {k: theirs.model.w[k].detach().clone() for k in theirs.trainable}
        replay.append(dict(loss=loss, grads=grads, params=params, halted=theirs.halted.clone()))
    return model.config, losses, recorder, halted, replay


def compare(config, losses, recorder, halted, replay):
    assert len(losses) == len(replay) > 0
    for step, ref in enumerate(replay):
        assert abs(losses[step] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), f"step {step}: loss"
        assert halted[step].tolist() == ref["halted"].tolist(), f"step {step}: halting"
        lr = LR * min(1.0, (step + 1) / WARMUP)
        for key, g in ref["grads"].items():
            name, g = ours_of(key, g, config)
            scale = float(g.abs().max())
            if scale:
                err = float((recorder.grads[step][name] - g).abs().max()) / scale
                assert err <= 1e-4, f"step {step}: gradient of {name} off by {err:.2e} of its largest entry"
        for key, p in ref["params"].items():
            name, p = ours_of(key, p, config)
            err = float((recorder.params[step][name] - p).abs().max()) / lr
            assert err <= 1e-2, f"step {step}: {name} off by {err:.2e} x lr"


def test_trm_training_steps_match_their_training(tmp_path):
    config, losses, recorder, halted, replay = run_both(tmp_path, steps=5)
    compare(config, losses, recorder, halted, replay)
    flags = torch.stack(halted)
    # not vacuous: samples halted by the Q-head before the cap, others were carried on
    assert bool(flags[:-1].any()) and bool((~flags[:-1]).any())
    assert float(recorder.grads[0]["q_head.weight"].abs().max()) > 0


def test_trm_training_oracle_sees_a_gradient_through_more_cycles(tmp_path):
    """Sharp: n_backwards_L = 1 (a gradient through fewer z_L updates, another recursion) is caught."""
    with pytest.raises(AssertionError):
        compare(*run_both(tmp_path, steps=1, config_overrides=dict(n_backwards_L=1)))
