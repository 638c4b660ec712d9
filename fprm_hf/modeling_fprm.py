"""FPRM: a looped transformer whose loop is a fixed-point iteration that halts per sample when it has converged
("Fixed-Point Reasoners: Stable and Adaptive Deep Looped Transformers", arXiv 2606.18206).

By concern, as LoopFormer's: the layers (norm → positions → attention → SwiGLU → depthwise conv → residual scaling
(α, β) → block) are in layers_fprm.py, the solver (Algorithm 1: `SolverSettings`, `FPRMSolverState`, `solve`) in
solver_fprm.py; this file holds the model: embeddings → one loop step f → the solver → head.

One loop step f(y) of the default model (the authors' computation, step by step; N blocks = 2N sub-layers F_k):

    y' = [prefix rows of y ; DWConv(grid rows of y)]     conv on the raw state, replacing it (no norm before it)
    h  = α2·y' + β2·x                                    x = √d·embedding, re-injected at every step
    h  = α1·h + β1·F_k(RMSNorm(h))                       for k = 1..2N (pre-norm)
    β2 = 1 − α2·α1^(2N),  β1 = β2·(1 − α1) / (1 − α1^(2N) + 1e-5)

so the iterates stay bounded (Theorem 1) however many loops run. The solver iterates y ← η·f(y) + (1 − η)·y from a
random z0; the head reads the final state with no norm in between.
"""

import glob
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn
from typing_extensions import TypedDict, Unpack  # Python 3.10 (requires-python) has no typing.Unpack

from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import add_start_docstrings_to_model_forward, logging

from .configuration_fprm import FPRMConfig
from .layers_fprm import (
    FPRMBlock,
    FPRMDepthwiseConv,
    FPRMResidualScaling,
    FPRMRotaryEmbedding,
    rms_norm,
    sample_truncated_normal,
    truncated_normal_std,
)
from .solver_fprm import FPRMSolverState, SolverSettings, check_solver_state, input_fingerprint, solve


try:  # with looped_training installed, push_to_hub writes this package's model card (one home for both models)
    from looped_training.publish import ModelCardMixin
except ImportError:  # this package alone, or the copy trust_remote_code loads: transformers' own push_to_hub

    class ModelCardMixin:
        pass


logger = logging.get_logger(__name__)

LEARNED_POSITION_SCALE = 2**-0.5  # x = √d·(emb + pos)/√2 keeps the variance of x at 1


