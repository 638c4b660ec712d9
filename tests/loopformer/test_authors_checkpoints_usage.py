"""The authors' checkpoints, once loaded, work as any model of ours: generate (loop budget, schedule, halting), a
pipeline with the repo's own tokenizer, PEFT, `save_pretrained`, lm-eval; `python -m loopformer_hf.convert_authors
--hub_repo` converts them from the Hub; and what does not fill their model is refused, never initialised at random.
Stand-in repos in their Hub layout with random weights, checked against the independent oracle of
tests/support/reference_oracle.py (tests/loopformer/test_authors_checkpoints.py holds the loading itself).
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
from loopformer_hf import LoopFormerForCausalLM

from support.hub_helpers import REPO_ROOT, make_tokenizer
from support.reference_oracle import (
    N_EMBD,
    N_HEAD,
    N_LAYER,
    N_LOOPS,
    VOCAB,
    reference_forward,
    write_authors_repo,
)

FULL = [1 / N_LOOPS] * N_LOOPS
SHORT = [0.5, 0.25, 0.25]  # M=3, a shortcut trajectory
SHORTEST = [0.5, 0.5]  # M=2


CODE = {"n_head": str(N_HEAD), "n_embd": str(N_EMBD), "steps": f"[1/{N_LOOPS}]*{N_LOOPS}", "dropout": "0.0"}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


# ---- never silently random -----------------------------------------------------------------------------------------


def test_a_tensor_no_mapping_knows_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo", extra={"gpt.transformer.h.blocks.0.attn.rotary.weight": torch.ones(4)})
    with pytest.raises(ValueError, match=r"unknown keys.*'gpt\.transformer\.h\.blocks\.0\.attn\.rotary\.weight'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_a_tensor_the_model_needs_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo", drop=("transformer.h.blocks.1.mlp.c_fc.weight",))
    with pytest.raises(ValueError, match=r"missing keys.*model\.layers\.1\.mlp\.up_proj\.weight"):
        LoopFormerForCausalLM.from_pretrained(tmp_path / "repo")


@pytest.mark.parametrize(
    "key,value,evidence",
    [
        ("n_layer", N_LAYER + 1, r"they hold transformer\.h\.blocks\.\{0, 1\}"),
        ("n_embd", 2 * N_EMBD, r"transformer\.wte\.weight has shape \(97, 64\)"),
        ("intermediate_dim", 5120, r"transformer\.h\.blocks\.0\.mlp\.c_fc\.weight has shape \(256, 64\)"),
    ],
)
def test_a_size_config_json_states_against_the_weights_is_named(tmp_path, key, value, evidence):
    write_authors_repo(tmp_path / "repo")
    config = json.loads((tmp_path / "repo" / "config.json").read_text())
    (tmp_path / "repo" / "config.json").write_text(json.dumps(dict(config, **{key: value})))
    with pytest.raises(ValueError, match=rf"`{key}`: config\.json says {value}, but the weights say .*{evidence}"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_a_model_type_the_weights_contradict_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo")  # LoopFormer's weights (t and Δ embedders)
    (tmp_path / "repo" / "config.json").write_text(json.dumps({"model_type": "base_loop", "width": 64}))
    with pytest.raises(
        ValueError,
        match=r"model_type 'base_loop', but the weights hold a 'loopformer' model.*"
        r"dt_embedder",
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_a_loading_option_we_do_not_know_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo")
    with pytest.raises(ValueError, match=r"neither config fields nor loading options: \['quantum_mode'\]"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo", quantum_mode=True)


# ---- everything works on them -------------------------------------------------------------------------------------


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
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
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
    from support.tiny_data import LM_EVAL_TASK_YAML as TASK_YAML

    folder, sd, tokenizer = repo_with_tokenizer
    docs = [
        {"context": "the cat sat on the", "continuation": " mat"},
        {"context": "to be or not", "continuation": " to"},
    ]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "data.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tasks / "tiny_loglik.yaml").write_text(TASK_YAML.format(data=tasks / "data.jsonl"))
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "looped_training.loopformer.lm_eval",
            "--model",
            "loopformer",
            "--model_args",
            f"pretrained={folder},loop_budget=2",
            "--tasks",
            "tiny_loglik",
            "--include_path",
            str(tasks),
            "--device",
            "cpu",
            "--batch_size",
            "2",
            "--output_path",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf_home"),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        },
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    got = json.loads(Path(path).read_text())["results"]["tiny_loglik"]["perplexity,none"]
    total = 0.0
    for doc in docs:
        ctx = tokenizer(doc["context"])["input_ids"]
        whole = tokenizer(doc["context"] + doc["continuation"])["input_ids"]
        logits = reference_forward(sd, torch.tensor([whole[:-1]]), SHORTEST)[0, len(ctx) - 1 :]
        total += float(
            torch.log_softmax(logits, -1)[torch.arange(len(whole) - len(ctx)), torch.tensor(whole[len(ctx) :])].sum()
        )
    assert got == pytest.approx(math.exp(-total / len(docs)), rel=1e-4)


# ---- convert from the Hub -----------------------------------------------------------------------------------------


HUB_REPO, HUB_TOKEN = "armenjeddi/LoopFormer-2block-4iterations", "hf_test_write_token"


def _convert(env, *args):
    return subprocess.run(
        [sys.executable, "-m", "loopformer_hf.convert_authors", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_convert_from_the_hub_online_then_offline_from_the_cache(repo_with_tokenizer, tmp_path, ids):
    import huggingface_hub.constants
    from huggingface_hub import HfApi
    from support.hub_server import HubServer

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
    with pytest.raises(
        ValueError,
        match=r"none of this package's fields \(num_loops, loop_conditioning\).*"
        r"weights are in this package's layout",
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path / "ours")


def test_their_weights_under_our_config_are_named(tmp_path):
    """The converse: their weights under a config.json of ours would load at random (transformers only warns)."""
    write_authors_repo(tmp_path / "repo")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    model.config.save_pretrained(tmp_path / "repo")  # our config.json over their model.safetensors
    with pytest.raises(
        ValueError,
        match=r"config\.json is in this package's layout.*weights are named as the "
        r"authors' GPT.*gpt\.dt_embedder",
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_loop_knobs_written_into_their_generation_config_count(tmp_path, ids):
    sd = write_authors_repo(tmp_path / "repo")
    path = tmp_path / "repo" / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "loop_budget": 2}))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    assert model.generation_config.loop_budget == 2 and model.generation_config.do_sample is False
    prompt = ids[:1, :6]
    with torch.no_grad():
        assert torch.equal(
            model.generate(prompt, max_new_tokens=3, pad_token_id=0), oracle_greedy(sd, prompt, SHORTEST, 3)
        )
    path.write_text(json.dumps({"_from_model_config": True, "loop_budget": 0}))
    with pytest.raises(ValueError, match=r"generation_config\.json sets a loop knob.*`loop_budget` must be"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def write_gpt2_style_tokenizer(folder):
    """GPT-2's files as transformers 4.57 saved them (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json
    naming GPT2Tokenizer, special_tokens_map.json), from a small byte-level BPE trained with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from support.hub_helpers import CORPUS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(str(folder / "tokenizer.json"))
    tok.model.save(str(folder))  # vocab.json, merges.txt
    eot = "<|endoftext|>"
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": eot, "eos_token": eot, "unk_token": eot}))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": False,
                "add_prefix_space": False,
                "bos_token": eot,
                "eos_token": eot,
                "unk_token": eot,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 1024,
                "tokenizer_class": "GPT2Tokenizer",
                "added_tokens_decoder": {
                    "0": {
                        "content": eot,
                        "lstrip": False,
                        "normalized": True,
                        "rstrip": False,
                        "single_word": False,
                        "special": True,
                    }
                },
            }
        )
    )
    return tok.get_vocab_size()


