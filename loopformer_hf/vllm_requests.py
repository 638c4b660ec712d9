"""Per-request loop budgets and schedules for the vLLM LoopFormer model.

A request asks for its trajectory in `SamplingParams(extra_args={"loop_budget": 2, "step_schedule": ...})` (the
OpenAI server's `vllm_xargs`); one it leaves out runs the server's. vLLM hands a model no per-request values, so two
pieces carry them, both vLLM extension points:

- `LoopFormerRequestTrajectories`, a custom logits processor (V1 model runner) that the plugin's config hook adds to
  every LoopFormer server. Its `validate_params` runs in the front-end at admission (a bad value fails that request,
  HTTP 400); its `update_state` follows vLLM's persistent batch (requests added, removed, moved) in the worker, so
  it knows the trajectory of every batch row. It leaves the logits alone.
- `LoopPlan`, built by the model at each forward from those rows and the attention metadata's `query_start_loc`
  (which tokens belong to which row): the trajectory of each token, and for each loop step the tokens whose budget
  reaches it. Sorted by budget the active tokens of step i are a prefix of one order, `order[:n_i]`.
"""

import logging
import weakref

import numpy as np
import torch

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from .vllm_plugin import SERVED_MODEL_CONFIGS, request_trajectory

logger = logging.getLogger(__name__)

# id(vllm_config) -> the processor of that engine's worker: the model finds its requests' trajectories here (the
# runner builds both from the same VllmConfig object, and hands neither to the other).
_PROCESSORS = weakref.WeakValueDictionary()


def requests_of(vllm_config_id):
    return _PROCESSORS.get(vllm_config_id)


def validate_request(sampling_params):
    """The admission check, in the front-end: against the model config the plugin's hook saw in this process."""
    if SERVED_MODEL_CONFIGS and sampling_params.extra_args:
        model_config, refusal = SERVED_MODEL_CONFIGS[-1]
        trajectory = request_trajectory(
            model_config.hf_config, model_config.try_get_generation_config(), sampling_params.extra_args
        )
        if trajectory is not None and refusal is not None:
            raise ValueError(f"`loop_budget`/`step_schedule` per request are not served here: {refusal}.")


class LoopFormerRequestTrajectories(LogitsProcessor):
    """Each batch row's trajectory (a tuple of step sizes), for rows whose request asked for its own."""

    validate_params = classmethod(lambda cls, sampling_params: validate_request(sampling_params))

    def __init__(self, vllm_config, device, is_pin_memory):
        model_config = vllm_config.model_config
        self.hf_config, self.generation_config = model_config.hf_config, model_config.try_get_generation_config()
        self.rows = {}  # batch index -> trajectory, only for requests that asked for one
        _PROCESSORS[id(vllm_config)] = self

    def _trajectory(self, params, prompt_ids, output_ids):
        try:
            return request_trajectory(self.hf_config, self.generation_config, params.extra_args)
        except ValueError as error:  # admission refuses these; a front-end that skipped it must not stop the engine
            logger.error("LoopFormer: a request's trajectory is invalid (%s); it runs the server's.", error)
            return None

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.rows, batch_update, self._trajectory)

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return True


class LoopStep:
    """One loop step of a plan: `index`, the active tokens (None: all), and `trajectory_ids`, each active token's
    trajectory (None when they all share `trajectory_id`)."""

    __slots__ = ("index", "trajectory_ids", "trajectory_id")

    def __init__(self, index, trajectory_ids, trajectory_id):
        self.index, self.trajectory_ids, self.trajectory_id = index, trajectory_ids, trajectory_id


class LoopPlan:
    """Which tokens run which loop steps, under which trajectory.

    `trajectories`: the distinct trajectories of the batch; `steps[i]`: a `LoopStep` for every step some token
    reaches. A plan with one trajectory is `uniform` (the model then runs it as a single-trajectory batch)."""

    def __init__(self, trajectories, token_trajectory, device):
        self.trajectories = trajectories
        self.uniform = len(trajectories) == 1
        if self.uniform:
            return
        budgets = np.array([len(t) for t in trajectories])[token_trajectory]
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
        """`rows`: batch index -> trajectory (the others run `default`); `query_start_loc`: the first token of each
        row, and the end (tokens past it, padding, run `default`)."""
        if not rows:
            return cls([default], None, device)
        trajectories = [default]
        ids = {default: 0}
        row_ids = []
        for row in range(len(query_start_loc) - 1):
            trajectory = rows.get(row, default)
            row_ids.append(ids.setdefault(trajectory, len(ids)))
            if row_ids[-1] == len(trajectories):
                trajectories.append(trajectory)
        counts = np.diff(np.asarray(query_start_loc))
        token_trajectory = np.zeros(num_tokens, dtype=np.int64)
        token_trajectory[: int(query_start_loc[-1])] = np.repeat(np.array(row_ids, dtype=np.int64), counts)
        present = np.unique(token_trajectory)
        if len(present) == 1:
            return cls([trajectories[int(present[0])]], None, device)
        return cls(trajectories, token_trajectory, device)


class LoopFormerRequestRefusal(V2LogitsProcessor):
    """Model Runner V2's interface: refuses per-request trajectories at admission (see `per_request_refusal`)."""

    validate_params = classmethod(lambda cls, sampling_params: validate_request(sampling_params))

    def add_request(self, req_idx, sampling_params):
        return False

    def apply(self, logits, ctx):
        return logits
