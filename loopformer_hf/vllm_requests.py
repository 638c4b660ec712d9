"""Per-request loop budgets and schedules for the vLLM LoopFormer model.

A request asks for its trajectory in `SamplingParams(extra_args={"loop_budget": 2, "step_schedule": ...})` (the
OpenAI server's `vllm_xargs`); one it leaves out runs the server's. vLLM 0.32's V1 model runner hands a model no
per-request values, so they travel through vLLM's own per-engine objects, with no registry of this package's:

- The server is resolved once per engine, where vLLM builds its config: the plugin's config hook makes a
  `LoopFormerServing` (vllm_plugin.py) and binds it to a class of the logits processor below (`served_processor`),
  which it puts in `model_config.logits_processors` (vLLM takes classes there as well as names). Everything that
  engine builds from its config reads that class: the front-end's admission check (`validate_params`, a classmethod,
  so the bound class is the only place it can find its server) and the worker's runner, which makes the processor.
- `LoopFormerRequestTrajectories`, the processor (V1 model runner). Its `validate_params` runs in the front-end at
  admission (a bad value fails that request, HTTP 400). Its `update_state` follows vLLM's persistent batch
  (requests added, removed, moved) in the worker and resolves each request once, when it joins the batch, into an
  immutable `RequestLoop`, kept by batch row. It leaves the logits alone. It enters itself in the engine's
  `compilation_config.static_forward_context` (vLLM's per-engine table of objects reached outside the model's call
  graph, by name, as its attention layers are), which each forward exposes as `get_forward_context()
  .no_compile_layers`: the model finds its own engine's rows there (`batch_request_loops`).
- `LoopPlan`, built by the model at each forward from those rows and the attention metadata's `query_start_loc`
  (which tokens belong to which row): it maps tokens to the already-resolved `RequestLoop`s, and for each loop step
  lists the tokens whose budget reaches it. Sorted by budget the active tokens of step i are a prefix of one order,
  `order[:n_i]`.
"""

import logging

import numpy as np
import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from .vllm_plugin import serving_of

logger = logging.getLogger(__name__)

# The processor's name in its engine's `static_forward_context` (no layer of a model is named so). That table is
# vLLM's per-engine map of objects reached outside the model's call graph (vllm/config/compilation.py:757-760),
# filled by each attention layer at construction (vllm/model_executor/layers/attention/attention.py:442-445) and
# handed to each forward as `get_forward_context().no_compile_layers` (vllm/forward_context.py:248). The runner
# builds this processor and runs the model under the same `VllmConfig` (vllm/v1/worker/gpu_model_runner.py:725-731,
# 4189-4190), and calls `update_state` before the forward (vllm/v1/worker/gpu_input_batch.py:843-847), so the
# model reads its own engine's rows there, never another engine's of the same process. Readers of the table that
# expect layers filter by type or attribute (vllm/config/vllm.py:3500-3520, gpu_model_runner.py:6277-6280).
FORWARD_CONTEXT_KEY = "loopformer_hf.request_loops"


def validate_request(cls, sampling_params):
    """The admission check, in the front-end: a request's knobs resolved against the server bound to `cls` (the
    same resolution the worker makes when the request joins the batch; this one, in another process, is a check)."""
    if cls.serving is not None and sampling_params.extra_args:
        loop = cls.serving.request_loop(sampling_params.extra_args)
        if loop is not None and cls.serving.refusal is not None:
            raise ValueError(f"`loop_budget`/`step_schedule` per request are not served here: {cls.serving.refusal}.")


class LoopFormerRequestTrajectories(LogitsProcessor):
    """Each batch row's `RequestLoop`, for rows whose request asked for its own trajectory."""

    serving = None  # the server's `LoopFormerServing` (bound by vllm_plugin.served_processor)
    validate_params = classmethod(validate_request)

    def __init__(self, vllm_config, device, is_pin_memory):
        if self.serving is None:  # an unbound class (named by the user): the engine's own
            self.serving = serving_of(vllm_config)
        self.rows = {}  # batch index -> RequestLoop, only for requests that asked for one
        # the model reads it through the forward context of this engine alone (`batch_request_loops`)
        vllm_config.compilation_config.static_forward_context[FORWARD_CONTEXT_KEY] = self

    def _request_loop(self, params, prompt_ids, output_ids):
        """Once per request, as it joins the batch."""
        try:
            return self.serving.request_loop(params.extra_args)
        except ValueError as error:  # admission refuses these; a front-end that skipped it must not stop the engine
            logger.error("LoopFormer: a request's trajectory is invalid (%s); it runs the server's.", error)
            return None

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.rows, batch_update, self._request_loop)

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return True


