"""The lab's exit rules for LoopFormer's per-token halting (`halt_eps`), beyond the library's "state_change", and the
model that runs them: [`LabLoopFormerForCausalLM`], whose forward and `generate` take `halt_criterion` (one of
`HALT_CRITERIA`).

- "kl", "entropy": halt_eps thresholds KL(p_i ‖ p_{i−1}) between successive steps' next-token distributions (p_0 from
  the embeddings), or the entropy H(p_i) of the current one (both in nats), read through the LM head.
- their "_shortcut" forms ("state_change_shortcut", "kl_shortcut", "entropy_shortcut"): a token whose score falls
  does not freeze at t_i < 1 (a state LoopFormer's objective never asked it to decode) but takes one more step,
  Δ = 1 − t_i to t = 1, then freezes: its path is a shortcut trajectory of i + 1 steps, the kind the objective trains
  (models conditioned on Δ only, `loop_conditioning="shortcut"`).
- "probe_entropy": every token first runs the one-step trajectory (Δ = 1, a trained endpoint); a token whose
  next-token entropy there is below halt_eps keeps it (1 loop step), the others run the budget from the embeddings
  (1 + M steps). The probe step has its own cache slots, after the budget's.

Each rule is a subclass of [`LabHaltingState`], the library's `LoopFormerHaltingState` with the hooks these rules
override (`start`, `before_loop`, `block_adaln`, `next_step`, `update`, `final_states`, `_score`, `check_model`).
The model reaches the loop through the library's one extension point, the base model's `halting_rule` attribute:
the halting state class its halting loop runs (halting_loopformer.py's `halting_loop`).

The documented result (benchmarks/writeups/halting.md) is that none of them pays for LoopFormer, so the library
keeps none.
"""

import argparse
import copy
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from loopformer_hf import LoopFormerForCausalLM, LoopFormerModel
from loopformer_hf.generation_loopformer import GENERATION_LOOP_KNOBS
from loopformer_hf.halting_loopformer import LoopFormerExitStep, LoopFormerHaltingState, LoopFormerHaltingStep

SHORTCUT_EXIT_SUFFIX = "_shortcut"
PROBE_CRITERION = "probe_entropy"


def shortcut_exit_adaln(model, trajectory, dtype, device, first=1):
    """`exit[j][s]`: block j's adaLN vectors of a step that starts at step s's time t_s and jumps to t = 1
    (Δ = 1 − t_s), for s = `first` .. M − 2 (None elsewhere: no token exits before step 1 has run, and at the last
    step the exit step is the budget's own; s = 0 is the one-step trajectory, the probe's step). The conditioning the
    shortcut trajectory trajectory[:s] + [1 − t_s] gives its last step."""
    steps = list(range(first, max(len(trajectory) - 1, 1)))
    exit_adaln = [[None] * len(trajectory) for _ in model.layers]
    if not steps:
        return exit_adaln
    conditioning = model.loop_conditioning
    starts = torch.tensor([sum(trajectory[:s]) for s in steps], device=device, dtype=torch.float64)
    c = conditioning.time_embedder(starts.float(), dtype) + conditioning.dt_embedder((1 - starts).float(), dtype)
    for j, block in enumerate(model.layers):
        vectors = block.adaln(block.adaLN_modulation(c).to(dtype))
        for i, s in enumerate(steps):
            exit_adaln[j][s] = tuple(v[i] for v in vectors)
    return exit_adaln


def entropy(log_probs):
    return -(log_probs.exp() * log_probs).sum(-1)


class LabExitStep(LoopFormerExitStep):
    """The library's exit step, whose blocks may run other adaLN vectors for some tokens (`block_adaln`)."""

    def block(self, j, adaln):
        rule = self.rule
        return rule.block_adaln(j, self.step, adaln, rule.loop_adaln), rule.block_step(j, self.halted, self.active)


