"""The lab's exit rules for LoopFormer's per-token halting (`halt_eps`), beyond the library's "state_change":
subclasses of `LoopFormerHaltingState`, registered as `halt_criterion` values on import.

- "kl", "entropy": halt_eps thresholds KL(p_i ‖ p_{i−1}) between successive steps' next-token distributions (p_0 from
  the embeddings), or the entropy H(p_i) of the current one (both in nats), read through the LM head.
- their "_shortcut" forms ("state_change_shortcut", "kl_shortcut", "entropy_shortcut"): a token whose score falls
  does not freeze at t_i < 1 (a state LoopFormer's objective never asked it to decode) but takes one more step,
  Δ = 1 − t_i to t = 1, then freezes: its path is a shortcut trajectory of i + 1 steps, the kind the objective trains
  (models conditioned on Δ only, `loop_conditioning="shortcut"`).
- "probe_entropy": every token first runs the one-step trajectory (Δ = 1, a trained endpoint); a token whose
  next-token entropy there is below halt_eps keeps it (1 loop step), the others run the budget from the embeddings
  (1 + M steps). The probe step has its own cache slots, after the budget's.

The documented result (benchmarks/writeups/halting.md) is that none of them pays for LoopFormer, so the library
keeps none: `import benchmarks.halting_rules` and then `halt_criterion="kl"` etc. work as before.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from loopformer_hf.halting_loopformer import LoopFormerHaltingState, LoopFormerHaltingStep, register_halting_rule

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


@dataclass
class ReadoutHalting(LoopFormerHaltingState):
    """A rule that reads next-token distributions through the LM head (`readout`)."""

    @classmethod
    def check_model(cls, config, readout, criterion):
        super().check_model(config, readout, criterion)
        if readout is None:
            raise ValueError(
                f"halt_criterion={criterion!r} reads next-token distributions through the LM head: call "
                f"LoopFormerForCausalLM, or use halt_criterion='state_change' with LoopFormerModel."
            )


@dataclass
class KLHalting(ReadoutHalting):
    """ "kl": KL(p_i ‖ p_{i−1}) < halt_eps."""

    log_probs: torch.Tensor | None = None  # (batch, seq, vocab) of the current state

    @classmethod
    def start(cls, halt_eps, config, hidden_states, readout=None, rows=None, criterion="kl"):
        state = super().start(halt_eps, config, hidden_states, readout, rows, criterion)
        state.log_probs = readout(hidden_states) if halt_eps is not None else None
        return state

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
class ShortcutExit(LoopFormerHaltingState):
    """The "_shortcut" forms: tokens whose score fell below halt_eps after the last step run one exit step
    (Δ = 1 − t) at the coming step, then freeze. Combine it with a score: `class KLShortcut(ShortcutExit, KLHalting)`."""

    exit_adaln: list | None = None  # shortcut_exit_adaln(...) of this call's trajectory
    exiting: torch.BoolTensor | None = None  # (batch, seq) bool, None while no token exits
    num_exiting: int = 0

    per_row: ClassVar[bool] = False  # the exit step's conditioning comes from one trajectory

    @classmethod
    def check_model(cls, config, readout, criterion):
        super().check_model(config, readout, criterion)
        _check_step_conditioning(config, criterion, criterion[: -len(SHORTCUT_EXIT_SUFFIX)])

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
    def check_model(cls, config, readout, criterion):
        super().check_model(config, readout, criterion)
        _check_step_conditioning(config, criterion, "entropy")

    @classmethod
    def start(cls, halt_eps, config, hidden_states, readout=None, rows=None, criterion=PROBE_CRITERION):
        state = super().start(halt_eps, config, hidden_states, readout, rows, criterion)
        state.reuse_kv = True  # the probe's tokens are frozen at the embeddings: their slots repeat the probe's
        return state

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
                cache_slot=cache.slot(self.num_steps, j) if cache is not None else 0,
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
    register_halting_rule(_name, _rule)

# every rule, the library's first: what the lab's sweeps iterate over
HALT_CRITERIA = ("state_change", *LAB_RULES)


def main(argv=None):
    """`python -m benchmarks.halting_rules ARGS`: looped_training.loopformer.evaluate with the lab's rules registered
    (e.g. `--halt_eps 0.1 --halt_criteria state_change state_change_shortcut`)."""
    from looped_training.loopformer.evaluate import main as evaluate

    return evaluate(argv)


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, "python -m benchmarks.halting_rules")