def batch_request_loops():
    """The batch rows' `RequestLoop`s (batch index -> loop, rows that asked for one) of the engine running the
    current forward, or None where it has no such processor (speculative decoding, Model Runner V2)."""
    if not is_forward_context_available():
        return None
    requests = get_forward_context().no_compile_layers.get(FORWARD_CONTEXT_KEY)
    return None if requests is None else requests.rows


class LoopStep:
    """One loop step of a plan: `index`, the active tokens (None: all), and `trajectory_ids`, each active token's
    trajectory (None when they all share `trajectory_id`)."""

    __slots__ = ("index", "trajectory_ids", "trajectory_id")

    def __init__(self, index, trajectory_ids, trajectory_id):
        self.index, self.trajectory_ids, self.trajectory_id = index, trajectory_ids, trajectory_id


class LoopPlan:
    """Which tokens run which loop steps, under which trajectory: a map from tokens to `RequestLoop`s resolved
    before (nothing is resolved here).

    `trajectories`: the distinct trajectories of the batch (step sizes of `loops`); `steps[i]`: a `LoopStep` for
    every step some token reaches. A plan with one trajectory is `uniform` (the model then runs it as a
    single-trajectory batch)."""

    def __init__(self, loops, token_trajectory, device):
        self.trajectories = [loop.trajectory for loop in loops]
        self.uniform = len(loops) == 1
        if self.uniform:
            return
        budgets = np.array([loop.budget for loop in loops])[token_trajectory]
        order = np.argsort(-budgets, kind="stable")  # deepest first: step i's tokens are order[:n_i]
        num_tokens = len(token_trajectory)
        self.steps, index = [], {}  # active tokens -> their index tensor, one per count: steps share it
        for step in range(int(budgets.max())):
            active = int((budgets > step).sum())
            if active < num_tokens and active not in index:
                index[active] = torch.from_numpy(order[:active]).to(device)
            ids = token_trajectory[order[:active]]
            shared = ids[0] if (ids == ids[0]).all() else None
            self.steps.append(
                LoopStep(
                    index.get(active),
                    None
                    if shared is not None
                    else torch.from_numpy(token_trajectory if active == num_tokens else ids).to(device),
                    None if shared is None else int(shared),
                )
            )

    @classmethod
    def build(cls, default, rows, query_start_loc, num_tokens, device):
        """`rows`: batch index -> `RequestLoop` (the others run `default`, the server's); `query_start_loc`: the
        first token of each row, and the end (tokens past it, padding, run `default`)."""
        if not rows:
            return cls([default], None, device)
        loops = [default]
        ids = {default: 0}
        row_ids = []
        for row in range(len(query_start_loc) - 1):
            loop = rows.get(row, default)
            row_ids.append(ids.setdefault(loop, len(ids)))
            if row_ids[-1] == len(loops):
                loops.append(loop)
        counts = np.diff(np.asarray(query_start_loc))
        token_trajectory = np.zeros(num_tokens, dtype=np.int64)
        token_trajectory[: int(query_start_loc[-1])] = np.repeat(np.array(row_ids, dtype=np.int64), counts)
        present = np.unique(token_trajectory)
        if len(present) == 1:
            return cls([loops[int(present[0])]], None, device)
        return cls(loops, token_trajectory, device)


class LoopFormerRequestRefusal(V2LogitsProcessor):
    """Model Runner V2's interface: refuses per-request trajectories at admission (see `per_request_refusal`)."""

    serving = None  # bound by vllm_plugin.served_processor
    validate_params = classmethod(validate_request)

    def add_request(self, req_idx, sampling_params):
        return False

    def apply(self, logits, ctx):
        return logits
