"""FPRM: a looped transformer whose loop is a fixed-point iteration that halts per sample when it has converged
("Fixed-Point Reasoners: Stable and Adaptive Deep Looped Transformers", arXiv 2606.18206).

By concern, as LoopFormer's: the layers (norm → positions → attention → SwiGLU → depthwise conv → residual scaling
(α, β) → block) are in layers_fprm.py, the solver (Algorithm 1: `SolverSettings`, `FPRMSolverState`, `solve`) in
solver_fprm.py, a call's arguments (documented and checked) in inputs_fprm.py and what it returns in outputs_fprm.py;
this file holds the model: embeddings → one loop step f → the solver → head.

One loop step f(y) of the default model (the authors' computation, step by step; N blocks = 2N sub-layers F_k):

    y' = [prefix rows of y ; DWConv(grid rows of y)]     conv on the raw state, replacing it (no norm before it)
    h  = α2·y' + β2·x                                    x = √d·embedding, re-injected at every step
    h  = α1·h + β1·F_k(RMSNorm(h))                       for k = 1..2N (pre-norm)
    β2 = 1 − α2·α1^(2N),  β1 = β2·(1 − α1) / (1 − α1^(2N) + 1e-5)

so the iterates stay bounded (Theorem 1) however many loops run. The solver iterates y ← η·f(y) + (1 − η)·y from a
random z0; the head reads the final state with no norm in between.
"""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import add_start_docstrings_to_model_forward, logging
from typing_extensions import Unpack  # Python 3.10 (requires-python) has no typing.Unpack

from .configuration_fprm import FPRMConfig
from .inputs_fprm import (
    FPRM_INPUTS_DOCSTRING,
    FPRMSolveKwargs,
    check_attention_mask,
    check_call_flags,
    check_inputs,
    check_labels,
)
from .layers_fprm import (
    FPRMBlock,
    FPRMDepthwiseConv,
    FPRMResidualScaling,
    FPRMRotaryEmbedding,
    sample_truncated_normal,
    truncated_normal_std,
)
from .looped_common import CheckpointLoadersMixin, rms_norm
from .outputs_fprm import FPRMModelOutput, FPRMReasoningOutput, solver_fields
from .recursion_trm import TRMState, check_trm_state, recurse
from .solver_fprm import FPRMSolverState, SolverSettings, check_solver_state, input_fingerprint, solve

logger = logging.get_logger(__name__)

LEARNED_POSITION_SCALE = 2**-0.5  # x = √d·(emb + pos)/√2 keeps the variance of x at 1


