"""Per-token halting of LoopFormer's loop (`halt_eps`): a token stops looping once its halting score falls below
`halt_eps`; its state is frozen, and the cache slots of the steps it skips are filled so that later tokens can still
attend to every (loop step, block).

Exit rules (`halt_criterion`): "state_change", "kl", "entropy" freeze a token where its score falls (at t_i < 1, a
state LoopFormer's objective never asked it to decode). Their "_shortcut" forms ("kl_shortcut", ...) let the token
take one more step, Δ = 1 − t_i from t_i to t = 1, before it freezes: its path is then a shortcut trajectory of i + 1
steps, the kind the objective trains (models conditioned on Δ only, `loop_conditioning="shortcut"`).

- [`LoopFormerHaltingState`]: the halting carried through one forward's loop (which tokens are active, their loop
  counts, the scores of `halt_criterion`), as `FPRMSolverState` is for FPRM's solver.
- [`LoopFormerHaltingStep`]: what one block needs at one loop step (the one object a block takes).
- [`LoopFormerActiveTokens`]: the gather plan that leaves halted tokens out of a step's computation.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch



# Halted tokens are skipped (gathered out) once the active ones fill at most this share of the (batch, seq) grid:
# below it the saved matmuls outweigh the gather/scatter copies (measured on CPU, benchmarks/bench_halting.py).
GATHER_ACTIVE_FRACTION = 0.75
# ... and only in a grid of at least this many (tokens x hidden_size) elements: the gather/scatter adds ~20 tensor
# ops per block and step whatever the size, which small grids do not win back (on CPU, widths 64-1024, it cost
# 5-34 % up to 8192 elements and saved 6-21 % from 16384 on: `python -m benchmarks.bench_halting --gather`).
GATHER_MIN_GRID = 64 * 256


class LoopFormerActiveTokens:
    """The tokens a loop step still computes under halting: row `rows[r]`'s active positions `index[r]`, padded to
    the longest row with halted positions (`valid` False; their results are dropped). Rows without an active token
    are left out, so batched decoding skips halted rows."""

    def __init__(self, active):
        counts = active.sum(-1)
        self.batch_size = active.shape[0]
        self.rows = counts.nonzero().squeeze(-1)
        width = int(counts.max())
        # a stable sort of "halted" puts each row's active positions first, in order
        self.index = torch.argsort((~active[self.rows]).to(torch.uint8), dim=-1, stable=True)[:, :width]
        self.valid = torch.arange(width, device=active.device) < counts[self.rows, None]
        self.flat_rows = self.rows[:, None].expand_as(self.index)[self.valid]
        self.flat_index = self.index[self.valid]
        # Rows first..last all computed and the others not (per-row budgets, a batch sorted by budget): a slice, so
        # the rows' cached keys and values are read as a view instead of copied at every block
        first, last = (int(r) for r in self.rows[[0, -1]])
        self.row_block = slice(first, last + 1) if last - first + 1 == len(self.rows) else None
        self.whole_rows = self.row_block is not None and width == active.shape[1] and bool(self.valid.all())

    @classmethod
    def worth_gathering(cls, active, num_active, hidden_size):
        """The gather plan for `active` ((batch, seq) bool, `num_active` of them True, states of width `hidden_size`)
        when it saves work, else None."""
        if active.numel() * hidden_size < GATHER_MIN_GRID:
            return None
        if num_active > GATHER_ACTIVE_FRACTION * active.numel():
            return None  # the padded plan holds at least every active token: not worth building it
        plan = cls(active)
        return plan if plan.index.numel() <= GATHER_ACTIVE_FRACTION * active.numel() else None

    def gather(self, x):
        """(batch, seq, ...) -> (rows, width, ...)."""
        return x[self.row_block] if self.whole_rows else x[self.rows[:, None], self.index]

    def gather_positions(self, position_embeddings):
        """Rotary (cos, sin), (batch, 1, seq, head_dim) -> (rows, 1, width, head_dim)."""
        return None if position_embeddings is None else tuple(self.gather(p[:, 0])[:, None] for p in position_embeddings)

    def gather_rows(self, x):
        if len(self.rows) == self.batch_size:
            return x
        return x[self.rows] if self.row_block is None else x[self.row_block]

    def gather_mask(self, attention_mask, q_len, kv_len):
        """The rows of the (batch, 1, q_len, kv_len) mask the gathered queries use; None stands for plain causal."""
        if attention_mask is None:
            query_positions = kv_len - q_len + self.index  # the queries are the last q_len of the kv positions
            return (torch.arange(kv_len, device=self.index.device) <= query_positions[..., None])[:, None]
        attention_mask = attention_mask.expand(self.batch_size, *attention_mask.shape[1:])  # a 4D mask may broadcast
        if self.whole_rows:
            return attention_mask[self.row_block]
        return attention_mask[self.rows[:, None], 0, self.index][:, None]

    def scatter(self, x, part):
        """A copy of `x` (batch, seq, ...) with the valid entries of `part` (rows, width, ...) written back."""
        out = x.clone()
        if self.whole_rows:
            out[self.row_block] = part
        else:
            out[self.flat_rows, self.flat_index] = part[self.valid]
        return out

    def scatter_heads(self, x, part):
        """As `scatter` for (batch, heads, seq, head_dim) tensors."""
        out = x.clone()
        if self.whole_rows:
            out[self.row_block] = part
        else:
            out[self.flat_rows, :, self.flat_index] = part.transpose(1, 2)[self.valid]
        return out


class LoopFormerHaltingStep(NamedTuple):
    """What one block needs at one loop step to keep halted tokens frozen: the (batch, seq) `halted` mask, the
    `active` tokens' gather plan (None: compute every token and restore the halted ones), and with
    `halt_kv_fill="reuse"` the (keys, values) of the block's last computed step (`reuse`), which halted tokens repeat
    in this step's cache slot."""

    halted: torch.BoolTensor
    active: LoopFormerActiveTokens | None = None
    reuse: tuple | None = None

    def gather(self, x):
        """The (batch, seq, ...) rows this step computes: all of `x`, or the active tokens'."""
        return x if self.active is None else self.active.gather(x)

    def gather_positions(self, position_embeddings):
        return position_embeddings if self.active is None else self.active.gather_positions(position_embeddings)

    def keys_values(self, project, hidden_states, position_embeddings):
        """This step's (keys, values) of every token, `project(hidden_states, position_embeddings)` giving those of
        the tokens it computes; halted tokens take `reuse`'s when given (else their frozen state's projection)."""
        if self.reuse is None:
            return project(hidden_states, position_embeddings)
        if self.active is not None:  # project only the active tokens, into a copy of the reused keys/values
            k, v = project(self.active.gather(hidden_states), self.active.gather_positions(position_embeddings))
            return self.active.scatter_heads(self.reuse[0], k), self.active.scatter_heads(self.reuse[1], v)
        k, v = project(hidden_states, position_embeddings)
        halted = self.halted[:, None, :, None]
        return torch.where(halted, self.reuse[0], k), torch.where(halted, self.reuse[1], v)

    def attended(self, keys, values, attention_mask, q_len):
        """(keys, values, mask) for the gathered queries: the rows of the computed sequences."""
        if self.active is None:
            return keys, values, attention_mask
        keys, values = self.active.gather_rows(keys), self.active.gather_rows(values)
        return keys, values, self.active.gather_mask(attention_mask, q_len, keys.shape[2])

    def gather_adaln(self, vectors):
        """Per-row adaLN vectors ((batch, 1, d), per-row trajectories) of the rows this step computes."""
        if self.active is None:
            return vectors
        return tuple(v if v.dim() < 3 else self.active.gather_rows(v) for v in vectors)

    def merge(self, frozen, computed):
        """The block's output: `computed` for the tokens that ran, `frozen` (the input) for the halted ones."""
        if self.active is not None:
            return self.active.scatter(frozen, computed)
        return torch.where(self.halted[..., None], frozen, computed)


