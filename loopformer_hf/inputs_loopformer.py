"""What a LoopFormer forward call accepts as masks, positions and token inputs (transformers' conventions, refused
with a `ValueError` that names the value otherwise), and what the forward makes of them in one call (`call_inputs`):
the embeddings, the position ids and the attention mask, as Llama's forward makes them.

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

import torch
from transformers.masking_utils import create_causal_mask


def call_inputs(config, embed_tokens, input_ids, inputs_embeds, attention_mask, position_ids, cache):
    """(embeddings, position ids (batch, q_len), attention mask) of one forward call, its inputs checked first (against
    the tokens `cache` holds)."""
    check_token_inputs(input_ids, inputs_embeds, config.vocab_size, config.hidden_size, embed_tokens.weight.dtype)
    inputs_embeds = inputs_embeds if input_ids is None else embed_tokens(input_ids)
    (batch, q_len), device = inputs_embeds.shape[:2], inputs_embeds.device
    if cache is not None and not torch.compiler.is_compiling():
        cache.check_batch_size(batch)
    past_len, kv_len = cache.mask_lengths(q_len) if cache is not None else (0, q_len)
    check_mask_and_positions(attention_mask, position_ids, batch, q_len, kv_len)
    if position_ids is None:
        position_ids = default_position_ids(attention_mask, batch, q_len, past_len, device)
    position_ids = position_ids.expand(batch, q_len)  # (1, q_len) is shared by the batch, as in Llama
    mask = attention_mask_for(config, inputs_embeds, attention_mask, position_ids, cache, past_len)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(inputs_embeds.dtype)  # additive: sdpa needs the queries' dtype
    return inputs_embeds, position_ids, mask


def attention_mask_for(config, inputs_embeds, attention_mask, position_ids, cache, past_len):
    """The attention mask of one forward call, as Llama builds it (`create_causal_mask`: bool for sdpa, additive for
    eager, None for a plain causal prefill or decode step, a 4-D mask as given); a 2-D mask's shape is checked against
    the tokens the cache holds (`past_len`) plus this call's."""
    batch, q_len = inputs_embeds.shape[:2]
    if (
        attention_mask is not None
        and attention_mask.dim() == 2
        and not torch.compiler.is_compiling()
        and attention_mask.shape != (batch, int(past_len) + q_len)
    ):
        raise ValueError(
            f"`attention_mask` must have shape (batch, past + new tokens) = {(batch, int(past_len) + q_len)}, "
            f"got {tuple(attention_mask.shape)}."
        )
    # The cache goes by position: transformers 5.17 (the declared floor) names this argument `past_key_values`, later
    # releases `cache`. Every LoopFormer cache slot holds the same tokens, so the first sizes the mask.
    return create_causal_mask(config, inputs_embeds, attention_mask, cache, position_ids)