class FPRMPreTrainedModel(CheckpointLoadersMixin, PreTrainedModel):
    config_class = FPRMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["FPRMBlock"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False

    checkpoint_loaders = []  # the authors' step files (`fprm_hf/__init__.py`; `CheckpointLoadersMixin`)

    @torch.no_grad()
    def _init_weights(self, module):
        # The authors' initialisation. Their truncated normal (cut at ±2σ of the underlying normal) is rescaled so
        # that the values have exactly the std asked for. The `init` helpers skip tensors that were loaded from a
        # checkpoint, so from_pretrained never overwrites weights.
        from transformers import initialization as init

        config = self.config

        def trunc_normal(tensor, std):
            s = truncated_normal_std(std)
            init.trunc_normal_(tensor, std=s, a=-2 * s, b=2 * s)

        if isinstance(module, nn.Linear) and getattr(module, "is_q_head", False):
            init.zeros_(module.weight)  # their Q-head init: halting logits start at -5
            init.constant_(module.bias, -5.0)
        elif isinstance(module, nn.Linear):
            trunc_normal(module.weight, config.initializer_range or module.weight.shape[1] ** -0.5)  # LeCun normal
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            trunc_normal(module.weight, config.hidden_size**-0.5)  # unit-scale inputs after the √d multiplier
        elif isinstance(module, FPRMDepthwiseConv):
            bound = module.weight[0].numel() ** -0.5  # PyTorch's default conv init, as the authors' nn.Conv
            init.uniform_(module.weight, -bound, bound)
            if module.bias is not None:
                init.uniform_(module.bias, -bound, bound)
        elif isinstance(module, FPRMResidualScaling):
            if module.mode == "input_independent":
                if module.alpha1_logit is not None:
                    init.constant_(module.alpha1_logit, _logit(config.alpha1))
                init.constant_(module.alpha2_logit, _logit(config.alpha2))
        elif isinstance(module, FPRMModel):
            if module.z_init is not None:  # fixed_init: one stored z0 vector
                trunc_normal(module.z_init, config.init_std)
            if module.H_init is not None:  # TRM's initial states (their trunc_normal_init_, std 1)
                trunc_normal(module.H_init, 1.0)
                trunc_normal(module.L_init, 1.0)
            if module.prefix is not None:
                init.zeros_(module.prefix)  # the authors' puzzle embedding starts at zero


def _logit(p):
    return float(torch.logit(torch.tensor(p, dtype=torch.float64)))


class FPRMModel(FPRMPreTrainedModel):
    """Embeddings, the loop step f and the fixed-point solver. Returns the final state (prefix rows included)."""

    def __init__(self, config: FPRMConfig):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, d) if config.position_embedding_type == "learned" else None
        )
        self.rotary_emb = FPRMRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        # learned prefix rows (the authors' puzzle embedding), one set per puzzle identifier
        self.prefix = (
            nn.Parameter(torch.empty(config.num_puzzle_identifiers, config.num_prefix_tokens, d))
            if config.num_prefix_tokens
            else None
        )
        if config.fixed_init:
            self.register_buffer("z_init", torch.empty(d), persistent=True)  # z0, broadcast to every token
        else:
            self.z_init = None
        if config.recursion == "trm":  # TRM's z_H and z_L start from these on every token (recursion_trm.py)
            self.register_buffer("H_init", torch.empty(d), persistent=True)
            self.register_buffer("L_init", torch.empty(d), persistent=True)
        else:
            self.H_init = self.L_init = None
        self.conv = FPRMDepthwiseConv(config) if config.conv_type != "none" else None
        self.residual_scaling = FPRMResidualScaling(config)
        self.layers = nn.ModuleList([FPRMBlock(config) for _ in range(config.num_hidden_layers)])
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # ---- the input x, re-injected at every step, and the start z0 -----------------------------------------------

    def embed(self, input_ids, puzzle_identifiers=None, inputs_embeds=None):
        """x: (batch, prefix + tokens, hidden), the input re-injected at every loop step:
        √d·[prefix ; embedding], or √d·([prefix ; embedding] + positions)/√2 with learned positions. `inputs_embeds`
        stands in for `embed_tokens(input_ids)`."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.prefix is not None:
            if puzzle_identifiers is None:
                puzzle_identifiers = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            x = torch.cat([self.prefix_rows(puzzle_identifiers).to(x.dtype), x], dim=1)
        if self.embed_positions is not None:
            positions = self.embed_positions(torch.arange(x.shape[1], device=x.device))[None]
            x = LEARNED_POSITION_SCALE * (x + positions)
        return self.config.hidden_size**0.5 * x  # embeddings are initialised at std 1/√d: x has unit scale

    def prefix_rows(self, puzzle_identifiers):
        """The prefix rows of each sample, (batch, num_prefix_tokens, hidden): with `puzzle_emb_ndim`, only its
        first values (row-major) are the table's, the rest zero, as their zero-padded puzzle embedding."""
        rows = self.prefix[puzzle_identifiers]
        ndim = self.config.puzzle_emb_ndim
        if ndim is None:
            return rows
        keep = torch.arange(rows[0].numel(), device=rows.device) < ndim
        return rows * keep.view(rows.shape[1:]).to(rows.dtype)

    def initial_z(self, x, generator=None):
        """z0 for every sample and token of `x` (module docstring of the config, `fixed_init`, `init_std`).

        - `fixed_init=True`: the stored vector `z_init` on every token.
        - a `generator`: a fresh truncated normal per sample and token drawn from it.
        - training mode: a fresh truncated normal per sample and token from the global RNG (the authors' reset).
        - evaluation mode: one (tokens, hidden) draw from a generator seeded with `config.initial_state_seed`, the
          same for every sample, so that an eval forward is deterministic and a row's output does not depend on
          the batch it is in (nor, for a prefix of a longer input, on the tokens after it).
        """
        b, n, d = x.shape
        if self.z_init is not None:
            return self.z_init.to(x.dtype)[None, None].expand(b, n, d).clone()
        std = self.config.init_std
        if generator is not None or self.training:
            return sample_truncated_normal((b, n, d), std, generator, x.device, x.dtype)
        seeded = torch.Generator(device=x.device).manual_seed(self.config.initial_state_seed)
        return sample_truncated_normal((n, d), std, seeded, x.device, x.dtype)[None].expand(b, n, d).clone()

    def initial_solver_state(self, x, eta=None, generator=None):
        """A fresh state: y = z0 (`initial_z`), η = η0, nothing halted."""
        eta = self.config.eta if eta is None else eta
        return FPRMSolverState.start(self.initial_z(x, generator), eta, self.config.patience)

    def start_state(self, x, solver_state, fingerprint, eta=None, generator=None):
        """The state a call starts from: a fresh one (`initial_solver_state`), or the given `solver_state` once
        `check_solver_state` has found it fits these inputs; tagged with their `fingerprint`."""
        if solver_state is None:
            solver_state = self.initial_solver_state(x, eta, generator)
        else:
            check_solver_state(solver_state, x, fingerprint)
        return replace(solver_state, fingerprint=fingerprint)

    def trm_initial_state(self, x):
        """TRM's reset: z_H = H_init and z_L = L_init on every token (`recursion="trm"`)."""
        b, n, d = x.shape
        z_H, z_L = (v.to(x.dtype)[None, None].expand(b, n, d).clone() for v in (self.H_init, self.L_init))
        return TRMState.start(z_H, z_L)

    def position_embeddings(self, x):
        if self.rotary_emb is None:
            return None
        cos, sin = self.rotary_emb(x, torch.arange(x.shape[1], device=x.device)[None])
        return cos[:, None], sin[:, None]  # (1, 1, seq, rotary_dim): one for every head

    # ---- one loop step ------------------------------------------------------------------------------------------

    def fixed_point_map(self, y, x, position_embeddings=None):
        """f(y): one loop step with the input x re-injected (module docstring)."""
        config = self.config
        eps = config.rms_norm_eps
        if config.normalize_input_injection:
            x = rms_norm(x, eps=eps)
        if self.conv is not None:  # the conv replaces the grid rows of the raw state
            y = torch.cat([y[:, : config.num_prefix_tokens], self.conv(y)], dim=1)
        alpha1, beta1, alpha2, beta2 = self.residual_scaling(y)
        if config.norm_placement == "input":
            y = rms_norm(y, eps=eps)
        h = alpha2 * y + beta2 * x
        for block in self.layers:
            h = block(h, alpha1, beta1, position_embeddings)
        if config.norm_placement == "output":
            h = rms_norm(h, eps=eps)
        return h

    def loop(self, x, solver_state, fingerprint, settings, max_loops, generator, trace, hidden):
        """The loop of a forward from its start state: FPRM's solver (solver_fprm.py) or, with `recursion="trm"`,
        TRM's ACT steps, `max_loops` of them if given, else `halt_max_steps` (recursion_trm.py)."""
        position_embeddings = self.position_embeddings(x)
        step = lambda y, x_rows: self.fixed_point_map(y, x_rows, position_embeddings)  # noqa: E731
        if self.config.recursion != "trm":
            solver_state = self.start_state(x, solver_state, fingerprint, settings.eta, generator)
            return solve(step, x, solver_state, settings, trace, hidden)
        if solver_state is None:
            solver_state = self.trm_initial_state(x)
        check_trm_state(solver_state, x, fingerprint)
        solver_state = replace(solver_state, fingerprint=fingerprint)
        act_steps = self.config.halt_max_steps if max_loops is None else settings.max_loops
        return recurse(step, x, solver_state, self.config, act_steps, settings.halt_eps, trace, hidden)

    # ---- the call: inputs checked, the solver run (solver_fprm.py) ----------------------------------------------

    @add_start_docstrings_to_model_forward(FPRM_INPUTS_DOCSTRING)
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        puzzle_identifiers=None,
        halt_eps=None,
        max_loops=None,
        eta=None,
        gamma=None,
        patience=None,
        min_eta=None,
        halting=True,
        halt_scope=None,
        solver_state=None,
        output_residual_trace=False,
        generator=None,
        output_hidden_states=None,
        return_dict=None,
        inputs_embeds=None,
        output_attentions=None,
    ):
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        check_call_flags(output_attentions, output_residual_trace, output_hidden_states, generator)
        settings = SolverSettings.from_config(
            self.config,
            self.training,
            halt_eps=halt_eps,
            max_loops=max_loops,
            eta=eta,
            gamma=gamma,
            patience=patience,
            min_eta=min_eta,
            halting=halting,
            halt_scope=halt_scope,
        )
        shape = check_inputs(self.config, input_ids, puzzle_identifiers, inputs_embeds)
        check_attention_mask(attention_mask, shape)
        x = self.embed(input_ids, puzzle_identifiers, inputs_embeds)
        fingerprint = input_fingerprint(input_ids, puzzle_identifiers, inputs_embeds)
        state, iterations, trace, iterates = self.loop(
            x, solver_state, fingerprint, settings, max_loops, generator, output_residual_trace, output_hidden_states
        )
        output = FPRMModelOutput(
            last_hidden_state=state.hidden,
            iterations=iterations,
            residuals=state.residuals,
            converged=state.converged,
            diverged=state.diverged,
            residual_trace=trace,
            solver_state=state,
            hidden_states=iterates,
        )
        return output if return_dict else output.to_tuple()


