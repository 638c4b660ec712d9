"""Learning-rate warm-ups of the authors' training scripts, on top of the Trainer's schedules.

The Trainer's schedules (`get_scheduler`) warm up as peak·s/W, so optimizer step 0 trains at lr 0. LoopFormer's
train.py (`get_lr`) warms up as peak·(s+1)/(W+1) and then decays by the same cosine to `min_lr` as the Trainer's
`cosine_with_min_lr`; only the warm-up differs, so `ReferenceWarmupCallback` replaces the warm-up and keeps the
Trainer's schedule from step W on.
"""

import torch
from transformers import TrainerCallback

LR_WARMUPS = ("reference", "trainer")


def reference_warmup_factor(step, warmup_steps):
    """LoopFormer's train.py get_lr during warm-up, as a factor of the peak: (s + 1) / (W + 1)."""
    return (step + 1) / (warmup_steps + 1)


class ReferenceWarmupCallback(TrainerCallback):
    """Steps s < W (the Trainer's warm-up steps) train at peak·(s+1)/(W+1), as LoopFormer's train.py; the Trainer's
    schedule from W on. Works with the stock Trainer and any LambdaLR schedule; a resumed run goes on where the
    uninterrupted one would be (the scheduler's step count is in the checkpoint)."""

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if not isinstance(lr_scheduler, torch.optim.lr_scheduler.LambdaLR):
            raise ValueError(
                f"The reference warm-up replaces the warm-up of a LambdaLR schedule (constant, linear, "
                f"cosine, cosine_with_min_lr, ...), got {type(lr_scheduler).__name__}."
            )
        warmup = args.get_warmup_steps(state.max_steps)

        def wrap(trainer_factor):
            # a plain function: LambdaLR's state_dict stores nothing of it, so checkpoints stay as the Trainer's
            def factor(step):
                return reference_warmup_factor(step, warmup) if step < warmup else trainer_factor(step)

            return factor

        lr_scheduler.lr_lambdas = [wrap(f) for f in lr_scheduler.lr_lambdas]
        # LambdaLR set the current step's lr when it was built (or restored): set it again under the new warm-up,
        # also where get_last_lr() reads it (the Trainer logs that value for the step it trains)
        lrs = [base * f(lr_scheduler.last_epoch) for base, f in zip(lr_scheduler.base_lrs, lr_scheduler.lr_lambdas)]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        lr_scheduler._last_lr = lrs
