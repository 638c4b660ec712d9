"""Tiny tokenizers, models and subprocess helpers shared by the shipping tests (publish, pipelines, PEFT, lm-eval,
distributed, compile). Everything is built here in a second; nothing is downloaded."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from support import REPO_ROOT


PYTHON = sys.executable

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "a loop runs the same blocks again and again to think longer",
    "to be or not to be that is the question",
    "one two three four five six seven eight nine ten",
    "the quick brown fox jumps over the lazy dog",
] * 4

# A prelude for fresh interpreters: the project's packages cannot be imported there, as on a machine where they are
# not installed (they are installed editable in the dev venv, so blocking them is the only way to prove it).
BLOCK_PACKAGES = "import sys\nsys.modules['loopformer_hf'] = None\nsys.modules['fprm_hf'] = None\n"


# Tolerance for float results computed in another process: thread counts and kernel choices differ between
# processes, so float sums round differently in the last bits; 1e-5 is far below what a wrong argument moves.
CROSS_PROCESS = dict(rtol=1e-5, atol=1e-5)


def make_tokenizer(vocab_size=300):
    """A byte-level BPE fast tokenizer trained on CORPUS, with <|endoftext|> as bos/eos/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def tiny_config(tokenizer=None, **overrides):
    """tiny_models' LoopFormer at d=32 with the tokenizer's vocabulary and end-of-text token."""
    from support.tiny_models import tiny_loopformer_config

    eos = tokenizer.eos_token_id if tokenizer is not None else None
    kwargs = dict(
        vocab_size=len(tokenizer) if tokenizer is not None else 300,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        frequency_embedding_size=16,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
    )
    return tiny_loopformer_config(**{**kwargs, **overrides})


def make_model(tokenizer=None, seed=0, **overrides):
    """A tiny LoopFormerForCausalLM whose adaLN layers are randomised with a large std (at init they are small or,
    with zero_adaln, zero, and then the loop budget would barely change anything a test looks at)."""
    from loopformer_hf import LoopFormerForCausalLM

    torch.manual_seed(seed)
    model = LoopFormerForCausalLM(tiny_config(tokenizer, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "adaLN_modulation" in name:
                param.normal_(0.0, 0.3)
    return model.eval()


def save_checkpoint(path, seed=0, **overrides):
    """Save a tiny model + tokenizer (+ generation config) the way a training run leaves a checkpoint."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed=seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def run_python(code, env=None, timeout=240, block_packages=True, cwd=None):
    """Run `code` in a fresh interpreter (the project's packages blocked by default); returns CompletedProcess and
    raises with its output when it fails."""
    full_env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
    full_env.update(env or {})
    prelude = BLOCK_PACKAGES if block_packages else ""
    proc = subprocess.run(
        [PYTHON, "-c", prelude + textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO_ROOT,
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
    return proc


def last_json_line(stdout):
    """The last line of a subprocess's stdout that parses as JSON."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    raise AssertionError(f"no JSON line in output:\n{stdout}")


def hf_env(tmp_path, endpoint=None, token=None):
    """Environment for a fresh process: an isolated HF cache (so remote code and files really come from the server)."""
    # conftest.py sets HF_HUB_OFFLINE=1 for the test session; these processes talk to the local test Hub.
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0"}
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    if token:
        env["HF_TOKEN"] = token
    return env


def make_fprm(seed=0, **overrides):
    """A tiny sequence FPRM (causal, state-tracking layout) with a low loop cap."""
    from support.tiny_models import sequence_fprm_config, tiny_fprm

    kwargs = dict(vocab_size=8, num_attention_heads=2, num_hidden_layers=1, max_loops=4)
    kwargs.update(overrides)
    return tiny_fprm(seed, config=sequence_fprm_config(**kwargs))


def fprm_task_rows(n=16, length=6, vocab=8, seed=0):
    """A toy task for FPRM: the label of each position is the running sum of the inputs mod `vocab`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, length), generator=g)
    y = x.cumsum(-1) % vocab
    return [{"input_ids": a.tolist(), "labels": b.tolist()} for a, b in zip(x, y)]