@dataclass
class LabHaltingState(LoopFormerHaltingState):
    """`LoopFormerHaltingState` ("state_change") with the hooks the lab's rules override, called from the four
    methods the loop calls (`begin`, `for_step`, `observe`, `finish`)."""

    readout: object = None  # h -> next-token log-probabilities (the LM head after the final norm), or None

    # Whether the rule combines with per-row budgets (one trajectory per row).
    per_row: ClassVar[bool] = True
    name: ClassVar[str] = ""  # the `halt_criterion` value (set from `LAB_RULES`)

    @classmethod
    def check_model(cls, config, readout):
        """Raise a ValueError if the rule cannot run on a model of `config` (with `readout`, the LM head, or None)."""

    @classmethod
    def begin(cls, model, plan, hidden_states, loop_adaln, cache, mask, position_embeddings):
        readout = getattr(model, "halt_readout", None)
        cls.check_model(model.config, readout)
        if plan.rows is not None and not cls.per_row:
            allowed = ["state_change", *(name for name, rule in LAB_RULES.items() if rule.per_row)]
            raise ValueError(
                f"halt_criterion={cls.name!r} runs an exit step of one trajectory; per-row loop budgets "
                f"or schedules take {allowed} (or one budget for the batch)."
            )
        state, hidden_states = super().begin(model, plan, hidden_states, loop_adaln, cache, mask, position_embeddings)
        state.readout = readout
        state.start(hidden_states)
        if plan.rows is None:
            hidden_states = state.before_loop(
                model, plan.trajectory, loop_adaln, cache, hidden_states, mask, position_embeddings
            )
        return state, hidden_states

    def for_step(self, step, hidden_states, gather=True):
        exit_step = super().for_step(step, hidden_states, gather)
        return None if exit_step is None else LabExitStep(*exit_step)

    def finish(self, hidden_states):
        return super().finish(self.final_states(hidden_states))

    # ---- the hooks ------------------------------------------------------------------------------------------------

    def start(self, hidden_states):
        """After the state is made, before step 1 (`hidden_states`: the embeddings)."""

    def before_loop(self, model, trajectory, loop_adaln, cache, hidden_states, mask, position_embeddings):
        """Before step 1 of a single trajectory (not per-row): returns the loop's input."""
        return hidden_states

    def block_adaln(self, block, step, adaln, loop_adaln):
        """Block `block`'s adaLN vectors at loop step `step`: the trajectory's (`adaln`) unless the rule runs other
        steps for some tokens (`loop_adaln` holds every step's)."""
        return adaln

    def _next_step(self, hidden_size, gather=True):
        return self.next_step(hidden_size, gather)

    def next_step(self, hidden_size, gather=True):
        """(halted mask, gather plan) of the coming loop step."""
        return LoopFormerHaltingState._next_step(self, hidden_size, gather)

    def _update(self, previous, hidden_states, final=False):
        return self.update(previous, hidden_states, final)

    def update(self, previous, hidden_states, final=False):
        """Advance past a loop step: the library's counts and halting, on this rule's `_score`."""
        return LoopFormerHaltingState._update(self, previous, hidden_states, final)

    def final_states(self, hidden_states):
        """The loop's output."""
        return hidden_states


@dataclass
class ReadoutHalting(LabHaltingState):
    """A rule that reads next-token distributions through the LM head (`readout`)."""

    @classmethod
    def check_model(cls, config, readout):
        super().check_model(config, readout)
        if readout is None:
            raise ValueError(
                f"halt_criterion={cls.name!r} reads next-token distributions through the LM head: call "
                f"LabLoopFormerForCausalLM, or use halt_criterion='state_change' with LabLoopFormerModel."
            )


@dataclass
class KLHalting(ReadoutHalting):
    """ "kl": KL(p_i ‖ p_{i−1}) < halt_eps."""

    log_probs: torch.Tensor | None = None  # (batch, seq, vocab) of the current state

    def start(self, hidden_states):
        super().start(hidden_states)
        self.log_probs = self.readout(hidden_states)

    def _score(self, previous, hidden_states):
        log_probs = self.readout(hidden_states)
        score = (log_probs.exp() * (log_probs - self.log_probs)).sum(-1)
        self.log_probs = log_probs
        return score


@dataclass
class EntropyHalting(ReadoutHalting):
    """ "entropy": H(p_i) < halt_eps."""

    def _score(self, previous, hidden_states):
        return entropy(self.readout(hidden_states))


