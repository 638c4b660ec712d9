"""LoopFormer for vLLM: k shared blocks looped along a fixed trajectory of M steps, as `LoopFormerForCausalLM`
computes it, on vLLM's layers (paged attention, continuous batching, tensor-parallel linears).

Follows vLLM's `llama.py` for the layers and its looped `iquest_loopcoder.py` for the cache: every (loop step i,
block j) pair gets its own `Attention` layer, hence its own paged KV cache, named `model.layers.{i*k + j}.self_attn
.attn` (the slot `LoopFormerCache` gives the pair). The projections are shared by the M attention layers of a block.

The number of cache layers is fixed when the model is built: one per (loop step, block) up to the largest budget a
request may ask for (`max_request_loop_budget`). The server's trajectory (loop budget M, step sizes Δ_1..Δ_M) is
resolved once per engine, by the plugin's config hook (`LoopFormerServing`, through `server_trajectory`): vLLM's
`--hf-overrides` (`loop_budget`, `step_schedule`), else the checkpoint's generation_config.json, else its config
(`default_loop_budget`, `default_step_schedule`); what vLLM cannot express is refused there. A request may pick its own budget and schedule (`SamplingParams(extra_args=...)`, the OpenAI server's
`vllm_xargs`; `vllm_requests.py`), resolved once when it joins the batch; a token runs only the loop steps of its
own request's trajectory.

Weights load by the checkpoint's own parameter names (`model.layers.{j}.self_attn.q_proj.weight`, ...). This file
takes the loop conditioning module (t, Δ → c_i) and `rms_norm` from `looped_common.py`; the rest is vLLM's layers.
"""

import itertools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

from .looped_common import rms_norm

# c_i of each loop step (TimeEmb(t_{i-1}) + StepEmb(Δ_i), or TimeEmb(i - 1), or none): the checkpoint model's own
# module, replicated on every rank (one small vector per step), so the conditioning is the same computation
from .modeling_loopformer import LoopFormerLoopConditioning
from .vllm_plugin import server_trajectory, serving_of
from .vllm_requests import LoopPlan, batch_request_loops


class LoopFormerMLP(nn.Module):
    """GELU MLP (or any `ACT2FN` activation) or, with `hidden_act="swiglu"`, a gated SiLU MLP."""

    def __init__(self, config, quant_config=None, prefix=""):
        super().__init__()
        linear = dict(bias=config.mlp_bias, quant_config=quant_config)
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gated = config.hidden_act == "swiglu"
        if self.gated:
            self.gate_up_proj = MergedColumnParallelLinear(
                hidden, [inner] * 2, prefix=f"{prefix}.gate_up_proj", **linear
            )
            self.act_fn = SiluAndMul()
        else:
            self.up_proj = ColumnParallelLinear(hidden, inner, prefix=f"{prefix}.up_proj", **linear)
            self.act_fn = ACT2FN[config.hidden_act]  # elementwise: exact on a column shard
        self.down_proj = RowParallelLinear(inner, hidden, prefix=f"{prefix}.down_proj", **linear)

    def forward(self, x):
        x, _ = (self.gate_up_proj if self.gated else self.up_proj)(x)
        x, _ = self.down_proj(self.act_fn(x))
        return x


