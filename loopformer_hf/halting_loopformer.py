"""Per-token halting of LoopFormer's loop (`halt_eps`): a token stops looping once its halting score falls below
`halt_eps`; its state is frozen, and the cache slots of the steps it skips are filled so that later tokens can still
attend to every (loop step, block).

The library's exit rule ("state_change"): a token freezes once its relative state change falls below `halt_eps`.
Another rule is a subclass of [`LoopFormerHaltingState`] that a model subclass runs (the lab's research rules, "kl",
"entropy", their "_shortcut" forms and "probe_entropy": benchmarks/halting_rules.py, `LabLoopFormerForCausalLM`).

- [`LoopFormerHaltingState`]: the halting of one forward's loop (which tokens are active, their loop counts), as
  `FPRMSolverState` is for FPRM's solver; the loop calls its `begin`, `for_step`, `observe` and `finish` only.
- [`LoopFormerExitStep`]: one loop step as the loop sees it (per block: the adaLN vectors, the frozen tokens).
- [`LoopFormerHaltingStep`]: what one block needs at one loop step (the one object a block takes).
- [`LoopFormerActiveTokens`]: the gather plan that leaves halted tokens out of a step's computation.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticCache, StaticLayer

from .trajectory_loopformer import check_halt_eps  # noqa: F401 (re-exported: its home before)

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
        return (
            None if position_embeddings is None else tuple(self.gather(p[:, 0])[:, None] for p in position_embeddings)
        )

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


@dataclass
class LoopFormerHaltingStep:
    """What one block needs at one loop step to keep halted tokens frozen: the (batch, seq) `halted` mask (None: no
    token is frozen yet), the `active` tokens' gather plan (None: compute every token and restore the halted ones),
    and with `halt_kv_fill="reuse"` the (keys, values) of the block's last computed step (`reuse`), which halted
    tokens repeat in this step's cache slot. The block's attention leaves this step's (keys, values) of every token
    in `kv` (`keys_values`), for the rule's next step: only the halting path records them."""

    halted: torch.BoolTensor | None
    active: LoopFormerActiveTokens | None = None
    reuse: tuple | None = None
    kv: tuple | None = None

    def gather(self, x):
        """The (batch, seq, ...) rows this step computes: all of `x`, or the active tokens'."""
        return x if self.active is None else self.active.gather(x)

    def gather_positions(self, position_embeddings):
        return position_embeddings if self.active is None else self.active.gather_positions(position_embeddings)

    def keys_values(self, project, hidden_states, position_embeddings):
        """This step's (keys, values) of every token (also kept in `kv`), `project(hidden_states,
        position_embeddings)` giving those of the tokens it computes; halted tokens take `reuse`'s when given (else
        their frozen state's projection)."""
        if self.reuse is None or self.halted is None:
            self.kv = project(hidden_states, position_embeddings)
        elif self.active is not None:  # project only the active tokens, into a copy of the reused keys/values
            k, v = project(self.active.gather(hidden_states), self.active.gather_positions(position_embeddings))
            self.kv = self.active.scatter_heads(self.reuse[0], k), self.active.scatter_heads(self.reuse[1], v)
        else:
            k, v = project(hidden_states, position_embeddings)
            halted = self.halted[:, None, :, None]
            self.kv = torch.where(halted, self.reuse[0], k), torch.where(halted, self.reuse[1], v)
        return self.kv

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
        return computed if self.halted is None else torch.where(self.halted[..., None], frozen, computed)


class LoopFormerExitStep(NamedTuple):
    """One loop step under early exit, as the loop sees it (`LoopFormerHaltingState.for_step`): for each block, the adaLN
    vectors to run and which tokens are frozen."""

    rule: "LoopFormerHaltingState"
    step: int
    halted: torch.BoolTensor | None  # None: every token computes this step
    active: LoopFormerActiveTokens | None  # the gather plan, when leaving the halted tokens out saves work

    def block(self, j, adaln):
        """(adaLN vectors, [`LoopFormerHaltingStep`]) of block `j`: the trajectory's `adaln`."""
        return adaln, self.rule.block_step(j, self.halted, self.active)