# What `halt_eps` thresholds (LoopFormerHaltingState.update): the relative state change, the KL divergence between
# successive steps' next-token distributions, or the entropy of the current one (both in nats). The "_shortcut" forms
# exit through one step Δ = 1 − t to t = 1 before freezing; "probe_entropy" runs the one-step trajectory first and the
# budget only for the tokens unsure there (models conditioned on Δ only).
HALT_CRITERIA = ("state_change", "kl", "entropy", "state_change_shortcut", "kl_shortcut", "entropy_shortcut",
                 "probe_entropy")
SHORTCUT_EXIT_SUFFIX = "_shortcut"
# "probe_entropy": every token first runs the one-step trajectory (Δ = 1, a trained endpoint); a token whose
# next-token entropy there is below halt_eps keeps it (1 loop step), the others run the budget from the embeddings
# (1 + M steps). The probe step has its own cache slots, after the budget's (`probe_slots`).
PROBE_CRITERION = "probe_entropy"


def check_halt_eps(value, name="halt_eps"):
    """`None` (fixed depth) or a positive finite float: the per-token halting threshold."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be None or a positive finite float, got {value!r} ({type(value).__name__}).")
    return float(value)


def check_halt_criterion(criterion):
    """A call's `halt_criterion`: one of `HALT_CRITERIA`."""
    if criterion not in HALT_CRITERIA:
        raise ValueError(f"`halt_criterion` must be one of {HALT_CRITERIA}, got {criterion!r}.")
    return criterion