class LoopFormerAttention(nn.Module):
    """The projections of block j, shared by its M loop steps; `attn[i]` is the paged attention (and KV cache) of
    loop step i."""

    def __init__(self, config, block, num_steps, cache_config=None, quant_config=None, prefix="", model_prefix=""):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = None
        if config.position_embedding_type == "rope":
            self.rotary_emb = get_rope(
                self.head_dim,
                max_position=config.max_position_embeddings,
                is_neox_style=True,  # rotate_half, as the checkpoint's model
                rope_parameters=config.rope_parameters,
            )  # scaling, partial
        k = config.num_hidden_layers
        self.attn = nn.ModuleList(
            Attention(
                self.num_heads,
                self.head_dim,
                self.head_dim**-0.5,
                num_kv_heads=self.num_kv_heads,
                cache_config=cache_config,
                quant_config=quant_config,
                # one cache layer per (step, block), numbered as LoopFormerCache's slots
                prefix=f"{model_prefix}.layers.{step * k + block}.self_attn.attn",
            )
            for step in range(num_steps)
        )

    def forward(self, positions, hidden_states, step, active=None):
        """`active`: (token indices, batch size) when `hidden_states` holds only the tokens whose budget reaches
        this step. vLLM's attention metadata covers the whole batch, so the others enter it as zeros: they write
        zeros to their slots of this step's cache, which their requests (budget <= step) never read."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        if active is None:
            output = self.attn[step](q, k, v)
        else:
            index, num_tokens = active
            qkv = qkv.new_zeros(num_tokens, qkv.shape[-1]).index_copy_(0, index, torch.cat((q, k, v), dim=-1))
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            output = self.attn[step](q, k, v).index_select(0, index)
        output, _ = self.o_proj(output)
        return output


class LoopFormerBlock(nn.Module):
    """x = x + gate_attn·Attn(RMSNorm(x)·(1 + scale_attn)); x = x + gate_mlp·MLP(RMSNorm(x)·(1 + scale_mlp))."""

    def __init__(self, config, block, num_steps, cache_config=None, quant_config=None, prefix="", model_prefix=""):
        super().__init__()
        self.eps = config.rms_norm_eps
        if config.block_norm_weight:
            self.input_layernorm = _NormWeight(config.hidden_size)
            self.post_attention_layernorm = _NormWeight(config.hidden_size)
        self.block_norm_weight = config.block_norm_weight
        self.self_attn = LoopFormerAttention(
            config, block, num_steps, cache_config, quant_config, f"{prefix}.self_attn", model_prefix
        )
        self.mlp = LoopFormerMLP(config, quant_config, f"{prefix}.mlp")
        if config.loop_conditioning != "none":
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(config.hidden_size, 4 * config.hidden_size))

    def adaln(self, conditioning, dtype):
        """(gate_attn, gate_mlp, attention norm weight, MLP norm weight): with conditioning, (M, d) rows of every loop
        step, the scales folded into the norms' weights; without, no gates and the norms' own weights (or None)."""
        if conditioning is None:
            weights = (
                (self.input_layernorm.weight, self.post_attention_layernorm.weight)
                if (self.block_norm_weight)
                else (None, None)
            )
            return None, None, *weights
        gate_attn, gate_mlp, scale_attn, scale_mlp = self.adaLN_modulation(conditioning).to(dtype).chunk(4, dim=-1)
        if self.block_norm_weight:
            return (
                gate_attn,
                gate_mlp,
                self.input_layernorm.weight * (1 + scale_attn),
                self.post_attention_layernorm.weight * (1 + scale_mlp),
            )
        return gate_attn, gate_mlp, 1 + scale_attn, 1 + scale_mlp

    @staticmethod
    def step_rows(adaln, step, trajectory_ids=None):
        """This step's (gate_attn, gate_mlp, attention norm weight, MLP norm weight) from `adaln`: one row of each
        (M, d) table, or with `trajectory_ids`, one row per token from (trajectories, M, d) tables."""
        if adaln[0] is None:  # unconditioned: no gates, the norms' own weights
            return adaln
        if trajectory_ids is None:
            return tuple(v[step] for v in adaln)
        return tuple(v[:, step].index_select(0, trajectory_ids) for v in adaln)

    def forward(self, positions, hidden_states, step, rows, active=None):
        gate_attn, gate_mlp, weight_attn, weight_mlp = rows
        attn_out = self.self_attn(positions, rms_norm(hidden_states, weight_attn, self.eps), step, active)
        hidden_states = hidden_states + attn_out if gate_attn is None else hidden_states.addcmul(gate_attn, attn_out)
        mlp_out = self.mlp(rms_norm(hidden_states, weight_mlp, self.eps))
        return hidden_states + mlp_out if gate_mlp is None else hidden_states.addcmul(gate_mlp, mlp_out)


class _NormWeight(nn.Module):
    """The learnable weight of a block norm (`block_norm_weight`), under the checkpoint's name `...layernorm.weight`."""

    def __init__(self, hidden_size):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))


class LoopFormerModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        serving = serving_of(vllm_config)  # resolved once per engine, by the plugin's config hook
        self.loop = serving.loop  # the server's RequestLoop: every request that asks for none runs it
        self.trajectory = self.loop.trajectory
        # cache layers for the deepest trajectory a request may ask for; each request runs its own
        self.num_steps = serving.max_budget
        quant_config, cache_config = vllm_config.quant_config, vllm_config.cache_config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        if config.position_embedding_type == "learned":
            self.embed_positions = VocabParallelEmbedding(
                config.max_position_embeddings, config.hidden_size, prefix=f"{prefix}.embed_positions"
            )
        self.loop_conditioning = LoopFormerLoopConditioning(config)
        self.layers = nn.ModuleList(
            LoopFormerBlock(config, j, self.num_steps, cache_config, quant_config, f"{prefix}.layers.{j}", prefix)
            for j in range(config.num_hidden_layers)
        )
        self.norm = _NormWeight(config.hidden_size)

    def embed_input_ids(self, input_ids):
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        if self.config.position_embedding_type == "learned":
            hidden_states = hidden_states + self.embed_positions(positions)
        plan = self.plan(hidden_states.shape[0], hidden_states.device)
        # every step's adaLN vectors at once: they depend on the trajectory alone
        adaln = [self.adaln(block, plan.trajectories, hidden_states) for block in self.layers]
        if plan.uniform:
            for step in range(len(plan.trajectories[0])):
                for block, block_adaln in zip(self.layers, adaln):
                    hidden_states = block(positions, hidden_states, step, block.step_rows(block_adaln, step))
        else:
            hidden_states = self.run_plan(plan, positions, hidden_states, adaln)
        return rms_norm(hidden_states, self.norm.weight, self.config.rms_norm_eps)

    def plan(self, num_tokens, device):
        """Which tokens run which trajectory in this forward (`LoopPlan`): the server's for every token, unless a
        request in the batch asked for its own (its `RequestLoop`, resolved when it joined the batch)."""
        rows = batch_request_loops()  # this engine's, from the forward context
        metadata = get_forward_context().attn_metadata if rows else None
        if isinstance(metadata, dict):  # one per cache layer, the same rows for all: take step 0's
            metadata = metadata.get(self.layers[0].self_attn.attn[0].layer_name)
        if metadata is None or isinstance(metadata, list):  # a profiling run; micro-batches (not on CPU)
            return LoopPlan([self.loop], None, device)
        return LoopPlan.build(self.loop, rows, metadata.query_start_loc.tolist(), num_tokens, device)

    def adaln(self, block, trajectories, hidden_states):
        """The block's adaLN tables: (M, d) for one trajectory, else (trajectories, deepest M, d), zero past a
        trajectory's own budget."""
        device, dtype = hidden_states.device, hidden_states.dtype
        tables = [block.adaln(self.loop_conditioning(t, device, dtype), dtype) for t in trajectories]
        if len(tables) == 1 or tables[0][0] is None:
            return tables[0]
        depth = max(map(len, trajectories))
        return tuple(torch.stack([F.pad(t[i], (0, 0, 0, depth - t[i].shape[0])) for t in tables]) for i in range(4))

    def run_plan(self, plan, positions, hidden_states, adaln):
        """The loop when requests of several trajectories share the batch: step i runs only the tokens whose budget
        reaches it (gathered, then written back), each with its own trajectory's adaLN rows."""
        num_tokens, index, active = hidden_states.shape[0], None, None
        x, x_positions = hidden_states, positions
        for step, loop_step in enumerate(plan.steps):
            if loop_step.index is not index:  # other tokens than the last step's: write those back, gather these
                hidden_states = x if index is None else hidden_states.index_copy(0, index, x)
                index = loop_step.index
                x = hidden_states if index is None else hidden_states.index_select(0, index)
                x_positions = positions if index is None else positions.index_select(0, index)
                active = None if index is None else (index, num_tokens)
            for block, block_adaln in zip(self.layers, adaln):
                if loop_step.trajectory_ids is None and block_adaln[0] is not None:
                    rows = tuple(v[loop_step.trajectory_id, step] for v in block_adaln)
                else:
                    rows = block.step_rows(block_adaln, step, loop_step.trajectory_ids)
                x = block(x_positions, x, step, rows, active)
        return x if index is None else hidden_states.index_copy(0, index, x)


class LoopFormerForCausalLM(nn.Module):
    """vLLM's model for config.json's `"architectures": ["LoopFormerForCausalLM"]` (registered by
    `loopformer_hf.vllm_plugin`)."""

    # checkpoint name -> (vLLM parameter, shard): the fused projections vLLM's Llama uses
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    ]
    gated_params_mapping = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = LoopFormerModel(vllm_config=vllm_config, prefix=_join(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=_join(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @property
    def trajectory(self):
        return self.model.trajectory

    def embed_input_ids(self, input_ids):
        return self.model.embed_input_ids(input_ids)

    def forward(
        self, input_ids, positions, intermediate_tensors: IntermediateTensors | None = None, inputs_embeds=None
    ):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = _from_authors_layout(weights)
        mapping = self.stacked_params_mapping + (
            self.gated_params_mapping if self.config.hidden_act == "swiglu" else []
        )
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name.startswith("lm_head.") and self.config.tie_word_embeddings:
                continue  # the tied copy of model.embed_tokens.weight
            for param_name, shard_name, shard_id in mapping:
                if shard_name in name:
                    name = name.replace(shard_name, param_name)
                    param = _param(params, name)
                    param.weight_loader(param, tensor, shard_id)
                    break
            else:
                param = _param(params, name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


def _from_authors_layout(weights):
    """The weights of a repo in the authors' Hub layout (their GPT's names under `gpt.`/`model.`/`module.`, fused
    qkv) mapped onto ours by `from_pretrained`'s table; other weights pass through unchanged. A name with no
    parameter is refused by `_param`, a parameter left unfilled by vLLM's loader."""
    from .authors.weights import is_reference_weight_name, mapped_reference_state_dict

    weights, seen = iter(weights), []
    for item in weights:  # up to the first name that tells the layouts apart (an untied lm_head does not)
        seen.append(item)
        if not item[0].startswith("lm_head."):
            break
    if not seen or not is_reference_weight_name(seen[-1][0]):
        return itertools.chain(seen, weights)
    return iter(mapped_reference_state_dict(dict(itertools.chain(seen, weights))).items())


def _param(params, name):
    if name not in params:
        raise ValueError(
            f"Checkpoint tensor {name!r} has no parameter in the vLLM LoopFormer model (is this a checkpoint of "
            f"loopformer_hf's LoopFormerForCausalLM?); it has {sorted(params)[:8]}..."
        )
    return params[name]


def _join(prefix, name):
    return name if not prefix else f"{prefix}.{name}"


__all__ = ["LoopFormerForCausalLM", "server_trajectory"]
