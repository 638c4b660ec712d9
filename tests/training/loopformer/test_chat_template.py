"""A chat template path: `train --chat_template FILE` saves the template with the tokenizer, and
pipeline("text-generation") with chat messages then works on a checkpoint that carries one."""

import pytest
from transformers import AutoTokenizer, pipeline

from support.hub_helpers import save_checkpoint
from looped_training.loopformer import train as train_loopformer

from support.tiny_runs import TINY

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MESSAGES = [{"role": "user", "content": "1+2"}]


def test_train_saves_the_chat_template_with_the_tokenizer(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    out = tmp_path / "run"
    train_loopformer.main(
        ["--output_dir", str(out), "--variant", "loopformer", "--chat_template", str(template), *TINY]
    )
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == TEMPLATE
    assert (
        tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == "user: 1+2\nassistant: "
    )


def test_chat_pipeline_on_a_checkpoint_with_a_template(tmp_path):
    _, tokenizer = save_checkpoint(tmp_path, seed=0)
    train_loopformer.set_chat_template(tokenizer, TEMPLATE, "chat.jinja")
    tokenizer.save_pretrained(tmp_path)
    pipe = pipeline("text-generation", model=str(tmp_path))
    seen = []
    handle = pipe.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"]), with_kwargs=True)
    try:
        reply = pipe(MESSAGES, max_new_tokens=3, do_sample=False, loop_budget=2)[0]["generated_text"]
    finally:
        handle.remove()
    assert reply[:1] == MESSAGES and reply[-1]["role"] == "assistant" and isinstance(reply[-1]["content"], str)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert seen[0][0].tolist() == list(prompt)  # the model read the rendered conversation


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"--chat_template .*missing\.jinja.* is not a file"),
        ("{% for %}", r"--chat_template .*bad\.jinja.* does not render"),
    ],
)
def test_bad_chat_template_is_refused_before_training(tmp_path, content, message):
    path = tmp_path / ("missing.jinja" if content is None else "bad.jinja")
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        train_loopformer.main(["--output_dir", str(tmp_path / "run"), "--chat_template", str(path), *TINY])
    assert not (tmp_path / "run" / "model.safetensors").exists()
