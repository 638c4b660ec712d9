"""The authors' published checkpoints (armenjeddi/LoopFormer-*, Base-Loop-*) load into our classes, exactly.

Stand-in repos are written here in their Hub layout, as their GitHub `GPT.from_pretrained` reads it: config.json
with their model type and nanoGPT keys (or the GPT-2 aliases their loader also accepts) and `steps`, weights named
as their `GPT`'s state dict under a wrapper prefix, the tied head stored once as `transformer.wte.weight`, their
generation_config.json and a tokenizer. Random weights; every logit is checked against the independent oracle of
tests/reference_oracle.py, never against our own modules.
"""

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, pipeline

import loopformer_hf  # noqa: F401  (registers the Auto classes, theirs included)
from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM, LoopFormerModel

from _hub_helpers import REPO_ROOT, make_tokenizer
from reference_oracle import (ARCHITECTURE, BLOCK, N_EMBD, N_HEAD, N_LAYER, N_LOOPS, VOCAB, reference_forward,
                              write_authors_repo)

FULL = [1 / N_LOOPS] * N_LOOPS
SHORT = [0.5, 0.25, 0.25]  # M=3, a shortcut trajectory
SHORTEST = [0.5, 0.5]  # M=2
def trajectories(model_type):
    """M = L and two shorter trajectories (shortcuts for LoopFormer; loop counts for the others)."""
    if model_type == "loopformer":
        return [FULL, SHORT, SHORTEST]
    return [[1 / m] * m for m in (N_LOOPS, 3, 2)]


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


def assert_matches_oracle(model, sd, ids, model_type, atol=1e-4):
    with torch.no_grad():
        for trajectory in trajectories(model_type):
            expected = reference_forward(sd, ids, trajectory, model_type=ARCHITECTURE[model_type])
            got = model(ids, step_schedule=trajectory, use_cache=False).logits.float()
            torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=f"{model_type} at {trajectory}")
        default = model(ids, use_cache=False).logits.float()  # the repo's own default: M = L
        expected = reference_forward(sd, ids, trajectories(model_type)[0], model_type=ARCHITECTURE[model_type])
        torch.testing.assert_close(default, expected, atol=atol, rtol=0)


# ---- 1. load, exactly --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,prefix", [("loopformer", "gpt."), ("base_loop", "model."),
                                               ("base_loop_ee", "module."), ("tmlt", "gpt.model.")])
def test_auto_and_class_load_match_the_oracle(tmp_path, ids, model_type, prefix):
    sd = write_authors_repo(tmp_path / "repo", model_type=model_type, prefix=prefix)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    assert type(model) is LoopFormerForCausalLM and not model.training
    assert model.config.num_hidden_layers == N_LAYER and model.config.num_loops == N_LOOPS
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # the tie restored
    assert_matches_oracle(model, sd, ids, model_type)
    assert_matches_oracle(LoopFormerForCausalLM.from_pretrained(tmp_path / "repo"), sd, ids, model_type)


def test_config_translation(tmp_path):
    write_authors_repo(tmp_path / "lf", steps=[1 / 8] * 8)
    config = LoopFormerConfig.from_pretrained(tmp_path / "lf")
    assert (config.num_hidden_layers, config.num_loops, config.loop_conditioning) == (N_LAYER, 8, "shortcut")
    assert (config.hidden_size, config.num_attention_heads, config.intermediate_size) == (N_EMBD, N_HEAD, 4 * N_EMBD)
    assert (config.max_position_embeddings, config.vocab_size, config.default_step_schedule) == (BLOCK, VOCAB, "uniform")
    assert config.position_embedding_type == "learned" and config.hidden_act == "gelu" and config.rms_norm_eps is None
    write_authors_repo(tmp_path / "bl", model_type="base_loop_ee", steps=[1 / 6] * 6)
    config = LoopFormerConfig.from_pretrained(tmp_path / "bl")
    assert (config.num_loops, config.loop_conditioning, config.block_norm_weight) == (6, "none", True)
    assert type(config) is LoopFormerConfig  # our own model type when saved, whatever theirs was


def test_gpt2_alias_keys_biases_and_a_non_uniform_default_trajectory(tmp_path, ids):
    sd = write_authors_repo(tmp_path / "repo", aliases=True, bias=True, steps=SHORT)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    assert model.config.attention_bias and model.config.mlp_bias and model.config.num_loops == 3
    with torch.no_grad():  # no schedule given: the repo's own `steps`
        torch.testing.assert_close(model(ids).logits, reference_forward(sd, ids, SHORT), atol=1e-4, rtol=0)


