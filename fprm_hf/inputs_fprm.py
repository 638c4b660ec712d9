"""The arguments of an FPRM call: documented once (`FPRM_INPUTS_DOCSTRING`, and `FPRMSolveKwargs`, the solver's
knobs that `FPRMForReasoning.forward` passes on) and checked before anything runs (`check_call_flags`,
`check_inputs`, `check_attention_mask`, `check_labels`); each refusal is a `ValueError` naming the argument.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

import torch
from typing_extensions import TypedDict  # with typing_extensions' Unpack (Python 3.10 has no typing.Unpack)

from .solver_fprm import FPRMSolverState

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
            (see [`FPRMSolverOutputMixin`]); defaults to `config.output_hidden_states`.
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


def is_integer_tensor(value):
    """An integer tensor (token ids, labels, identifiers): not bool, float or complex."""
    return torch.is_tensor(value) and not (
        value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool
    )


def check_call_flags(output_attentions, output_residual_trace, output_hidden_states, generator):
    """The flags of a forward. `output_attentions` is taken (transformers callers such as PEFT's
    token-classification wrapper pass it) at None / False only: the attention maps change at every solver iteration
    and none is returned."""
    if output_attentions not in (None, False):
        raise ValueError(
            f"FPRM does not return attention maps (they change at every solver iteration); `output_attentions` must "
            f"be None or False, got {output_attentions!r}."
        )
    for name, value in (
        ("output_residual_trace", output_residual_trace),
        ("output_hidden_states", output_hidden_states),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"`generator` must be a torch.Generator or None, got {type(generator).__name__}.")


def check_inputs(config, input_ids, puzzle_identifiers=None, inputs_embeds=None):
    """Checks the inputs of a forward against `config`; returns (batch, tokens)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Give exactly one of `input_ids` or `inputs_embeds`.")
    if inputs_embeds is not None:
        if not (
            torch.is_tensor(inputs_embeds)
            and inputs_embeds.dtype.is_floating_point
            and inputs_embeds.dim() == 3
            and inputs_embeds.shape[-1] == config.hidden_size
        ):
            raise ValueError(
                f"`inputs_embeds` must be a float tensor of shape (batch, tokens, hidden_size={config.hidden_size}),"
                f" got {type(inputs_embeds).__name__} {getattr(inputs_embeds, 'shape', '')} "
                f"{getattr(inputs_embeds, 'dtype', '')}."
            )
        given, shape = "inputs_embeds", tuple(inputs_embeds.shape[:2])
    else:
        if not is_integer_tensor(input_ids) or input_ids.dim() != 2:
            raise ValueError(
                f"`input_ids` must be an integer tensor of shape (batch, tokens), got "
                f"{type(input_ids).__name__} {getattr(input_ids, 'shape', '')} {getattr(input_ids, 'dtype', '')}."
            )
        check_ids_below("input_ids", input_ids, "vocab_size", config.vocab_size)
        given, shape = "input_ids", tuple(input_ids.shape)
    n = shape[1]
    if config.grid_size is not None and n != config.num_grid_tokens:
        h, w = config.grid_shape
        raise ValueError(
            f"This model reads {h}x{w} grids, i.e. {h * w} tokens per sample; got {n} tokens ({given} shape {shape})."
        )
    if n == 0:
        raise ValueError("`input_ids` has no tokens; at least one token per sample is needed.")
    total = n + config.num_prefix_tokens
    if config.position_embedding_type == "learned" and total > config.max_position_embeddings:
        raise ValueError(
            f"{n} tokens + {config.num_prefix_tokens} prefix tokens = {total} exceed max_position_embeddings="
            f"{config.max_position_embeddings} (learned positions cannot extrapolate)."
        )
    if puzzle_identifiers is not None:
        check_puzzle_identifiers(config, puzzle_identifiers, shape[0])
    return shape


def check_puzzle_identifiers(config, puzzle_identifiers, batch):
    """`puzzle_identifiers`: an integer tensor of shape (batch,), each a row of the prefix table."""
    if not is_integer_tensor(puzzle_identifiers) or tuple(puzzle_identifiers.shape) != (batch,):
        raise ValueError(
            f"`puzzle_identifiers` must be an integer tensor of shape (batch,) = ({batch},), got "
            f"{type(puzzle_identifiers).__name__} {getattr(puzzle_identifiers, 'shape', '')} "
            f"{getattr(puzzle_identifiers, 'dtype', '')}."
        )
    check_ids_below("puzzle_identifiers", puzzle_identifiers, "num_puzzle_identifiers", config.num_puzzle_identifiers)


def check_ids_below(name, ids, size_name, size):
    """Every value of the integer tensor `ids` (the argument `name`) lies in [0, size), `size` the config's
    `size_name`."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= size):
        raise ValueError(
            f"`{name}` must lie in [0, {size - 1}] ({size_name}={size}), got values in "
            f"[{int(ids.min())}, {int(ids.max())}]."
        )


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


def check_labels(labels, shape, vocab):
    """`labels`: an integer tensor of the inputs' (batch, tokens) `shape`, each a token id (below `vocab`, the
    config's `vocab_size`) or -100 (ignored)."""
    if not is_integer_tensor(labels) or tuple(labels.shape) != shape:
        raise ValueError(
            f"`labels` must be an integer tensor of the shape of `input_ids` {shape}, got "
            f"{type(labels).__name__} {tuple(getattr(labels, 'shape', ()))} {getattr(labels, 'dtype', '')}."
        )
    invalid = (labels != -100) & ((labels < 0) | (labels >= vocab))
    if bool(invalid.any()):
        raise ValueError(
            f"`labels` must lie in [0, {vocab - 1}] (vocab_size={vocab}) or be -100 (ignored), got "
            f"{sorted(set(labels[invalid].tolist()))[:5]}."
        )


__all__ = [
    "FPRM_INPUTS_DOCSTRING",
    "FPRMSolveKwargs",
    "is_integer_tensor",
    "check_call_flags",
    "check_inputs",
    "check_puzzle_identifiers",
    "check_attention_mask",
    "check_labels",
]
