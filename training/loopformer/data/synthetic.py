"""Embedded default corpus: latent-reasoning problems generated here (no network, no files).

Two kinds, each of controllable depth, the answer after the marker ``=`` and closed by a newline:

- ``arithmetic`` (default): a chain of operations mod 10 applied left to right::

      7+3*3+1=1        ((7 + 3) * 3 + 1) mod 10 = 1, depth 3

  Operations are ``+1``, ``+3``, ``*3``, ``*7`` (all invertible mod 10, so no step loses information; four
  operations keep each update a small look-up a tiny model learns quickly).
  Addition and multiplication do not commute, so the value after step i needs the value after step i-1: a
  depth-d answer takes d sequential updates, which a looped model can do one (or a few) per loop step. Every
  character is its own token under the byte-level BPE (digits and operators are separate pre-tokens).
- ``binding``: multi-hop variable binding with a distractor chain, statements shuffled::

      k=m;q=4;m=q;z=7;w=z;?k=4       (k → m → q → 4, depth 3)

The loop budget visibly matters: shallow problems are solved with few loop steps, deep ones need more.
"""

import random
import string
from dataclasses import dataclass

QUERY_MARKER = "?"
ANSWER_MARKER = "="
END_OF_ANSWER = "\n"
VARIABLES = string.ascii_lowercase
VALUES = string.digits


KINDS = ("arithmetic", "binding")
ADD_OPERANDS = "13"
MUL_OPERANDS = "37"


@dataclass(frozen=True)
class Problem:
    prompt: str  # everything up to and including the answer marker
    answer: str  # the text the model must produce next (without the final newline)
    depth: int

    @property
    def text(self):
        return self.prompt + self.answer + END_OF_ANSWER


def _check_depths(min_depth, max_depth, num_chains):
    for name, value in (("min_depth", min_depth), ("max_depth", max_depth), ("num_chains", num_chains)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    if min_depth > max_depth:
        raise ValueError(f"`min_depth` ({min_depth}) must be <= `max_depth` ({max_depth}).")
    if num_chains * max_depth > len(VARIABLES):
        raise ValueError(
            f"num_chains * max_depth = {num_chains} * {max_depth} needs more than the {len(VARIABLES)} variable "
            f"names a-z; allowed: num_chains * max_depth <= {len(VARIABLES)}."
        )


def make_problem(rng, depth, num_chains=2):  # kind "binding"
    """One problem whose answer needs `depth` hops; `num_chains - 1` distractor chains of the same depth."""
    names = rng.sample(VARIABLES, num_chains * depth)
    statements, target = [], None
    for c in range(num_chains):
        chain = names[c * depth : (c + 1) * depth]
        value = rng.choice(VALUES)
        statements.append(f"{chain[0]}={value};")
        statements += [f"{chain[i]}={chain[i - 1]};" for i in range(1, depth)]
        if c == 0:
            target = (chain[-1], value)
    rng.shuffle(statements)
    prompt = "".join(statements) + f"{QUERY_MARKER}{target[0]}{ANSWER_MARKER}"
    return Problem(prompt=prompt, answer=target[1], depth=depth)


def make_arithmetic_problem(rng, depth):
    """One chain of `depth` operations mod 10, applied left to right."""
    value = rng.randint(0, 9)
    text = str(value)
    for _ in range(depth):
        if rng.random() < 0.5:
            a = rng.choice(ADD_OPERANDS)
            value = (value + int(a)) % 10
            text += "+" + a
        else:
            b = rng.choice(MUL_OPERANDS)
            value = (value * int(b)) % 10
            text += "*" + b
    return Problem(prompt=text + ANSWER_MARKER, answer=str(value), depth=depth)


def make_problems(num_problems, min_depth=1, max_depth=4, num_chains=2, seed=0, kind="arithmetic"):
    """`num_problems` problems of `kind` with depths uniform in [min_depth, max_depth], reproducible from `seed`."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}.")
    _check_depths(min_depth, max_depth, num_chains if kind == "binding" else 1)
    if not isinstance(num_problems, int) or isinstance(num_problems, bool) or num_problems < 0:
        raise ValueError(f"`num_problems` must be a non-negative integer, got {num_problems!r}.")
    rng = random.Random(f"{kind}:{seed}")
    if kind == "arithmetic":
        return [make_arithmetic_problem(rng, rng.randint(min_depth, max_depth)) for _ in range(num_problems)]
    return [make_problem(rng, rng.randint(min_depth, max_depth), num_chains) for _ in range(num_problems)]


def tokenize_problems(problems, tokenizer, block_size, answer_only_loss=True):
    """input_ids / attention_mask / labels rows, right-padded to `block_size`.

    With `answer_only_loss`, labels keep only the answer tokens and the newline that ends them (-100 elsewhere):
    the statements are random, so their tokens carry no learnable signal and would only add noise.
    """
    pad_id = tokenizer.pad_token_id
    rows = {"input_ids": [], "attention_mask": [], "labels": [], "depth": []}
    if not problems:  # a tokenizer call on an empty batch raises
        return rows
    # one batched call per side: a call per problem spent ~10 s of a run's start-up on 100k problems
    prompts = tokenizer([p.prompt for p in problems], add_special_tokens=False)["input_ids"]
    answers = tokenizer([p.answer + END_OF_ANSWER for p in problems], add_special_tokens=False)["input_ids"]
    for p, prompt_ids, answer_ids in zip(problems, prompts, answers):
        ids = prompt_ids + answer_ids
        if len(ids) > block_size:
            raise ValueError(
                f"A problem of depth {p.depth} takes {len(ids)} tokens, more than block_size={block_size}; "
                f"raise block_size or lower max_depth."
            )
        labels = ([-100] * len(prompt_ids) + answer_ids) if answer_only_loss else list(ids)
        pad = block_size - len(ids)
        rows["input_ids"].append(ids + [pad_id] * pad)
        rows["attention_mask"].append([1] * len(ids) + [0] * pad)
        rows["labels"].append(labels + [-100] * pad)
        rows["depth"].append(p.depth)
    return rows
