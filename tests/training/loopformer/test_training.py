"""The training script, its data and tokenizer: variants by flag, the embedded corpus, a loadable output."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import loopformer_hf  # noqa: F401
from loopformer_hf import ShortcutConsistency
from looped_training.loopformer import train as train_loopformer
from looped_training.loopformer.data import synthetic
from looped_training.loopformer.data.tokenizer import train_bpe_tokenizer

TINY = [
    "--hidden_size",
    "32",
    "--num_attention_heads",
    "2",
    "--num_loops",
    "4",
    "--num_blocks",
    "1",
    "--num_train_problems",
    "256",
    "--num_eval_problems",
    "32",
    "--max_depth",
    "3",
    "--per_device_train_batch_size",
    "8",
    "--use_cpu",
    "--report_to",
    "none",
    "--disable_tqdm",
    "true",
    "--logging_steps",
    "1",
    "--learning_rate",
    "1e-3",
    "--seed",
    "0",
]


def tiny_run(output_dir, *extra):
    return train_loopformer.main(["--output_dir", str(output_dir), *TINY, *extra])


# ---- data ----------------------------------------------------------------------------------------------------------


def _evaluate_chain(prompt):
    expr = prompt[:-1]  # drop "="
    value = int(expr[0])
    for op, operand in zip(expr[1::2], expr[2::2]):
        value = (value + int(operand)) % 10 if op == "+" else (value * int(operand)) % 10
    return value


def test_arithmetic_answers_follow_left_to_right_evaluation_and_depth_counts_operations():
    problems = synthetic.make_problems(300, 1, 6, seed=1)
    for p in problems:
        assert p.prompt.endswith("=") and p.text == p.prompt + p.answer + "\n"
        assert int(p.answer) == _evaluate_chain(p.prompt)
        assert (len(p.prompt) - 2) // 2 == p.depth
    assert {p.depth for p in problems} == set(range(1, 7))


def _resolve_binding(prompt):
    statements = dict(s.split("=") for s in prompt.split(";")[:-1])
    var, hops = prompt.split("?")[1][:-1], 0
    while not var.isdigit():
        var, hops = statements[var], hops + 1
    return var, hops


def test_binding_answers_need_exactly_depth_hops():
    for p in synthetic.make_problems(200, 1, 5, seed=2, kind="binding"):
        answer, hops = _resolve_binding(p.prompt)
        assert answer == p.answer and hops == p.depth


def test_problems_are_reproducible_from_the_seed():
    a = synthetic.make_problems(50, seed=7)
    assert a == synthetic.make_problems(50, seed=7)
    assert a != synthetic.make_problems(50, seed=8)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"min_depth": 0}, "min_depth"),
        ({"min_depth": 5, "max_depth": 2}, "<= `max_depth`"),
        ({"kind": "sudoku"}, "'sudoku'"),
        ({"kind": "binding", "max_depth": 20}, "num_chains \\* max_depth"),
    ],
)
def test_bad_corpus_arguments_raise_value_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        synthetic.make_problems(10, **kwargs)


def test_answer_only_labels_cover_answer_and_newline():
    problems = synthetic.make_problems(20, 1, 4, seed=3)
    tok = train_bpe_tokenizer([p.text for p in synthetic.make_problems(500, 1, 4)], 300)
    rows = synthetic.tokenize_problems(problems, tok, 16)
    for p, ids, labels in zip(problems, rows["input_ids"], rows["labels"]):
        kept = [i for i in labels if i != -100]
        assert tok.decode(kept) == p.answer + "\n"
    with pytest.raises(ValueError, match="block_size=4"):
        synthetic.tokenize_problems(problems, tok, 4)
    assert synthetic.tokenize_problems([], tok, 16) == {
        "input_ids": [],
        "attention_mask": [],
        "labels": [],
        "depth": [],
    }


def test_tokenizer_round_trips_and_saves_as_fast_tokenizer(tmp_path):
    texts = ["To be, or not to be: that is the question.", "7+3*3+5=5\n"] * 20
    tok = train_bpe_tokenizer(texts, 300)
    assert isinstance(tok, PreTrainedTokenizerFast) and tok.eos_token == "<|endoftext|>"
    sample = "Whether 'tis nobler in the mind — ünïcode ok\n"
    assert tok.decode(tok(sample)["input_ids"]) == sample
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(sample)["input_ids"] == tok(sample)["input_ids"]
    with pytest.raises(ValueError, match="got 100"):
        train_bpe_tokenizer(texts, 100)


# ---- variants ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, conditioning, layers, loops, callback",
    [
        ("loopformer", "shortcut", 2, 3, "shortcut"),
        ("base_loop", "none", 2, 3, None),
        ("tmlt", "timestep", 2, 3, None),
        ("naive_loop_ee", "none", 2, 3, "early_exit"),
        ("tmlt_ee", "timestep", 2, 3, "early_exit"),
        ("base", "none", 6, 1, None),
    ],
)
def test_variants_are_configurations_of_one_model(variant, conditioning, layers, loops, callback):
    model_args = train_loopformer.ModelArguments(variant=variant, hidden_size=32, num_blocks=2, num_loops=3)
    config = train_loopformer.build_config(model_args, vocab_size=300, block_size=32)
    assert (config.loop_conditioning, config.num_hidden_layers, config.num_loops) == (conditioning, layers, loops)
    assert config.num_hidden_layers * config.num_loops == 6  # iso-FLOP: same block applications at M = L
    # as the authors' models/*.py: learnable block-norm weights in base_loop.py (Base-Loop, Naive-Loop-EE), base.py
    assert config.block_norm_weight == (variant in ("base_loop", "naive_loop_ee", "base"))
    assert config.initializer_scheme == "reference"
    cb = train_loopformer.build_callback(
        model_args, train_loopformer.ShortcutArguments(), train_loopformer.TrainingArguments(output_dir="unused")
    )
    assert (cb.trajectory if cb else None) == callback
    if cb is not None:  # their train.py: CE_full + 0.1·CE_short + 0.1·MSE for LoopFormer and the -EE baselines
        assert (cb.lambda_short, cb.lambda_consistency, cb.consistency) == (0.1, 0.1, "mse")


def test_early_exit_variants_draw_an_integer_loop_count_in_1_to_L_minus_1():
    model_args = train_loopformer.ModelArguments(variant="tmlt_ee", hidden_size=32, num_loops=5)
    cb = train_loopformer.build_callback(
        model_args, train_loopformer.ShortcutArguments(), train_loopformer.TrainingArguments(output_dir="unused")
    )
    lengths = set()
    for index in range(200):
        steps = cb.sample_trajectory(index, 5, cb.trajectory)
        assert steps == tuple([1 / len(steps)] * len(steps))  # uniform: the model sees only the count
        lengths.add(len(steps))
    assert lengths == {1, 2, 3, 4}


@pytest.mark.parametrize("variant", ["tmlt_ee", "naive_loop_ee"])
def test_early_exit_objective_is_the_reference_train_py(variant):
    """The -EE loss the callback asks for equals their train.py: CE(M=L) + 0.1·CE(M=S) + 0.1·MSE(stopgrad(x_L), x_S),
    S an integer loop count and x the final-norm output, computed here from plain forwards."""
    import torch.nn.functional as F

    model_args = train_loopformer.ModelArguments(variant=variant, hidden_size=32, num_blocks=2, num_loops=4)
    config = train_loopformer.build_config(model_args, vocab_size=97, block_size=32)
    cb = train_loopformer.build_callback(
        model_args, train_loopformer.ShortcutArguments(), train_loopformer.TrainingArguments(output_dir="unused")
    )
    torch.manual_seed(0)
    model = loopformer_hf.LoopFormerForCausalLM(config).train()
    with torch.no_grad():  # large weights, so that 2 and 4 loops end far apart and the MSE term weighs
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    ids = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))
    index = next(i for i in range(100) if len(cb.sample_trajectory(i, 4, cb.trajectory)) == 2)
    short = list(cb.sample_trajectory(index, 4, cb.trajectory))
    lambda_short, lambda_consistency = cb.lambdas(0)
    out = model(
        input_ids=ids,
        labels=ids,
        shortcut_consistency=ShortcutConsistency(short, lambda_short, lambda_consistency, cb.consistency),
    )
    with torch.no_grad():

        def ce_and_x(loops):
            h = model.model(input_ids=ids, loop_budget=loops).last_hidden_state
            logits = model.lm_head(h)
            return F.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1)), h

        (ce_full, x_full), (ce_short, x_short) = ce_and_x(4), ce_and_x(2)
        theirs = ce_full + 0.1 * ce_short + 0.1 * F.mse_loss(x_full, x_short)
    assert 0.1 * F.mse_loss(x_full, x_short) > 1e-2  # guards the test: the MSE term matters at this tolerance
    torch.testing.assert_close(out.loss.detach(), theirs, rtol=1e-5, atol=1e-6)


def test_initializer_scheme_reaches_the_config():
    model_args = train_loopformer.ModelArguments(variant="loopformer", hidden_size=32, initializer_scheme="zero_adaln")
    assert train_loopformer.build_config(model_args, vocab_size=300, block_size=32).initializer_scheme == "zero_adaln"


def test_unknown_variant_and_task_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="'loopy'"):
        tiny_run(tmp_path, "--variant", "loopy")
    with pytest.raises(ValueError, match="'images'"):
        tiny_run(tmp_path, "--task", "images")


def test_training_writes_a_checkpoint_auto_classes_load(tmp_path):
    trainer = tiny_run(tmp_path / "run", "--max_steps", "3", "--save_strategy", "no")
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all("ce_short" in h for h in logs)
    out = tmp_path / "run"
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LoopFormerForCausalLM" and model.config.loop_conditioning == "shortcut"
    meta = json.loads((out / train_loopformer.TRAINING_META_FILE).read_text())
    assert meta["variant"] == "loopformer" and meta["data"]["max_depth"] == 3
    torch.testing.assert_close(model.lm_head.weight, trainer.model.lm_head.weight)
    enc = tok("3+4*7=", return_tensors="pt")
    out_ids = model.generate(**enc, max_new_tokens=2, do_sample=False, loop_budget=2, pad_token_id=tok.pad_token_id)
    assert out_ids.shape[1] == enc["input_ids"].shape[1] + 2