def _check_step_conditioning(config, criterion, instead):
    if config.loop_conditioning != "shortcut":
        raise ValueError(
            f"halt_criterion={criterion!r} runs a step Δ = 1 − t, which only a model conditioned on Δ "
            f"(loop_conditioning='shortcut', LoopFormer) was trained for; this one has loop_conditioning="
            f"{config.loop_conditioning!r}: use halt_criterion={instead!r}."
        )


def _exit_adaln(state, model, trajectory, loop_adaln, cache, first):
    """The exit steps' adaLN vectors of `trajectory` (computed once per inference run: kept on `cache` beside the
    loop's own, `loop_adaln`, which is the same object while the cache keeps it)."""
    memo = getattr(cache, "halting_exit_memo", None)
    if memo is not None and memo[0] is loop_adaln and not torch.is_grad_enabled():
        return memo[1]
    vectors = loop_adaln[0][0][0]
    exit_adaln = shortcut_exit_adaln(model, trajectory, vectors.dtype, vectors.device, first=first)
    if cache is not None and not torch.is_grad_enabled():
        cache.halting_exit_memo = (loop_adaln, exit_adaln)
    return exit_adaln


@dataclass
class ShortcutExit(LabHaltingState):
    """The "_shortcut" forms: tokens whose score fell below halt_eps after the last step run one exit step
    (Δ = 1 − t) at the coming step, then freeze. Combine it with a score: `class KLShortcut(ShortcutExit, KLHalting)`."""

    exit_adaln: list | None = None  # shortcut_exit_adaln(...) of this call's trajectory
    exiting: torch.BoolTensor | None = None  # (batch, seq) bool, None while no token exits
    num_exiting: int = 0

    per_row: ClassVar[bool] = False  # the exit step's conditioning comes from one trajectory

    @classmethod
    def check_model(cls, config, readout):
        super().check_model(config, readout)
        _check_step_conditioning(config, cls.name, cls.name[: -len(SHORTCUT_EXIT_SUFFIX)])

    def before_loop(self, model, trajectory, loop_adaln, cache, hidden_states, mask, position_embeddings):
        hidden_states = super().before_loop(
            model, trajectory, loop_adaln, cache, hidden_states, mask, position_embeddings
        )
        self.exit_adaln = _exit_adaln(self, model, trajectory, loop_adaln, cache, first=1)
        return hidden_states

    def block_adaln(self, block, step, adaln, loop_adaln):
        """The exit step's vectors for the exiting tokens, the trajectory's for the others, per token ((batch, seq,
        d) each) unless every token whose result or keys count exits."""
        if self.exiting is None:
            return adaln
        exit_vectors, adaln = self.exit_adaln[block][step], loop_adaln[block][step]
        if self.num_exiting == self.num_active and (self.reuse_kv or self.all_active()):
            return exit_vectors  # the halted tokens' results are dropped and their keys reused
        exiting = self.exiting[..., None]
        return tuple(torch.where(exiting, e, a) for e, a in zip(exit_vectors, adaln))

    def next_step(self, hidden_size, gather=True):
        # an exit step's adaLN is per token: dense
        return super().next_step(hidden_size, gather=gather and self.exiting is None)

    def update(self, previous, hidden_states, final=False):
        """The tokens that just ran their exit step freeze; of the others, those whose score fell below halt_eps exit
        at the next step, unless it is the budget's last (it is their exit)."""
        if final or self.row_budgets is not None:
            return super().update(previous, hidden_states, final)
        self.step += 1
        finishing, num_finishing = self.exiting, self.num_exiting
        self._count_step()
        self.exiting, self.num_exiting = None, 0
        if finishing is not None:
            if num_finishing == self.num_active:  # every token still computed has finished: no score to read
                self.active, self.num_active = torch.zeros_like(self.active), 0
                return self
            self.active = self.active & ~finishing
            self.num_active -= num_finishing
        if self.step >= self.num_steps - 1:  # the next step is the last: whoever stops now stops after it anyway
            return self
        score = self._score(previous, hidden_states)
        if score.numel() == 1:  # one token (decoding): one sync
            if score.item() < self.halt_eps:
                self.exiting, self.num_exiting = torch.ones_like(self.active), 1
            return self
        exiting = (score < self.halt_eps) & self.active
        num_exiting = int(exiting.sum())  # one sync per step
        if num_exiting:
            self.exiting, self.num_exiting = exiting, num_exiting
        return self