def test_bf16_stays_bf16_unless_dtype_says_otherwise(tmp_path, ids):
    sd = write_authors_repo(tmp_path / "repo", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    assert model.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.bfloat16, name
    fp32 = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", dtype=torch.float32)
    assert fp32.dtype == torch.float32
    # fp32 compute on the bf16-stored weights is the oracle's computation on the same (bf16-valued) tensors
    assert_matches_oracle(fp32, {k: v.float() for k, v in sd.items()}, ids, "loopformer")


def test_the_base_model_and_config_overrides(tmp_path, ids):
    sd = write_authors_repo(tmp_path / "repo")
    base = LoopFormerModel.from_pretrained(tmp_path / "repo")
    assert type(base) is LoopFormerModel
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", default_loop_budget=2)
    with torch.no_grad():  # a config field given to from_pretrained is set, as transformers does
        torch.testing.assert_close(model(ids).logits, reference_forward(sd, ids, SHORTEST), atol=1e-4, rtol=0)


# ---- 2. never silently random ------------------------------------------------------------------------------------


def test_a_tensor_no_mapping_knows_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo", extra={"gpt.transformer.h.blocks.0.attn.rotary.weight": torch.ones(4)})
    with pytest.raises(ValueError, match=r"unknown keys.*transformer\.h\.blocks\.0\.attn\.rotary\.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_a_tensor_the_model_needs_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo", drop=("transformer.h.blocks.1.mlp.c_fc.weight",))
    with pytest.raises(ValueError, match=r"missing keys.*model\.layers\.1\.mlp\.up_proj\.weight"):
        LoopFormerForCausalLM.from_pretrained(tmp_path / "repo")


def test_a_shape_the_config_does_not_give_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo")
    config = json.loads((tmp_path / "repo" / "config.json").read_text())
    (tmp_path / "repo" / "config.json").write_text(json.dumps(dict(config, n_layer=N_LAYER + 1)))
    with pytest.raises(ValueError, match=r"missing keys.*model\.layers\.2\."):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_a_config_neither_ours_nor_theirs_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo")
    (tmp_path / "repo" / "config.json").write_text(json.dumps({"model_type": "base_loop", "width": 64}))
    with pytest.raises(ValueError, match=r"neither this package's layout.*nor the authors'.*n_embd / hidden_size.*"
                                         r"'width'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_a_loading_option_we_do_not_know_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo")
    with pytest.raises(ValueError, match=r"neither config fields nor loading options: \['quantum_mode'\]"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo", quantum_mode=True)


def test_trust_remote_code_does_not_replace_the_registered_classes(tmp_path, ids):
    """With `import loopformer_hf` transformers uses the registered (local) classes even when the repo carries
    remote code and `trust_remote_code=True`; the authors' code runs in a process that does not import us."""
    sd = write_authors_repo(tmp_path / "repo")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", trust_remote_code=True)
    assert type(model) is LoopFormerForCausalLM
    assert_matches_oracle(model, sd, ids, "loopformer")


# ---- 3. everything works on them ---------------------------------------------------------------------------------


def oracle_greedy(sd, prompt, steps, new_tokens):
    ids = prompt.clone()
    for _ in range(new_tokens):
        nxt = reference_forward(sd, ids, steps)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.fixture(scope="module")
def repo_with_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("authors") / "LoopFormer-2block-4iterations"
    tokenizer = make_tokenizer()
    sd = write_authors_repo(folder, tokenizer=tokenizer, dtype=torch.float32)
    return folder, sd, tokenizer


def test_generate_with_loop_budget_schedule_and_halting(repo_with_tokenizer):
    folder, sd, _ = repo_with_tokenizer
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = torch.randint(0, len(sd["transformer.wte.weight"]), (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for kwargs, steps in (({"loop_budget": 2}, SHORTEST), ({"step_schedule": SHORT}, SHORT), ({}, FULL)):
            out = model.generate(prompt, max_new_tokens=5, pad_token_id=0, **kwargs)  # greedy by default
            assert torch.equal(out, oracle_greedy(sd, prompt, steps, 5)), kwargs
        halted = model.generate(prompt, max_new_tokens=5, halt_eps=0.5, pad_token_id=0, return_dict_in_generate=True)
    assert halted.loop_counts.max() <= N_LOOPS and halted.sequences.shape == (1, 11)


def test_pipeline_with_the_repos_own_tokenizer_decodes_greedily(repo_with_tokenizer):
    folder, sd, tokenizer = repo_with_tokenizer
    generator = pipeline("text-generation", model=str(folder))
    assert type(generator.model) is LoopFormerForCausalLM
    prompt = "the cat sat on"
    text = generator(prompt, max_new_tokens=4)[0]["generated_text"]
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    assert text == tokenizer.decode(oracle_greedy(sd, ids, FULL, 4)[0])


def test_peft_lora_on_an_authors_repo(repo_with_tokenizer, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    folder, sd, _ = repo_with_tokenizer
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    ids = torch.randint(0, 50, (2, 10))
    loss = model(ids, labels=ids, loop_budget=2).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None for g in grads)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
        adapted = model(ids, loop_budget=2).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, loop_budget=2).logits, adapted)
        assert (adapted - reference_forward(sd, ids, SHORTEST)).abs().max() > 1e-3  # the adapter changes them


def test_save_pretrained_into_our_format_and_back(repo_with_tokenizer, tmp_path, ids):
    folder, sd, _ = repo_with_tokenizer
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == "loopformer" and saved["num_loops"] == N_LOOPS and "n_embd" not in saved
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert again.generation_config.do_sample is False


def test_lm_eval_through_our_route(repo_with_tokenizer, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is an optional extra (pip install 'lm-eval==0.4.13')")
    from test_lm_eval import TASK_YAML

    folder, sd, tokenizer = repo_with_tokenizer
    docs = [{"context": "the cat sat on the", "continuation": " mat"}, {"context": "to be or not", "continuation": " to"}]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "data.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tasks / "tiny_loglik.yaml").write_text(TASK_YAML.format(data=tasks / "data.jsonl"))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "looped_training.loopformer.lm_eval", "--model", "loopformer", "--model_args",
         f"pretrained={folder},loop_budget=2", "--tasks", "tiny_loglik", "--include_path", str(tasks), "--device",
         "cpu", "--batch_size", "2", "--output_path", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
             "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    got = json.loads(Path(path).read_text())["results"]["tiny_loglik"]["perplexity,none"]
    total = 0.0
    for doc in docs:
        ctx = tokenizer(doc["context"])["input_ids"]
        whole = tokenizer(doc["context"] + doc["continuation"])["input_ids"]
        logits = reference_forward(sd, torch.tensor([whole[:-1]]), SHORTEST)[0, len(ctx) - 1:]
        total += float(torch.log_softmax(logits, -1)[torch.arange(len(whole) - len(ctx)),
                                                     torch.tensor(whole[len(ctx):])].sum())
    assert got == pytest.approx(math.exp(-total / len(docs)), rel=1e-4)


# ---- 4. convert from the Hub ---------------------------------------------------------------------------------------


HUB_REPO, HUB_TOKEN = "armenjeddi/LoopFormer-2block-4iterations", "hf_test_write_token"


def _convert(env, *args):
    return subprocess.run([sys.executable, "-m", "loopformer_hf.convert_reference", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_convert_from_the_hub_online_then_offline_from_the_cache(repo_with_tokenizer, tmp_path, ids):
    import huggingface_hub.constants
    from huggingface_hub import HfApi
    from hub_server import HubServer

    folder, sd, _ = repo_with_tokenizer
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_XET": "1"}
    with pytest.MonkeyPatch.context() as patch, HubServer(tokens={HUB_TOKEN}) as hub:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        api = HfApi(endpoint=hub.endpoint, token=HUB_TOKEN)
        api.create_repo(HUB_REPO)
        api.upload_folder(folder_path=str(folder), repo_id=HUB_REPO)
        online = dict(env, HF_ENDPOINT=hub.endpoint, HF_HUB_OFFLINE="0")
        proc = _convert(online, "--hub_repo", HUB_REPO, "--revision", "main", "--output_dir", str(tmp_path / "a"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        missing = _convert(online, "--hub_repo", "armenjeddi/No-Such-Repo", "--output_dir", str(tmp_path / "x"))
    # the server is gone: offline mode reads the cache the first download filled
    proc = _convert(dict(env, HF_HUB_OFFLINE="1"), "--hub_repo", HUB_REPO, "--output_dir", str(tmp_path / "b"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert missing.returncode == 2 and "No-Such-Repo" in missing.stderr and "Traceback" not in missing.stderr
    for out in ("a", "b"):
        config = json.loads((tmp_path / out / "config.json").read_text())
        assert config["model_type"] == "loopformer" and config["num_loops"] == N_LOOPS
        assert (tmp_path / out / "tokenizer.json").is_file()
        model = AutoModelForCausalLM.from_pretrained(tmp_path / out)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, reference_forward(sd, ids, FULL), atol=1e-4, rtol=0)


def test_our_weights_under_a_config_stripped_of_our_fields_are_named(tmp_path):
    """Our own folder whose config.json lost num_loops and loop_conditioning looks like theirs; the weights say not."""
    model = AutoModelForCausalLM.from_pretrained(write_authors_repo(tmp_path / "repo") and tmp_path / "repo")
    model.save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    del config["num_loops"], config["loop_conditioning"]
    (tmp_path / "ours" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"none of this package's fields \(num_loops, loop_conditioning\).*"
                                         r"weights are in this package's layout"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "ours")


def test_their_weights_under_our_config_are_named(tmp_path):
    """The converse: their weights under a config.json of ours would load at random (transformers only warns)."""
    write_authors_repo(tmp_path / "repo")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    model.config.save_pretrained(tmp_path / "repo")  # our config.json over their model.safetensors
    with pytest.raises(ValueError, match=r"config\.json is in this package's layout.*weights are named as the "
                                         r"authors' GPT.*gpt\.dt_embedder"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_loop_knobs_written_into_their_generation_config_count(tmp_path, ids):
    sd = write_authors_repo(tmp_path / "repo")
    path = tmp_path / "repo" / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "loop_budget": 2}))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    assert model.generation_config.loop_budget == 2 and model.generation_config.do_sample is False
    prompt = ids[:1, :6]
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, max_new_tokens=3, pad_token_id=0),
                           oracle_greedy(sd, prompt, SHORTEST, 3))
    path.write_text(json.dumps({"_from_model_config": True, "loop_budget": 0}))
    with pytest.raises(ValueError, match=r"generation_config\.json sets a loop knob.*`loop_budget` must be"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