def check_mask_and_positions(attention_mask, position_ids, batch, q_len, kv_len):
    """transformers' conventions: a 2-D mask (batch, past + new tokens) of 0/1 (its shape is checked with the
    cache's length), a 4-D mask (batch or 1, 1, q_len, kv_len) bool (True = may attend) or float (added to the
    scores); position_ids integer (batch or 1, q_len), >= 0. Anything else raises `ValueError` here instead of
    running with shifted positions, adding an int 0/1 mask as if additive, or failing deep in torch."""
    compiling = torch.compiler.is_compiling()  # value checks read the tensor (a graph break): skipped there
    if attention_mask is not None:
        if not torch.is_tensor(attention_mask) or attention_mask.dim() not in (2, 4):
            raise ValueError(
                f"`attention_mask` must be a 2-D (batch, tokens) 0/1 tensor or a 4-D (batch, 1, q_len, kv_len) "
                f"bool or float tensor, got {type(attention_mask).__name__} "
                f"{tuple(getattr(attention_mask, 'shape', ()))}."
            )
        if attention_mask.dim() == 4:
            if not (attention_mask.dtype == torch.bool or attention_mask.dtype.is_floating_point):
                raise ValueError(
                    f"A 4-D `attention_mask` must be bool (True = may attend) or float (added to the attention "
                    f"scores: 0 to attend, a large negative such as torch.finfo(dtype).min not to), got "
                    f"{attention_mask.dtype}: an integer 0/1 mask would be added to the scores, not masked. Pass "
                    f"`mask.bool()`."
                )
            if attention_mask.shape[0] not in (1, batch) or tuple(attention_mask.shape[1:]) != (1, q_len, kv_len):
                raise ValueError(
                    f"A 4-D `attention_mask` must have shape (batch={batch} or 1, 1, q_len={q_len}, "
                    f"kv_len={kv_len}), got {tuple(attention_mask.shape)}."
                )
        elif not compiling and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            other = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
            raise ValueError(
                f"A 2-D `attention_mask` must hold only 0 (padding) and 1 (a token), got "
                f"{other.unique()[:4].tolist()}: positions are counted from it. Pass a 4-D mask for anything else."
            )
    if position_ids is not None:
        if not (
            torch.is_tensor(position_ids)
            and not position_ids.dtype.is_floating_point
            and not position_ids.dtype.is_complex
            and position_ids.dtype != torch.bool
            and position_ids.dim() == 2
            and position_ids.shape[0] in (1, batch)
            and position_ids.shape[1] == q_len
        ):
            raise ValueError(
                f"`position_ids` must be an integer tensor of shape (batch={batch} or 1, new tokens={q_len}), "
                f"got {type(position_ids).__name__} {tuple(getattr(position_ids, 'shape', ()))} "
                f"{getattr(position_ids, 'dtype', '')}."
            )
        if not compiling and position_ids.numel() and int(position_ids.min()) < 0:
            raise ValueError(f"`position_ids` must be >= 0, got {int(position_ids.min())}.")


def default_position_ids(attention_mask, batch, q_len, past_len, device):
    """Positions counted from a 2-D mask (left padding), else past_len, past_len + 1, ..."""
    if attention_mask is not None and attention_mask.dim() == 2:
        positions = attention_mask.long().cumsum(-1) - 1
        return positions.clamp(min=0)[:, -q_len:]
    return (torch.arange(q_len, device=device) + past_len)[None].expand(batch, q_len)


def check_token_inputs(input_ids, inputs_embeds, vocab_size, hidden_size, dtype):
    """Exactly one of `input_ids` (integer ids in [0, vocab_size)) or `inputs_embeds` ((batch, seq, hidden_size) in
    the embeddings' `dtype`), each holding at least one token."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Give exactly one of `input_ids` or `inputs_embeds`.")
    given = input_ids if input_ids is not None else inputs_embeds
    if given.dim() < 2 or given.shape[0] == 0 or given.shape[1] == 0:
        name = "input_ids" if input_ids is not None else "inputs_embeds"
        raise ValueError(
            f"`{name}` must hold at least one sequence of at least one token, shape (batch >= 1, seq_len >= 1), "
            f"got shape {tuple(given.shape)}."
        )
    if input_ids is None:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size or inputs_embeds.dtype != dtype:
            raise ValueError(
                f"`inputs_embeds` must be a {dtype} tensor of shape (batch, seq_len, hidden_size={hidden_size}) (what "
                f"`get_input_embeddings()(input_ids)` gives), got {inputs_embeds.dtype} "
                f"{tuple(inputs_embeds.shape)}."
            )
        return
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"`input_ids` must be an integer tensor of token ids, got {input_ids.dtype}.")
    # checks read values (a graph break), so compiled graphs skip them
    if not torch.compiler.is_compiling() and input_ids.numel():
        low, high = (int(v) for v in torch.aminmax(input_ids))
        if low < 0 or high >= vocab_size:
            raise ValueError(f"`input_ids` must lie in [0, {vocab_size - 1}], got values in [{low}, {high}].")


__all__ = [
    "attention_mask_for",
    "call_inputs",
    "check_mask_and_positions",
    "check_token_inputs",
    "default_position_ids",
]