def state_change_score(previous, hidden_states):
    """‖h_i − h_{i−1}‖∞ / (‖h_i‖∞ + 1e-8) per token, in float32: the "state_change" halting criterion."""
    delta, norm = (hidden_states - previous).abs().amax(-1), hidden_states.abs().amax(-1)
    if delta.dtype != torch.float32:  # after amax: abs and max are exact in any dtype
        delta, norm = delta.float(), norm.float()
    return delta / (norm + 1e-8)


@dataclass
class LoopFormerHaltingState:
    """Per-token halting (`halt_eps`) carried through the loop, as `FPRMSolverState` is for FPRM's solver.

    `active` tokens keep looping; a token halts once ‖h_i − h_{i−1}‖∞ / (‖h_i‖∞ + 1e-8) < halt_eps
    ("state_change", the library's one rule). A halted token's state is frozen, and the cache slots it skips are
    filled (`halt_kv_fill`) so that later tokens can still attend to every slot. Updated in place, one loop step at a
    time.

    Per-row trajectories (`row_budgets`) freeze a row's tokens after its own last step the same way, with or without
    `halt_eps` (None: only the budgets halt).

    The loop calls four methods: `begin`, `for_step` (whose [`LoopFormerExitStep`] each block reads), `observe` and
    `finish`. Another exit rule is a subclass that a model subclass runs (its `halting_rule` attribute; the lab's:
    benchmarks/halting_rules.py).
    """

    halt_eps: float | None
    reuse_kv: bool  # halt_kv_fill == "reuse": skipped slots repeat the token's last computed keys/values
    active: torch.BoolTensor  # (batch, seq)
    num_active: int  # active.sum(), read once per step (one device sync) for every check of that step
    last_kv: list  # per block: the (keys, values) of the last step each token computed
    # Loop steps every token ran (counted in Python while no token has halted), plus `partial_counts` (batch, seq):
    # the steps run since (decoding one token never needs a tensor for its count).
    steps_all_ran: int = 0
    partial_counts: torch.LongTensor | None = None
    step: int = 0  # loop steps run so far in this call
    num_steps: int = 0  # the call's budget M
    row_budgets: torch.LongTensor | None = None  # (batch,) per-row budgets M_b
    # the same as plain ints in eager code, which counts the active tokens without a device sync; None in a compiled
    # forward, which reads no value of the rows and computes every token (`num_active` is then None after step 1)
    row_steps: tuple | None = None
    # what `begin` was given, for the steps it fills once every token has halted
    blocks: object = None
    cache: object = None
    position_embeddings: tuple | None = None
    loop_adaln: list | None = None

    # Loop-step cache slots per block a subclass needs beyond the budget's (the cache spec adds them).
    extra_slots: ClassVar[int] = 0

    # ---- the interface the loop calls ----------------------------------------------------------------------------

    @classmethod
    def begin(cls, model, plan, hidden_states, loop_adaln, cache, mask, position_embeddings):
        """(the state before step 1, the loop's input) for a call's `plan`."""
        batch_seq, device, config = hidden_states.shape[:2], hidden_states.device, model.config
        state = cls(
            plan.halt_eps,
            config.halt_kv_fill == "reuse",
            torch.ones(batch_seq, dtype=torch.bool, device=device),
            batch_seq.numel(),
            [None] * config.num_hidden_layers,
        )
        rows = plan.rows
        if rows is not None:
            state.num_steps, state.row_budgets = rows.num_steps, rows.budgets.to(device)
            state.row_steps = None if torch.compiler.is_compiling() else tuple(map(len, rows.trajectories))
        else:
            state.num_steps = len(plan.trajectory)
        state.blocks, state.cache, state.position_embeddings = model.layers, cache, position_embeddings
        state.loop_adaln = loop_adaln
        return state, hidden_states

    def for_step(self, step, hidden_states, gather=True):
        """The [`LoopFormerExitStep`] of loop step `step`, or None once every token has halted: the cache slots of
        the steps left are then filled, and the loop ends. `gather`: halted tokens may be left out of the step's
        computation (not when the attention maps are returned)."""
        if self.all_halted():
            self.fill_skipped_slots(
                self.cache, self.blocks, hidden_states, self.position_embeddings, self.loop_adaln, step
            )
            return None
        return LoopFormerExitStep(self, step, *self._next_step(hidden_states.shape[-1], gather=gather))

    def observe(self, previous, hidden_states, block_kv, final=False):
        """After a loop step: its input and output states, each block's (keys, values), whether it was the budget's
        last."""
        self.last_kv = list(block_kv)
        self._update(previous, hidden_states, final)

    def finish(self, hidden_states):
        """(the loop's output, the loop steps each token ran or None without `halt_eps`)."""
        return hidden_states, None if self.halt_eps is None else self.loop_counts

    def block_step(self, block, halted, active):
        """The [`LoopFormerHaltingStep`] of block `block` at the step `_next_step` described (`halted` None: nothing
        halted; the step still records the block's keys and values)."""
        return LoopFormerHaltingStep(
            halted, active, self.last_kv[block] if self.reuse_kv and halted is not None else None
        )

    def fill_skipped_slots(self, cache, blocks, frozen, position_embeddings, loop_adaln, first_step):
        """Every token has halted: write the cache slots of loop steps `first_step`.. at once (no-op without cache)."""
        if cache is None:
            return
        steps = range(first_step, self.num_steps)
        for j, block in enumerate(blocks):
            if self.reuse_kv:
                per_step = [self.last_kv[j]] * len(steps)
            else:
                adaln = None if loop_adaln is None else loop_adaln[j][first_step:]
                per_step = frozen_kv(block, frozen, position_embeddings, adaln, len(steps))
            for step, (k, v) in zip(steps, per_step):
                write(cache, k, v, step * len(blocks) + j)

    # ---- one step ------------------------------------------------------------------------------------------------

    def _next_step(self, hidden_size, gather=True):
        """(halted mask, gather plan) of the coming loop step: (None, None) while every token is active; the plan
        (a [`LoopFormerActiveTokens`]) only if `gather` and leaving the halted tokens out saves work."""
        halted = self.halted()
        if halted is None or not gather or self.num_active is None:  # a compiled forward reads no count: dense
            return halted, None
        return halted, LoopFormerActiveTokens.worth_gathering(self.active, self.num_active, hidden_size)

    def _update(self, previous, hidden_states, final=False):
        """Advance past loop step i: the step counts for the tokens that ran it, and a token halts once its score
        (`_score`) falls below halt_eps. After the `final` step of the budget no score is needed: only the counts
        advance."""
        self.step += 1
        if self.row_budgets is not None:
            return self._row_update(previous, hidden_states, final)
        if final:
            self._count_step()
            return self
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

    # ---- the counts ---------------------------------------------------------------------------------------------

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

    def _score(self, previous, hidden_states):
        """What halt_eps thresholds, per token, after the step just run: the relative state change."""
        return state_change_score(previous, hidden_states)

    def _row_update(self, previous, hidden_states, final):
        """`_update` under per-row budgets: the rows whose last step this was stop, and with `halt_eps` the tokens
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

    def _count_step(self):
        """The active tokens ran one more step."""
        if self.all_active():
            self.steps_all_ran += 1
        else:
            self.partial_counts = (
                self.active.long() if self.partial_counts is None else self.partial_counts + self.active
            )


class HaltingCall(NamedTuple):
    """What `LoopFormerHaltingState.begin` reads of a forward call: its trajectory (or per-row trajectories, a
    `LoopFormerRows`) and `halt_eps`."""

    trajectory: tuple
    rows: object
    halt_eps: float


class LoopFormerDynamicLayer(DynamicLayer):
    """The cache layer of the halting loop: a `DynamicLayer` that also takes keys/values without returning the slot's
    whole history (`append`). Halting writes a halted token's skipped slots that way: nothing reads them in that
    forward, so the pieces wait and join the slot's next concatenation (one `cat` per slot and read instead of one per
    write). Reading `keys` or `values` (as every transformers cache method does) joins them first. A slot that is never
    read (its tokens always halt before its step) joins every `max_pending` pieces, so a long generation does not keep
    one small tensor per token."""

    _pending = ()  # (keys, values) appended since the last join
    max_pending = 64  # one join (a copy of the slot) per 64 appends: amortised, and bounds the number of tensors

    def _join(self, *new):
        """Concatenate the pending pieces, then `new` = (keys, values) if given, onto the slot."""
        keys, values = zip(*self._pending, *([new] if new else []))
        self._pending = ()
        self._keys = torch.cat([self._keys, *keys], dim=-2)
        self._values = torch.cat([self._values, *values], dim=-2)

    def _joined(stored):  # noqa: N805 (builds the `keys`/`values` properties below)
        def get(self):
            if self._pending:
                self._join()
            return getattr(self, stored)

        def set(self, value):
            if self._pending:
                self._join()
            setattr(self, stored, value)

        return property(get, set)

    keys = _joined("_keys")
    values = _joined("_values")
    del _joined

    def append(self, key_states, value_states):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self._pending:
            self._pending = []
        self._pending.append((key_states, value_states))
        if len(self._pending) >= self.max_pending:
            self._join()

    def update(self, key_states, value_states, *args, **kwargs):
        if not self._pending:
            return super().update(key_states, value_states, *args, **kwargs)
        self._join(key_states, value_states)
        return self._keys, self._values


def use_halting_layers(cache, num_slots, rule):
    """Give a cache the layers the halting loop of `rule` writes, `num_slots` of them: a dynamic cache (not offloaded)
    the halting layer class (the layers not yet written become `LoopFormerDynamicLayer`s, and later ones are made
    so), a static one not yet written the layers a rule's extra steps need."""
    if cache is None:
        return
    if rule.extra_slots and type(cache).update is not Cache.update:
        raise ValueError(
            f"{rule.__name__} keeps its extra step in cache slots of its own, which {type(cache).__name__} (a cache "
            f"that maps its layers) does not have: use a LoopFormerCache."
        )
    if isinstance(cache, StaticCache):
        while len(cache.layers) < num_slots and not cache.layers[0].is_initialized:
            cache.layers.append(StaticLayer(max_cache_len=cache.layers[0].max_cache_len))
        return
    if getattr(cache, "offloading", False):
        return
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = LoopFormerDynamicLayer
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = LoopFormerDynamicLayer()
    if getattr(cache, "layer_class_to_replicate", None) is None:
        while len(cache.layers) < num_slots:
            cache.layers.append(LoopFormerDynamicLayer())