def probe_slots(criterion):
    """Extra loop-step slots per block a cache needs under `criterion`: 1 for the probe's step, else 0."""
    return int(criterion == PROBE_CRITERION)


def split_criterion(criterion):
    """("state_change" | "kl" | "entropy" | "probe_entropy", exits through a shortcut step) of a `halt_criterion`
    value."""
    if criterion.endswith(SHORTCUT_EXIT_SUFFIX):
        return criterion[:-len(SHORTCUT_EXIT_SUFFIX)], True
    return criterion, False


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


def state_change_score(previous, hidden_states):
    """‖h_i − h_{i−1}‖∞ / (‖h_i‖∞ + 1e-8) per token, in float32: the "state_change" halting criterion."""
    delta, norm = (hidden_states - previous).abs().amax(-1), hidden_states.abs().amax(-1)
    if delta.dtype != torch.float32:  # after amax: abs and max are exact in any dtype
        delta, norm = delta.float(), norm.float()
    return delta / (norm + 1e-8)


@dataclass
class LoopFormerHaltingState:
    """Per-token halting (`halt_eps`) carried through the loop, as `FPRMSolverState` is for FPRM's solver.

    `active` tokens keep looping; a halted token's state is frozen, and the cache slots it skips are filled
    (`halt_kv_fill`) so that later tokens can still attend to every slot. `criterion` says what `halt_eps`
    thresholds (see `update`). Updated in place, one loop step at a time.

    Per-row trajectories (`row_budgets`) freeze a row's tokens after its own last step the same way, with or without
    `halt_eps` (None: only the budgets halt).
    """

    halt_eps: float | None
    reuse_kv: bool  # halt_kv_fill == "reuse": skipped slots repeat the token's last computed keys/values
    active: torch.BoolTensor  # (batch, seq)
    num_active: int  # active.sum(), read once per step (one device sync) for every check of that step
    last_kv: list  # per block: the (keys, values) of the last step each token computed
    criterion: str = "state_change"
    readout: object = None  # h -> next-token log-probabilities ("kl", "entropy")
    log_probs: torch.Tensor | None = None  # (batch, seq, vocab) of the current state ("kl")
    # Loop steps every token ran (counted in Python while no token has halted), plus `partial_counts` (batch, seq):
    # the steps run since (decoding one token never needs a tensor for its count).
    steps_all_ran: int = 0
    partial_counts: torch.LongTensor | None = None
    # The "_shortcut" exit rules: tokens whose score fell below halt_eps after the last step run one exit step
    # (Δ = 1 − t) at the coming step, then freeze. `exiting` (batch, seq) bool, None while no token exits.
    shortcut_exit: bool = False
    exit_adaln: list | None = None  # shortcut_exit_adaln(...) of this call's trajectory
    exiting: torch.BoolTensor | None = None
    num_exiting: int = 0
    step: int = 0  # loop steps run so far in this call
    num_steps: int = 0  # the call's budget M
    probe: bool = False  # "probe_entropy"
    probe_states: torch.Tensor | None = None  # the one-step trajectory's output, kept by the tokens sure of it
    row_budgets: torch.LongTensor | None = None  # (batch,) per-row budgets M_b
    # the same as plain ints in eager code, which counts the active tokens without a device sync; None in a compiled
    # forward, which reads no value of the rows and computes every token (`num_active` is then None after step 1)
    row_steps: tuple | None = None

    @classmethod
    def start(cls, halt_eps, config, hidden_states, criterion="state_change", readout=None, rows=None):
        """The state before step 1; `rows` (a `LoopFormerRows`) halts each row after its own budget."""
        batch_seq, device = hidden_states.shape[:2], hidden_states.device
        if halt_eps is None:  # per-row budgets alone: no score
            criterion = "state_change"
        score, shortcut_exit = split_criterion(criterion)
        if score != "state_change" and readout is None:
            raise ValueError(
                f"halt_criterion={criterion!r} reads next-token distributions through the LM head: call "
                f"LoopFormerForCausalLM, or use halt_criterion='state_change' with LoopFormerModel."
            )
        probe = score == PROBE_CRITERION
        if (shortcut_exit or probe) and config.loop_conditioning != "shortcut":
            raise ValueError(
                f"halt_criterion={criterion!r} runs a step Δ = 1 − t, which only a model conditioned on Δ "
                f"(loop_conditioning='shortcut', LoopFormer) was trained for; this one has loop_conditioning="
                f"{config.loop_conditioning!r}: use halt_criterion={'entropy' if probe else score!r}."
            )
        if probe and config.cache_sharing != "none":
            raise ValueError(f"halt_criterion={criterion!r} keeps the probe step in cache slots of its own, which "
                             f"cache_sharing={config.cache_sharing!r} does not have: use cache_sharing='none'.")
        # the probe's tokens are frozen at the embeddings through the loop: their slots repeat the probe's keys/values
        state = cls(halt_eps, config.halt_kv_fill == "reuse" or probe,
                    torch.ones(batch_seq, dtype=torch.bool, device=device), batch_seq.numel(),
                    [None] * config.num_hidden_layers, score, readout,
                    readout(hidden_states) if score == "kl" and halt_eps is not None else None,
                    shortcut_exit=shortcut_exit, probe=probe)
        if rows is not None:
            state.num_steps, state.row_budgets = rows.num_steps, rows.budgets.to(device)
            state.row_steps = None if torch.compiler.is_compiling() else tuple(map(len, rows.trajectories))
        return state

    def prepare_exits(self, model, trajectory, loop_adaln, cache):
        """Before the loop: with a "_shortcut" rule, the exit steps' adaLN vectors of `trajectory` (computed once per
        inference run: kept on `cache` beside the loop's own, `loop_adaln`, which is the same object while the cache
        keeps it)."""
        self.num_steps = len(trajectory)
        if not (self.shortcut_exit or self.probe):
            return
        memo = getattr(cache, "halting_exit_memo", None)
        if memo is not None and memo[0] is loop_adaln and not torch.is_grad_enabled():
            self.exit_adaln = memo[1]
            return
        self.exit_adaln = shortcut_exit_adaln(model, trajectory, loop_adaln[0][0][0].dtype, loop_adaln[0][0][0].device,
                                              first=0 if self.probe else 1)
        if cache is not None and not torch.is_grad_enabled():
            cache.halting_exit_memo = (loop_adaln, self.exit_adaln)

    def run_probe(self, blocks, hidden_states, mask, position_embeddings, cache):
        """"probe_entropy", before the loop: every token runs the one-step trajectory (its keys/values in the cache
        slots after the budget's); the tokens whose next-token entropy there is below halt_eps keep its output
        (`final_states`) and sit out the loop, their slots repeating the probe's keys/values. Returns the loop's input
        (the embeddings, unchanged)."""
        if not self.probe:
            return hidden_states
        h = hidden_states
        for j, block in enumerate(blocks):
            h, _, self.last_kv[j] = block(
                h, None, adaln=self.exit_adaln[j][0], attention_mask=mask, position_embeddings=position_embeddings,
                cache=cache, cache_slot=cache.slot(self.num_steps, j) if cache is not None else 0)
        log_probs = self.readout(h)
        sure = (log_probs.exp() * log_probs).sum(-1) > -self.halt_eps  # entropy < halt_eps (NaN: unsure)
        self.probe_states, self.steps_all_ran = h, 1
        self.active = ~sure
        self.num_active = int(self.active.sum())  # one sync
        return hidden_states

    def final_states(self, hidden_states):
        """The loop's output, with the probe's for the tokens that kept it."""
        if self.probe_states is None:
            return hidden_states
        if self.num_active == 0:
            return self.probe_states
        return torch.where(self.active[..., None], hidden_states, self.probe_states)

    def exit_step_adaln(self, block, step, adaln):
        """Block `block`'s adaLN vectors at loop step `step` while some tokens take their exit step there: the exit
        step's for those tokens, `adaln` (the trajectory's) for the others, per token ((batch, seq, d) each) unless
        every token whose result or keys count exits."""
        exit_vectors = self.exit_adaln[block][step]
        if self.num_exiting == self.num_active and (self.reuse_kv or self.all_active()):
            return exit_vectors  # the halted tokens' results are dropped and their keys reused
        exiting = self.exiting[..., None]
        return tuple(torch.where(exiting, e, a) for e, a in zip(exit_vectors, adaln))

    @property
    def loop_counts(self):
        """(batch, seq) loop steps each token ran."""
        counts = torch.full(self.active.shape, self.steps_all_ran, dtype=torch.long, device=self.active.device)
        return counts if self.partial_counts is None else counts + self.partial_counts

    def all_active(self):
        return self.num_active == self.active.numel()  # False for an unknown count (None)

    def halted(self):
        """(batch, seq) bool mask of frozen tokens, or None while every token is active."""
        return None if self.all_active() else ~self.active

    def all_halted(self):
        return self.num_active == 0

    def next_step(self, hidden_size, gather=True):
        """(halted mask, gather plan) of the coming loop step: (None, None) while every token is active; the plan
        (a [`LoopFormerActiveTokens`]) only if `gather` and leaving the halted tokens out saves work."""
        halted = self.halted()
        if halted is None or not gather or self.exiting is not None or self.num_active is None:
            # an exit step's adaLN is per token, and a compiled forward reads no count: dense
            return halted, None
        return halted, LoopFormerActiveTokens.worth_gathering(self.active, self.num_active, hidden_size)

    def block_step(self, block, halted, active):
        """The [`LoopFormerHaltingStep`] of block `block` at the step `next_step` described (None: nothing halted)."""
        if halted is None:
            return None
        return LoopFormerHaltingStep(halted, active, self.last_kv[block] if self.reuse_kv else None)

    def update(self, previous, hidden_states, final=False):
        """Advance past loop step i: the step counts for the tokens that ran it, and a token halts once
        - "state_change": ‖h_i − h_{i−1}‖∞ / (‖h_i‖∞ + 1e-8) < halt_eps;
        - "kl": KL(p_i ‖ p_{i−1}) < halt_eps, p the next-token distributions (p_0 from the embeddings);
        - "entropy": H(p_i) < halt_eps.
        After the `final` step of the budget no score is needed: only the counts advance. With a "_shortcut" rule
        a token whose score falls does not freeze yet: it takes one exit step (Δ = 1 − t) at the next step, then
        freezes (`_shortcut_update`)."""
        self.step += 1
        if self.row_budgets is not None:
            return self._row_update(previous, hidden_states, final)
        if final or self.probe:  # the probe's unsure tokens run the whole budget
            self._count_step()
            return self
        if self.shortcut_exit:
            return self._shortcut_update(previous, hidden_states)
        score = self._score(previous, hidden_states)
        self._count_step()
        if score.numel() == 1:  # one token (decoding): read its score, one sync, no mask arithmetic
            if score.item() < self.halt_eps:
                self.active, self.num_active = torch.zeros_like(self.active), 0
            return self
        still = ~(score < self.halt_eps)  # a NaN score keeps looping
        if not self.all_active():
            still &= self.active
        self.active = still
        self.num_active = int(still.sum())  # one sync per step
        return self

    def _row_update(self, previous, hidden_states, final):
        """`update` under per-row budgets: the rows whose last step this was stop, and with `halt_eps` the tokens
        whose score fell below it."""
        if self.halt_eps is not None:  # the counts are only returned with halt_eps
            self._count_step()
        still = self.active & (self.row_budgets > self.step)[:, None]
        if self.halt_eps is not None and not final:
            still &= ~(self._score(previous, hidden_states) < self.halt_eps)  # a NaN score keeps looping
        self.active = still
        if self.halt_eps is not None:
            self.num_active = int(still.sum())  # one sync per step, as for halting alone
        elif self.row_steps is not None:  # counted in Python: whole rows stop
            self.num_active = self.active.shape[1] * sum(m > self.step for m in self.row_steps)
        else:
            self.num_active = None
        return self

    def _score(self, previous, hidden_states):
        """The criterion's score of every token after the step just run."""
        if self.criterion == "state_change":
            score = state_change_score(previous, hidden_states)
        else:
            log_probs = self.readout(hidden_states)
            if self.criterion == "kl":
                score = (log_probs.exp() * (log_probs - self.log_probs)).sum(-1)
                self.log_probs = log_probs
            else:
                score = -(log_probs.exp() * log_probs).sum(-1)
        return score

    def _shortcut_update(self, previous, hidden_states):
        """`update` under a "_shortcut" rule: the tokens that just ran their exit step freeze; of the others, those
        whose score fell below halt_eps exit at the next step, unless it is the budget's last (it is their exit)."""
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

    def _count_step(self):
        """The active tokens ran one more step."""
        if self.all_active():
            self.steps_all_ran += 1
        else:
            self.partial_counts = self.active.long() if self.partial_counts is None else self.partial_counts + self.active

    def fill_skipped_slots(self, cache, blocks, frozen, position_embeddings, loop_adaln, first_step):
        """Every token has halted: write the cache slots of loop steps `first_step`.. at once (no-op without cache)."""
        if cache is None:
            return
        steps = range(first_step, cache.spec.loop_steps)
        for j, block in enumerate(blocks):
            if self.reuse_kv:
                per_step = [self.last_kv[j]] * len(steps)
            else:
                adaln = None if loop_adaln is None else loop_adaln[j][first_step:]
                per_step = block.frozen_kv(frozen, position_embeddings, adaln, len(steps))
            for step, (k, v) in zip(steps, per_step):
                cache.write(k, v, cache.slot(step, j))


__all__ = ["HALT_CRITERIA", "LoopFormerActiveTokens", "LoopFormerHaltingState", "LoopFormerHaltingStep", "PROBE_CRITERION",
           "check_halt_criterion", "check_halt_eps",
           "probe_slots", "shortcut_exit_adaln", "split_criterion", "state_change_score"]