class FPRMPreTrainedModel(ModelCardMixin, PreTrainedModel):
    config_class = FPRMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["FPRMBlock"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False

    # Other checkpoint layouts (the authors' published step files) register a loader here, `load(cls, path, args,
    # kwargs)` -> a model or None (`fprm_hf/__init__.py`): this module imports none, so a saved folder carries none.
    checkpoint_loaders = []

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`. A weights file that is not safetensors (a pickle renamed
        `model.safetensors`, a truncated download) is an OSError naming the file, where transformers lets
        safetensors' bare "Error while deserializing header" through (a tiny Llama does the same). A folder in
        another registered layout (the authors' published step files) is loaded by its `checkpoint_loaders` entry."""
        for load in FPRMPreTrainedModel.checkpoint_loaders:
            if (model := load(cls, pretrained_model_name_or_path, args, kwargs)) is not None:
                return model
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as e:
            raise OSError(
                f"{_unreadable_safetensors(pretrained_model_name_or_path)} is not a safetensors file (safetensors: "
                f"{e}). Nothing was loaded from it, and pickles are never unpickled here: re-save the model with "
                f"`save_pretrained`, or give the folder it was saved to."
            ) from None

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
            if module.prefix is not None:
                init.zeros_(module.prefix)  # the authors' puzzle embedding starts at zero


def _unreadable_safetensors(path):
    """The .safetensors files of a local folder that safetensors cannot open, or the name given (a Hub id)."""
    bad = []
    for file in sorted(glob.glob(os.path.join(str(path), "*.safetensors"))):
        try:
            with safe_open(file, framework="pt"):
                pass
        except SafetensorError:
            bad.append(file)
    return ", ".join(repr(f) for f in bad) or f"a weights file of {str(path)!r}"


def _is_integer_tensor(value):
    """An integer tensor (token ids, labels, identifiers): not bool, float or complex."""
    return torch.is_tensor(value) and not (value.dtype.is_floating_point or value.dtype.is_complex
                                           or value.dtype == torch.bool)


def check_call_flags(output_attentions, output_residual_trace, output_hidden_states, generator):
    """The flags of a forward. `output_attentions` is taken (transformers callers such as PEFT's
    token-classification wrapper pass it) at None / False only: the attention maps change at every solver iteration
    and none is returned."""
    if output_attentions not in (None, False):
        raise ValueError(
            f"FPRM does not return attention maps (they change at every solver iteration); `output_attentions` must "
            f"be None or False, got {output_attentions!r}."
        )
    for name, value in (("output_residual_trace", output_residual_trace),
                        ("output_hidden_states", output_hidden_states)):
        if not isinstance(value, bool):
            raise ValueError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"`generator` must be a torch.Generator or None, got {type(generator).__name__}.")


def _logit(p):
    return float(torch.logit(torch.tensor(p, dtype=torch.float64)))


@dataclass
class FPRMModelOutput(ModelOutput):
    """
    last_hidden_state: the final state y, prefix tokens included.
    iterations: (batch,) iterations of f this call applied to each sample.
    residuals: (batch,) final relative ∞-norm residual per sample (inf where it was not finite).
    converged: (batch,) True where the residual fell below `halt_eps`.
    diverged: (batch,) True where a non-finite residual stopped the sample (its last finite state is kept).
    residual_trace: (batch, iterations run) residual after each iteration (with `output_residual_trace=True`);
        a halted row repeats its final residual.
    solver_state: the `FPRMSolverState` to continue from (pass it back as `solver_state=`).
    hidden_states: with `output_hidden_states=True`, the solver's iterates (y_0, y_1, ..., y_K) as a tuple of
        (batch, prefix + tokens, hidden) tensors: y_0 the state the call starts from (z0, or the given
        `solver_state`), y_k the state after iteration k, K the most iterations any sample ran in this call. A
        sample that halted before K repeats its final state. The entries are the raw iterates (no final norm).
    """

    last_hidden_state: torch.FloatTensor | None = None
    iterations: torch.LongTensor | None = None
    residuals: torch.FloatTensor | None = None
    converged: torch.BoolTensor | None = None
    diverged: torch.BoolTensor | None = None
    residual_trace: torch.FloatTensor | None = None
    solver_state: FPRMSolverState | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class FPRMReasoningOutput(ModelOutput):
    """
    loss: cross-entropy of `logits` against `labels` (-100 ignored), when labels are given.
    logits: (batch, input tokens, vocab_size) prediction for every input token (prefix tokens dropped).
    q_halt_logits: (batch,) float32, with `use_q_head=True`: the Q-head's halting logit, read from the first row of
        the final state (their `q_head(y[:, 0])[..., 0]`).
    Other fields as [`FPRMModelOutput`].
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    iterations: torch.LongTensor | None = None
    residuals: torch.FloatTensor | None = None
    converged: torch.BoolTensor | None = None
    diverged: torch.BoolTensor | None = None
    residual_trace: torch.FloatTensor | None = None
    solver_state: FPRMSolverState | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    q_halt_logits: torch.FloatTensor | None = None


FPRM_INPUTS_DOCSTRING = r"""
        input_ids (`torch.LongTensor` of shape `(batch, tokens)`): the puzzle; `tokens` must be height × width of
            `config.grid_size` when a grid is configured.
        attention_mask (`torch.Tensor` of shape `(batch, tokens)`, *optional*): accepted as transformers models do,
            but it must be all ones: FPRM reads every token (see `check_attention_mask`); a padded mask raises
            `ValueError`.
        puzzle_identifiers (`torch.LongTensor` of shape `(batch,)`, *optional*): row of the prefix table per sample.
        halt_eps (`float`, *optional*): τ; a sample halts when its relative residual is below it (config default).
        max_loops (`int`, *optional*): iteration cap for this call (config default).
        eta (`float`, *optional*): η0 for samples that start here (config default).
        gamma (`float`, *optional*): decay of η; defaults to `gamma_train` in training mode and `gamma_eval` in eval.
        patience (`int`, *optional*): P, iterations without improvement before η decays.
        min_eta (`float`, *optional*): a sample halts when η falls below it.
        halting (`bool`, defaults to `True`): `False` runs every sample for exactly `max_loops` iterations.
        halt_scope (`str`, *optional*): `"sample"` (each row halts on its own) or `"batch"` (every row halts at the
            first iteration where the batch's largest residual is below `halt_eps` or its largest η below `min_eta`,
            as the authors' evaluation); defaults to `config.halt_scope` in evaluation mode, `"sample"` in training.
        solver_state (`FPRMSolverState`, *optional*): continue from a previous call's `solver_state`.
        output_residual_trace (`bool`, defaults to `False`): also return the residual after every iteration.
        generator (`torch.Generator`, *optional*): draw z0 from it, fresh per sample and token (see `initial_z`;
            without it, training mode uses the global RNG and evaluation mode a generator seeded with
            `config.initial_state_seed`).
        output_hidden_states (`bool`, *optional*): also return the solver's iterates y_0..y_K as `hidden_states`
            (see [`FPRMModelOutput`]); defaults to `config.output_hidden_states`.
        inputs_embeds (`torch.FloatTensor` of shape `(batch, tokens, hidden_size)`, *optional*): instead of
            `input_ids`, the token embeddings (what `get_input_embeddings()(input_ids)` gives); scaled, prefixed and
            re-injected as those are.
        output_attentions (`bool`, *optional*): None or False only (see `check_call_flags`).
"""


class FPRMSolveKwargs(TypedDict, total=False):
    """The arguments of a call beyond its inputs (`FPRM_INPUTS_DOCSTRING`), written once: `FPRMModel.forward` takes
    them, `FPRMForReasoning.forward` passes them on."""

    halt_eps: float
    max_loops: int
    eta: float
    gamma: float
    patience: int
    min_eta: float
    halting: bool
    halt_scope: str
    solver_state: FPRMSolverState
    output_residual_trace: bool
    generator: torch.Generator
    output_hidden_states: bool
    output_attentions: bool


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
            if config.num_prefix_tokens else None
        )
        if config.fixed_init:
            self.register_buffer("z_init", torch.empty(d), persistent=True)  # z0, broadcast to every token
        else:
            self.z_init = None
        self.conv = FPRMDepthwiseConv(config) if config.conv_type != "none" else None
        self.residual_scaling = FPRMResidualScaling(config)
        self.layers = nn.ModuleList([FPRMBlock(config) for _ in range(config.num_hidden_layers)])
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # ---- inputs -------------------------------------------------------------------------------------------------

    def check_inputs(self, input_ids, puzzle_identifiers=None, inputs_embeds=None):
        """Checks the inputs of a forward; returns (batch, tokens)."""
        config = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Give exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is not None:
            if not (torch.is_tensor(inputs_embeds) and inputs_embeds.dtype.is_floating_point
                    and inputs_embeds.dim() == 3 and inputs_embeds.shape[-1] == config.hidden_size):
                raise ValueError(
                    f"`inputs_embeds` must be a float tensor of shape (batch, tokens, hidden_size={config.hidden_size}),"
                    f" got {type(inputs_embeds).__name__} {getattr(inputs_embeds, 'shape', '')} "
                    f"{getattr(inputs_embeds, 'dtype', '')}."
                )
            given, shape = "inputs_embeds", tuple(inputs_embeds.shape[:2])
        else:
            if not _is_integer_tensor(input_ids) or input_ids.dim() != 2:
                raise ValueError(
                    f"`input_ids` must be an integer tensor of shape (batch, tokens), got "
                    f"{type(input_ids).__name__} {getattr(input_ids, 'shape', '')} {getattr(input_ids, 'dtype', '')}."
                )
            if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= config.vocab_size):
                raise ValueError(
                    f"`input_ids` must lie in [0, {config.vocab_size - 1}] (vocab_size={config.vocab_size}), got "
                    f"values in [{int(input_ids.min())}, {int(input_ids.max())}]."
                )
            given, shape = "input_ids", tuple(input_ids.shape)
        n = shape[1]
        if config.grid_size is not None and n != config.num_grid_tokens:
            h, w = config.grid_shape
            raise ValueError(
                f"This model reads {h}x{w} grids, i.e. {h * w} tokens per sample; got {n} tokens "
                f"({given} shape {shape})."
            )
        if n == 0:
            raise ValueError("`input_ids` has no tokens; at least one token per sample is needed.")
        total = n + config.num_prefix_tokens
        if self.embed_positions is not None and total > config.max_position_embeddings:
            raise ValueError(
                f"{n} tokens + {config.num_prefix_tokens} prefix tokens = {total} exceed max_position_embeddings="
                f"{config.max_position_embeddings} (learned positions cannot extrapolate)."
            )
        if puzzle_identifiers is not None:
            if not _is_integer_tensor(puzzle_identifiers) or tuple(puzzle_identifiers.shape) != shape[:1]:
                raise ValueError(
                    f"`puzzle_identifiers` must be an integer tensor of shape (batch,) = ({shape[0]},), got "
                    f"{type(puzzle_identifiers).__name__} {getattr(puzzle_identifiers, 'shape', '')} "
                    f"{getattr(puzzle_identifiers, 'dtype', '')}."
                )
            if puzzle_identifiers.numel() and (
                int(puzzle_identifiers.min()) < 0 or int(puzzle_identifiers.max()) >= config.num_puzzle_identifiers
            ):
                raise ValueError(
                    f"`puzzle_identifiers` must lie in [0, {config.num_puzzle_identifiers - 1}] "
                    f"(num_puzzle_identifiers={config.num_puzzle_identifiers}), got values in "
                    f"[{int(puzzle_identifiers.min())}, {int(puzzle_identifiers.max())}]."
                )
        return shape

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

    # ---- the call: inputs checked, the solver run (solver_fprm.py) ----------------------------------------------

    @staticmethod
    def check_attention_mask(attention_mask, shape):
        """FPRM cannot honour padding: every token attends to every other (or, causal, to all before it), the conv
        mixes neighbouring cells and the residual that halts a sample is a maximum over all its tokens, as in the
        authors' model, which reads fixed-length grids. So a mask must be all ones; a padded one is refused."""
        if attention_mask is None:
            return
        if not torch.is_tensor(attention_mask) or tuple(attention_mask.shape) != shape:
            raise ValueError(
                f"`attention_mask` must be a tensor of the shape of `input_ids` {shape}, got "
                f"{type(attention_mask).__name__} {tuple(getattr(attention_mask, 'shape', ()))}."
            )
        if not bool((attention_mask == 1).all()):
            raise ValueError(
                f"FPRM cannot honour a padded `attention_mask` (it has {int((attention_mask != 1).sum())} entries "
                f"that are not 1): attention, the conv and the halting residual read every token, as in the authors' "
                f"model. Pass inputs of equal length without padding (solve different lengths in separate batches), "
                f"or an all-ones mask."
            )

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
        settings = SolverSettings.from_config(self.config, self.training, halt_eps=halt_eps, max_loops=max_loops,
                                              eta=eta, gamma=gamma, patience=patience, min_eta=min_eta,
                                              halting=halting, halt_scope=halt_scope)
        shape = self.check_inputs(input_ids, puzzle_identifiers, inputs_embeds)
        self.check_attention_mask(attention_mask, shape)
        x = self.embed(input_ids, puzzle_identifiers, inputs_embeds)
        fingerprint = input_fingerprint(input_ids, puzzle_identifiers, inputs_embeds)
        if solver_state is None:
            solver_state = self.initial_solver_state(x, settings.eta, generator)
        else:
            check_solver_state(solver_state, x, fingerprint)
        solver_state = replace(solver_state, fingerprint=fingerprint)
        position_embeddings = self.position_embeddings(x)
        step = lambda y, x_rows: self.fixed_point_map(y, x_rows, position_embeddings)  # noqa: E731
        state, iterations, trace, iterates = solve(
            step, x, solver_state, settings, output_residual_trace, output_hidden_states
        )
        output = FPRMModelOutput(
            last_hidden_state=state.hidden, iterations=iterations, residuals=state.residuals,
            converged=state.converged, diverged=state.diverged, residual_trace=trace, solver_state=state,
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
        if config.use_q_head:  # their Q-head: (halt, continue) logits; only the first is used (no_ACT_continue)
            self.q_head = nn.Linear(config.hidden_size, 2, bias=True)
            self.q_head.is_q_head = True
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def check_labels(self, labels, shape):
        """`labels`: an integer tensor of the inputs' (batch, tokens) `shape`, each a token id or -100 (ignored)."""
        if not _is_integer_tensor(labels) or tuple(labels.shape) != shape:
            raise ValueError(
                f"`labels` must be an integer tensor of the shape of `input_ids` {shape}, got "
                f"{type(labels).__name__} {tuple(getattr(labels, 'shape', ()))} {getattr(labels, 'dtype', '')}."
            )
        vocab = self.config.vocab_size
        invalid = (labels != -100) & ((labels < 0) | (labels >= vocab))
        if bool(invalid.any()):
            raise ValueError(
                f"`labels` must lie in [0, {vocab - 1}] (vocab_size={vocab}) or be -100 (ignored), got "
                f"{sorted(set(labels[invalid].tolist()))[:5]}."
            )

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @add_start_docstrings_to_model_forward(FPRM_INPUTS_DOCSTRING)
    def forward(self, input_ids=None, attention_mask=None, labels=None, puzzle_identifiers=None, inputs_embeds=None,
                return_dict=None, **kwargs: Unpack[FPRMSolveKwargs]):
        r"""
        labels (`torch.LongTensor` of shape `(batch, tokens)`, *optional*): target token per input token, -100 ignored.

        The solver's arguments (`halt_eps`, `max_loops`, ..., `output_hidden_states`) are [`FPRMModel.forward`]'s.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labels is not None:
            inputs = input_ids if inputs_embeds is None else inputs_embeds
            self.check_labels(labels, tuple(getattr(inputs, "shape", ()))[:2])
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, puzzle_identifiers=puzzle_identifiers,
                             inputs_embeds=inputs_embeds, return_dict=True, **kwargs)
        hidden = outputs.last_hidden_state[:, self.config.num_prefix_tokens :]
        logits = self.lm_head(hidden)
        q_halt_logits = None
        if self.q_head is not None:
            q_halt_logits = self.q_head(outputs.solver_state.hidden[:, 0]).float()[..., 0]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten().to(logits.device), ignore_index=-100)
        solved = {k: getattr(outputs, k) for k in ("iterations", "residuals", "converged", "diverged",
                                                   "residual_trace", "solver_state", "hidden_states")}
        output = FPRMReasoningOutput(loss=loss, logits=logits, q_halt_logits=q_halt_logits, **solved)
        return output if return_dict else output.to_tuple()


__all__ = [
    "FPRMPreTrainedModel",
    "FPRMModel",
    "FPRMForReasoning",
    "FPRMModelOutput",
    "FPRMReasoningOutput",
]