def write(cache, key_states, value_states, layer_idx):
    """As `cache.update`, for a caller that does not read the slot back (halting's skipped slots): a halting layer
    joins these keys/values to the slot at its next read instead of now."""
    if type(cache).update is not Cache.update:  # a cache that maps layers itself (the lab's shared cache)
        cache.update(key_states, value_states, layer_idx)
        return
    while len(cache.layers) <= layer_idx and getattr(cache, "layer_class_to_replicate", None) is not None:
        cache.layers.append(cache.layer_class_to_replicate())
    layer = cache.layers[layer_idx]
    if isinstance(layer, LoopFormerDynamicLayer):
        layer.append(key_states, value_states)
    else:
        cache.update(key_states, value_states, layer_idx)


def frozen_kv(block, frozen, position_embeddings, adaln, num_steps):
    """The (keys, values) a frozen (halted) state gives `block`'s attention at each of `num_steps` loop steps whose
    adaLN vectors are the list `adaln` (None without conditioning, where every step sees the same pair). All steps
    are projected in one batched call."""
    if adaln is None:
        return [block.self_attn.project_kv(block.input_layernorm(frozen), position_embeddings)] * num_steps
    # the block's own modulated norm per step (the same rounding as its forward), side by side along the sequence:
    # (batch, steps * seq, d)
    x = torch.cat([block.input_layernorm(frozen, weight_attn) for _, _, weight_attn, _ in adaln], dim=1)
    pos = None if position_embeddings is None else tuple(p.repeat(1, 1, num_steps, 1) for p in position_embeddings)
    k, v = block.self_attn.project_kv(x, pos)
    return list(zip(k.chunk(num_steps, dim=2), v.chunk(num_steps, dim=2)))


