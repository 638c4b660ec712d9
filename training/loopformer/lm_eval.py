"""lm-evaluation-harness with the loop budget chosen on the command line.

Two routes, both tested (tests/training/loopformer/test_lm_eval.py):

1. The stock `hf` model. Extra `--model_args` go to `from_pretrained`, which sets config fields, so the config's
   default budget and schedule select the depth of every forward and generate call:

       lm_eval --model hf --model_args pretrained=runs/loopformer-tiny,trust_remote_code=True,default_loop_budget=2 \
           --tasks lambada_openai --device cpu --batch_size 8

   (`default_step_schedule=coarse_to_fine` picks a preset the same way.)

2. This module's registered model `loopformer`, which passes `loop_budget` / `step_schedule` explicitly to each
   call (a schedule is a preset name or colon-separated steps, since commas separate model_args):

       python -m looped_training.loopformer.lm_eval --model loopformer \
           --model_args pretrained=runs/loopformer-tiny,loop_budget=4,step_schedule=0.4:0.3:0.2:0.1 \
           --tasks lambada_openai --device cpu --batch_size 8

   `python -m looped_training.loopformer.lm_eval` is the `lm_eval` command with the `loopformer` model registered; in Python,
   `import looped_training.loopformer.lm_eval` before `lm_eval.simple_evaluate(model="loopformer", ...)` does the same.
"""

PROG = "python -m looped_training.loopformer.lm_eval"
try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ModuleNotFoundError as err:  # the `eval` extra; `--help` included, one line naming it
    from looped_training.arguments import exit_for_missing_extra

    exit_for_missing_extra(err, PROG, command=__name__ == "__main__")


def parse_step_schedule(value):
    """None, a preset name, or 'a:b:c' / a list of numbers -> what LoopFormer's forward accepts."""
    if value is None or isinstance(value, (list, tuple)):
        return value
    text = str(value).strip()
    if ":" in text or text.replace(".", "", 1).isdigit():
        try:
            return [float(v) for v in text.split(":")]
        except ValueError:
            pass
        raise ValueError(
            f"step_schedule must be a preset name or colon-separated numbers like 0.5:0.25:0.25, got {value!r}."
        )
    return text


@register_model("loopformer")
class LoopFormerLM(HFLM):
    """`HFLM` that runs every log-likelihood forward and every generate call at a chosen trajectory."""

    def __init__(self, pretrained, loop_budget=None, step_schedule=None, **kwargs):
        import loopformer_hf  # noqa: F401  (registers the Auto classes; trust_remote_code then is not needed)

        if loop_budget is not None and (
            isinstance(loop_budget, bool) or not isinstance(loop_budget, int) or loop_budget < 1
        ):
            raise ValueError(f"loop_budget must be an integer >= 1, got {loop_budget!r}.")
        self.loop_budget = loop_budget
        self.step_schedule = parse_step_schedule(step_schedule)
        super().__init__(pretrained=pretrained, **kwargs)
        # fail at start-up, not after the first batch, on a budget/schedule the model rejects
        self.model.config.resolve_trajectory(self.loop_budget, self.step_schedule)

    def _depth_kwargs(self):
        kwargs = {}
        if self.loop_budget is not None:
            kwargs["loop_budget"] = self.loop_budget
        if self.step_schedule is not None:
            kwargs["step_schedule"] = self.step_schedule
        return kwargs

    def _model_call(self, inps, attn_mask=None, labels=None):
        import torch

        with torch.no_grad():
            return self.model(inps, **self._depth_kwargs()).logits

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        return super()._model_generate(context, max_length, stop, **generation_kwargs, **self._depth_kwargs())


def main():
    from lm_eval.__main__ import cli_evaluate

    return cli_evaluate()


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, PROG)