def test_gpt2_style_tokenizer_files_with_autotokenizer_and_a_pipeline(tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "repo"
    folder.mkdir()
    assert write_gpt2_style_tokenizer(folder) <= 320
    sd = write_authors_repo(folder, stated=(), code=CODE, vocab=320)  # padded to a multiple of 64, as theirs
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.decode(tokenizer("the cat")["input_ids"]) == "the cat"
    generator = pipeline("text-generation", model=str(folder))
    text = generator("the cat sat on", max_new_tokens=4)[0]["generated_text"]
    ids = torch.tensor([tokenizer("the cat sat on")["input_ids"]])
    assert text == tokenizer.decode(oracle_greedy(sd, ids, [1 / N_LOOPS] * N_LOOPS, 4)[0])


def test_the_converter_prints_no_runpy_warning():
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-m", "loopformer_hf.convert_authors", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "RuntimeWarning" not in proc.stderr and "sys.modules" not in proc.stderr, (
        proc.stderr
    )


def test_an_authors_repo_stops_at_its_tokenizers_end_of_text_and_batched_pipelines_pad(tmp_path):
    """Their config.json names no end of text; their tokenizer does (<|endoftext|>). It loaded with eos_token_id None:
    generate never stopped at the end of a text, and transformers' hint for a batched pipeline (pad_token_id =
    config.eos_token_id) did nothing (issue 64)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = tmp_path / "repo"
    folder.mkdir()
    write_gpt2_style_tokenizer(folder)
    sd = write_authors_repo(folder, stated=(), code=CODE, vocab=320)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id == eot
    assert AutoConfig.from_pretrained(folder).eos_token_id == eot and model.config.bos_token_id == eot

    generator = pipeline("text-generation", model=str(folder), batch_size=2)
    assert generator.tokenizer.pad_token_id is None  # GPT-2's tokenizer has none: the hint is what users do
    generator.tokenizer.pad_token_id = generator.model.config.eos_token_id
    prompts = ["the cat", "the cat sat on the"]
    batched = generator(prompts, max_new_tokens=3, return_full_text=False)
    assert len(batched) == 2 and all(isinstance(out[0]["generated_text"], str) for out in batched)

    # generation stops at the end of text: a tokenizer whose end of text is the 3rd token the model picks greedily
    prompt = torch.tensor([tokenizer("the cat sat on")["input_ids"]])
    greedy = oracle_greedy(sd, prompt, [1 / N_LOOPS] * N_LOOPS, 8)[0, prompt.shape[1] :].tolist()
    stop = greedy[2]
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "eos_token": tokenizer.convert_ids_to_tokens(stop)}))
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.generation_config.eos_token_id == stop
    out = model.generate(prompt, max_new_tokens=8)[0, prompt.shape[1] :].tolist()
    assert out == greedy[: greedy.index(stop) + 1]