def halting_loop(
    model,
    halt_eps,
    trajectory,
    rows,
    loop_adaln,
    hidden_states,
    mask,
    position_embeddings,
    cache,
    output_attentions,
    output_hidden_states,
):
    """The loop of `LoopFormerModel.forward` under per-token halting: before each step the halting state (the
    model's `halting_rule`, `LoopFormerHaltingState` unless a subclass sets another) says which tokens each block
    computes, and reads the step's result and keys and values after it. Returns (final state, states after each step
    or None, the loop steps each token ran)."""
    dtype, device, num_blocks = hidden_states.dtype, hidden_states.device, len(model.layers)
    conditioning = None  # with gradients each block makes its adaLN vectors from c; per-row ones are computed once
    if torch.is_grad_enabled() and rows is None and model.config.loop_conditioning != "none":
        conditioning = model.loop_conditioning(trajectory, device, dtype)
    if loop_adaln is None:  # halting fills skipped slots from them
        loop_adaln = model.adaln_vectors(trajectory if rows is None else rows.steps, dtype, device)
    num_steps = len(trajectory) if rows is None else rows.num_steps
    rule = getattr(model, "halting_rule", None) or LoopFormerHaltingState
    use_halting_layers(cache, (num_steps + rule.extra_slots) * num_blocks, rule)
    call = HaltingCall(trajectory, rows, halt_eps)
    early_exit, hidden_states = rule.begin(model, call, hidden_states, loop_adaln, cache, mask, position_embeddings)
    all_hidden_states = (hidden_states,) if output_hidden_states else None
    for step in range(num_steps):
        # halted tokens are left out of the step's computation unless the attention maps are returned
        exit_step = early_exit.for_step(step, hidden_states, gather=not output_attentions)
        if exit_step is None:  # every token has halted (the rule filled the slots of the steps left)
            if output_hidden_states:
                all_hidden_states += (hidden_states,) * (num_steps - step)
            break
        previous, block_kv = hidden_states, []
        c = None if conditioning is None else conditioning[step]
        for j, block in enumerate(model.layers):
            adaln = None if loop_adaln is None or c is not None else loop_adaln[j][step]
            adaln, halting = exit_step.block(j, adaln)
            hidden_states = block(
                hidden_states,
                c,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                cache=cache,
                step_offset=step * num_blocks,
                output_attentions=output_attentions,
                adaln=adaln,
                halting=halting,
            )
            block_kv.append(halting.kv)
        early_exit.observe(previous, hidden_states, block_kv, final=step == num_steps - 1)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
    hidden_states, loop_counts = early_exit.finish(hidden_states)  # a rule may keep other states for some tokens
    return hidden_states, all_hidden_states, loop_counts


__all__ = [
    "LoopFormerActiveTokens",
    "LoopFormerDynamicLayer",
    "halting_loop",
    "LoopFormerExitStep",
    "LoopFormerHaltingState",
    "LoopFormerHaltingStep",
    "check_halt_eps",
    "state_change_score",
]