@dataclass
class StateChangeShortcut(ShortcutExit):
    """ "state_change_shortcut"."""


@dataclass
class KLShortcut(ShortcutExit, KLHalting):
    """ "kl_shortcut"."""


@dataclass
class EntropyShortcut(ShortcutExit, EntropyHalting):
    """ "entropy_shortcut"."""


@dataclass
class ProbeEntropy(ReadoutHalting):
    """ "probe_entropy": the one-step trajectory first, the budget only for the tokens unsure there."""

    exit_adaln: list | None = None
    probe_states: torch.Tensor | None = None  # the one-step trajectory's output, kept by the tokens sure of it

    extra_slots: ClassVar[int] = 1  # the probe step's own slots, after the budget's
    per_row: ClassVar[bool] = False

    @classmethod
    def check_model(cls, config, readout):
        super().check_model(config, readout)
        _check_step_conditioning(config, cls.name, "entropy")

    def start(self, hidden_states):
        super().start(hidden_states)
        self.reuse_kv = True  # the probe's tokens are frozen at the embeddings: their slots repeat the probe's

    def before_loop(self, model, trajectory, loop_adaln, cache, hidden_states, mask, position_embeddings):
        """Every token runs the one-step trajectory (its keys/values in the cache slots after the budget's); the
        tokens whose next-token entropy there is below halt_eps keep its output (`final_states`) and sit out the loop,
        their slots repeating the probe's keys/values. Returns the loop's input (the embeddings, unchanged)."""
        super().before_loop(model, trajectory, loop_adaln, cache, hidden_states, mask, position_embeddings)
        self.exit_adaln = _exit_adaln(self, model, trajectory, loop_adaln, cache, first=0)
        h = hidden_states
        for j, block in enumerate(model.layers):
            record = LoopFormerHaltingStep(None)  # no token frozen; it keeps the block's keys and values
            h = block(
                h,
                None,
                adaln=self.exit_adaln[j][0],
                attention_mask=mask,
                position_embeddings=position_embeddings,
                cache=cache,
                step_offset=self.num_steps * len(model.layers),
                halting=record,
            )
            self.last_kv[j] = record.kv
        sure = entropy(self.readout(h)) < self.halt_eps  # NaN: unsure
        self.probe_states, self.steps_all_ran = h, 1
        self.active = ~sure
        self.num_active = int(self.active.sum())  # one sync
        return hidden_states

    def update(self, previous, hidden_states, final=False):
        if self.row_budgets is not None:
            return super().update(previous, hidden_states, final)
        self.step += 1
        self._count_step()  # the probe's unsure tokens run the whole budget
        return self

    def final_states(self, hidden_states):
        """The loop's output, with the probe's for the tokens that kept it."""
        if self.probe_states is None:
            return hidden_states
        if self.num_active == 0:
            return self.probe_states
        return torch.where(self.active[..., None], hidden_states, self.probe_states)


LAB_RULES = {
    "kl": KLHalting,
    "entropy": EntropyHalting,
    "state_change_shortcut": StateChangeShortcut,
    "kl_shortcut": KLShortcut,
    "entropy_shortcut": EntropyShortcut,
    PROBE_CRITERION: ProbeEntropy,
}
for _name, _rule in LAB_RULES.items():
    _rule.name = _name

# every rule, the library's first: what the lab's sweeps iterate over
HALT_CRITERIA = ("state_change", *LAB_RULES)


def halting_rule(criterion):
    """The halting state class a `halt_criterion` value names (the library's for "state_change"), or a ValueError
    listing them."""
    rule = {"state_change": LoopFormerHaltingState, **LAB_RULES}.get(criterion) if isinstance(criterion, str) else None
    if rule is None:
        raise ValueError(f"`halt_criterion` must be one of {HALT_CRITERIA}, got {criterion!r}.")
    return rule


# ---- the model that runs them --------------------------------------------------------------------------------------