class FPRMForReasoning(FPRMPreTrainedModel):
    """FPRM with a per-token classification head on the final state (no norm in between, as the authors): predicts
    the answer token of every input token (a Sudoku cell, a maze cell, the running product of a state-tracking
    prefix)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # tied only with tie_word_embeddings=True
    # its **kwargs are the solver's (FPRMSolveKwargs), not loss kwargs: Trainer must not pass `num_items_in_batch`
    accepts_loss_kwargs = False

    def __init__(self, config: FPRMConfig):
        super().__init__(config)
        self.model = FPRMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.q_head = None
        if config.use_q_head or config.recursion == "trm":  # their Q-head: (halt, continue) logits; only the
            # first is used (no_ACT_continue); TRM halts by it in training
            self.q_head = nn.Linear(config.hidden_size, 2, bias=True)
            self.q_head.is_q_head = True
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @add_start_docstrings_to_model_forward(FPRM_INPUTS_DOCSTRING)
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        labels=None,
        puzzle_identifiers=None,
        inputs_embeds=None,
        return_dict=None,
        **kwargs: Unpack[FPRMSolveKwargs],
    ):
        r"""
        labels (`torch.LongTensor` of shape `(batch, tokens)`, *optional*): target token per input token, -100 ignored.

        The solver's arguments (`halt_eps`, `max_loops`, ..., `output_hidden_states`) are [`FPRMModel.forward`]'s.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labels is not None:
            inputs = input_ids if inputs_embeds is None else inputs_embeds
            check_labels(labels, tuple(getattr(inputs, "shape", ()))[:2], self.config.vocab_size)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            puzzle_identifiers=puzzle_identifiers,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        hidden = outputs.last_hidden_state[:, self.config.num_prefix_tokens :]
        logits = self.lm_head(hidden)
        q_halt_logits = None
        if self.q_head is not None:
            q_halt_logits = self.q_head(outputs.solver_state.hidden[:, 0]).float()[..., 0]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten().to(logits.device), ignore_index=-100)
        output = FPRMReasoningOutput(loss=loss, logits=logits, q_halt_logits=q_halt_logits, **solver_fields(outputs))
        return output if return_dict else output.to_tuple()


__all__ = [
    "FPRMPreTrainedModel",
    "FPRMModel",
    "FPRMForReasoning",
]