class LabLoopFormerModel(LoopFormerModel):
    """`LoopFormerModel` whose forward also takes `halt_criterion` (a `HALT_CRITERIA` value, default "state_change")
    and `halt_head` (the LM head the readout rules read next-token distributions through)."""

    halting_rule = None  # this forward's halting state class (`halt_criterion`), for the library's halting loop
    halt_readout = None  # this forward's h -> next-token log-probabilities, for `LabHaltingState.begin`

    def forward(self, *args, halt_criterion=None, halt_head=None, **kwargs):
        rule = halting_rule(halt_criterion or "state_change")  # a bad name is refused with or without halt_eps
        readout = None if halt_head is None else (lambda h: F.log_softmax(halt_head(self.norm(h)).float(), dim=-1))
        self.halting_rule, self.halt_readout = rule, readout
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.halting_rule = self.halt_readout = None


class LabLoopFormerForCausalLM(LoopFormerForCausalLM):
    """`LoopFormerForCausalLM` whose forward and `generate` also take `halt_criterion` (a `HALT_CRITERIA` value):
    the halting rule a call with `halt_eps` runs. Loads any LoopFormer checkpoint (`from_pretrained`), or wraps a
    loaded model (`of`)."""

    generation_loop_knobs = (*GENERATION_LOOP_KNOBS, "halt_criterion")

    def __init__(self, config):
        super().__init__(config)
        self.model = LabLoopFormerModel(config)
        self.post_init()

    @classmethod
    def of(cls, model):
        """A lab model with `model`'s config and weights, on its device and in its dtype."""
        lab = cls(model.config).to(device=model.device, dtype=model.dtype)
        lab.load_state_dict(model.state_dict())
        lab.generation_config = copy.deepcopy(model.generation_config)
        return lab.train(model.training)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        loop_budget=None,
        step_schedule=None,
        halt_eps=None,
        shortcut_consistency=None,
        halt_criterion=None,
        **kwargs,
    ):
        # the library's, named in full (`generate` keeps the kwargs its signature names); it hands its other keywords
        # to `self.model`: this call's rule and the LM head
        return super().forward(
            input_ids,
            attention_mask,
            position_ids,
            cache,
            inputs_embeds,
            labels,
            use_cache,
            logits_to_keep,
            loop_budget,
            step_schedule,
            halt_eps,
            shortcut_consistency,
            halt_criterion=halt_criterion,
            halt_head=self.lm_head,
            **kwargs,
        )


# ---- evaluation with the lab's rules -------------------------------------------------------------------------------


def runs_on(model, criterion):
    """Whether the exit rule `criterion` runs on `model` (its own check, as a forward makes it)."""
    rule = halting_rule(criterion)
    try:
        if issubclass(rule, LabHaltingState):
            rule.check_model(model.config, model.get_output_embeddings())
    except ValueError:
        return False
    return True


def evaluate_halting(criteria, model, task, data, eps_values):
    """`looped_training.loopformer.metrics.evaluate_halting` for each exit rule of `criteria` that runs on `model`
    (e.g. the "_shortcut" rules on a model conditioned on Δ only): its records carry their `criterion`."""
    from looped_training.loopformer.metrics import halting_sweep

    lab = LabLoopFormerForCausalLM.of(model)
    trajectory = model.config.resolve_trajectory(model.config.num_loops, "uniform")
    results = []
    for criterion in [c for c in criteria if runs_on(lab, c)]:
        sweep = halting_sweep(lab, task, data, trajectory, eps_values, halt_criterion=criterion)
        results += [dict(criterion=criterion, **r) for r in sweep]
    return results


def main(argv=None):
    """`python -m benchmarks.halting_rules ARGS --halt_criteria RULE ...`: looped_training.loopformer.evaluate, whose
    --halt_eps sweep runs each rule (default: "state_change" alone), e.g. `--halt_eps 0.1 --halt_criteria
    state_change state_change_shortcut`."""
    from looped_training.loopformer.evaluate import main as evaluate

    parser = argparse.ArgumentParser(prog="python -m benchmarks.halting_rules", add_help=False)
    parser.add_argument("--halt_criteria", nargs="*", default=["state_change"])
    args, rest = parser.parse_known_args(argv)
    bad = [c for c in args.halt_criteria if c not in HALT_CRITERIA]
    if bad:
        raise ValueError(f"--halt_criteria {bad} unknown; allowed: {HALT_CRITERIA}.")
    return evaluate(rest, halting=functools.partial(evaluate_halting, args.halt_criteria))


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, "python -m benchmarks.halting_rules")
