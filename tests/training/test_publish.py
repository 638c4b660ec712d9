"""`python -m looped_training.publish` against a Hub-compatible server on 127.0.0.1: push, load by repo id in a fresh process
where the packages cannot be imported, model card metadata and snippets, repeated pushes, bad token, unreachable
endpoint, FPRM through its Auto class."""

import hashlib
import json
import os
import socket
import subprocess

import pytest
import torch
import yaml

from support.hub_helpers import (
    CROSS_PROCESS,
    PYTHON,
    REPO_ROOT,
    hf_env,
    last_json_line,
    make_fprm,
    make_model,
    make_tokenizer,
    run_python,
)
from support.hub_server import HubServer

import loopformer_hf  # noqa: F401  (registers the classes for the in-process side)
from looped_training.model_cards import load_eval_results
from looped_training.publish import main as publish_main


TOKEN = "hf_test_write_token"
REPO = "org/loopformer-tiny"
FPRM_REPO = "org/fprm-tiny"
FPRM_IDS = [[1, 2, 3, 4, 5, 6], [7, 0, 1, 1, 2, 3]]
EVAL = {
    "task": {"type": "text-generation", "name": "Language modeling"},
    "dataset": {"name": "tiny-corpus", "type": "text", "split": "test"},
    "results": [
        {"metric": "perplexity", "value": 41.5, "loop_budget": 1},
        {"metric": "perplexity", "value": 17.25, "loop_budget": 4, "step_schedule": "uniform"},
    ],
}
INPUT_IDS = [[5, 17, 42, 9, 100, 3, 77]]
# the record `python -m looped_training.loopformer.train` writes beside the model (text task, files on the user's disk)
RECORD = {
    "variant": "loopformer",
    "block_size": 128,
    "train_runtime_s": 12.5,
    "prompt": "the cat sat",
    "model": {"num_blocks": 2, "num_loops": 4, "hidden_size": 32},
    "data": {"task": "text", "train_files": ["/home/someone/private/corpus.txt"], "max_train_chars": 5000},
    "shortcut": {"lambda_short": 0.1, "lambda_consistency": None, "consistency": "mse"},
    "optimizer": {
        "learning_rate": 0.001,
        "lr_scheduler_type": "cosine_with_min_lr",
        "warmup_steps": 10.0,
        "weight_decay": 0.1,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "max_grad_norm": 1.0,
        "max_steps": 300,
        "per_device_train_batch_size": 32,
        "gradient_accumulation_steps": 1,
        "seed": 0,
        "lr_warmup": "reference",
    },
}


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _free_closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: connections are refused


@pytest.fixture(scope="module")
def hub():
    import huggingface_hub.constants

    # conftest.py puts the session offline; the in-process pushes here go to the local test server.
    with pytest.MonkeyPatch.context() as patch, HubServer(tokens={TOKEN}) as server:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "loopformer-tiny"
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "eval_results.json").write_text(json.dumps(EVAL))
    (path / "loopformer_training.json").write_text(json.dumps(RECORD))
    return path, model


@pytest.fixture(scope="module")
def pushed(hub, checkpoint):
    """First push, through the command line exactly as documented."""
    path, model = checkpoint
    before = _digest(path)
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "looped_training.publish",
            "--checkpoint",
            str(path),
            "--repo_id",
            REPO,
            "--token",
            TOKEN,
            "--dataset",
            "org/tiny-corpus",
            "--tag",
            "tiny",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0"},
        capture_output=True,
        text=True,
        timeout=600,  # a fresh interpreter imports torch and transformers: minutes on a loaded 2-core machine
    )
    assert proc.returncode == 0, proc.stderr
    assert _digest(path) == before  # the checkpoint is only read
    return model


@pytest.fixture(scope="module")
def pushed_fprm(hub, tmp_path_factory):
    """An FPRM checkpoint (no tokenizer: its inputs are task tokens) pushed the same way."""
    path = tmp_path_factory.mktemp("fprm") / "fprm-tiny"
    model = make_fprm(seed=0)
    model.save_pretrained(path)
    assert (
        publish_main(["--checkpoint", str(path), "--repo_id", FPRM_REPO, "--token", TOKEN, "--endpoint", hub.endpoint])
        == 0
    )
    return model


def test_fprm_push_has_auto_map_code_and_card(hub, pushed_fprm):
    files = hub.files(FPRM_REPO)
    assert {"model.safetensors", "config.json", "configuration_fprm.py", "modeling_fprm.py", "README.md"} <= set(files)
    config = json.loads(files["config.json"])
    assert config["auto_map"]["AutoModelForTokenClassification"] == "modeling_fprm.FPRMForReasoning"
    meta = yaml.safe_load(files["README.md"].decode().split("---")[1])
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "token-classification"
    assert "fprm" in meta["tags"] and "custom_code" in meta["tags"]


def test_push_uploads_weights_config_code_tokenizer_generation_config_card(hub, pushed, tmp_path):
    files = hub.files(REPO)
    pushed.save_pretrained(tmp_path)  # the code files: the modeling file and what it imports relatively
    code_files = {p.name for p in tmp_path.glob("*.py")}
    assert {"configuration_loopformer.py", "modeling_loopformer.py", "trajectory_loopformer.py"} <= code_files
    assert set(files) == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        *code_files,
    }
    config = json.loads(files["config.json"])
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_loopformer.LoopFormerForCausalLM"
    assert config["auto_map"]["AutoConfig"] == "configuration_loopformer.LoopFormerConfig"
    for code in code_files:
        assert files[code] == (REPO_ROOT / "loopformer_hf" / code).read_bytes()


def test_model_card_metadata_and_model_index_from_eval_json(hub, pushed):
    card = hub.files(REPO)["README.md"].decode()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "apache-2.0"
    assert meta["datasets"] == ["org/tiny-corpus"]
    assert {"loopformer", "custom_code", "tiny"} <= set(meta["tags"])
    (entry,) = meta["model-index"][0]["results"]
    assert entry["dataset"] == {"name": "tiny-corpus", "type": "text", "split": "test"}
    assert entry["task"]["type"] == "text-generation"
    got = {m["config"]: m["value"] for m in entry["metrics"]}
    assert got == {"loop_budget=1": 41.5, "loop_budget=4,step_schedule=uniform": 17.25}
    assert "| 17.25 |" in card  # the same numbers in the card body
    assert f'from_pretrained("{REPO}", trust_remote_code=True)' in card


def test_fresh_process_without_packages_loads_by_repo_id_with_equal_logits_and_card_snippets_run(
    hub, pushed, pushed_fprm, tmp_path
):
    code = f"""
    import json, re, torch
    try:
        import loopformer_hf
        raise SystemExit("loopformer_hf should not be importable here")
    except ImportError:
        pass
    from huggingface_hub import hf_hub_download
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    tok = AutoTokenizer.from_pretrained("{REPO}", trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained("{REPO}", trust_remote_code=True).eval()
    ids = torch.tensor({INPUT_IDS})
    with torch.no_grad():
        logits = {{
            "default": model(ids).logits,
            "m1": model(ids, loop_budget=1).logits,
            "sched": model(ids, step_schedule=[0.5, 0.25, 0.25]).logits,
        }}
    torch.save(logits, r"{tmp_path / "logits.pt"}")
    gen = model.generate(**tok(["the cat"], return_tensors="pt"), loop_budget=2, max_new_tokens=6, do_sample=False)
    pipe = pipeline("text-generation", model="{REPO}", trust_remote_code=True)
    text = pipe("the cat", loop_budget=2, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    card = open(hf_hub_download("{REPO}", "README.md")).read()
    snippets = re.findall(r"```python\\n(.*?)```", card, re.S)
    for snippet in snippets:
        exec(snippet, {{}})
    try:
        import fprm_hf
        raise SystemExit("fprm_hf should not be importable here")
    except ImportError:
        pass
    from transformers import AutoModelForTokenClassification
    fprm = AutoModelForTokenClassification.from_pretrained("{FPRM_REPO}", trust_remote_code=True).eval()
    with torch.no_grad():
        fprm_out = fprm(torch.tensor({FPRM_IDS}), halting=False)
    torch.save({{"logits": fprm_out.logits, "iterations": fprm_out.iterations}}, r"{tmp_path / "fprm.pt"}")
    fprm_card = open(hf_hub_download("{FPRM_REPO}", "README.md")).read()
    fprm_snippets = re.findall(r"```python\\n(.*?)```", fprm_card, re.S)
    for snippet in fprm_snippets:
        exec(snippet, {{}})
    print(json.dumps({{"module": type(model).__module__, "tokens": len(tok),
                      "generate_text": tok.decode(gen[0], skip_special_tokens=True), "pipe_text": text,
                      "snippets": len(snippets), "fprm_module": type(fprm).__module__,
                      "fprm_snippets": len(fprm_snippets)}}))
    """
    proc = run_python(code, env=hf_env(tmp_path, hub.endpoint))
    result = last_json_line(proc.stdout)
    assert result["module"].startswith("transformers_modules")  # the pushed code, not the package
    assert result["tokens"] == len(make_tokenizer())
    assert result["pipe_text"] == result["generate_text"]
    assert result["snippets"] == 3
    remote = torch.load(tmp_path / "logits.pt")
    ids = torch.tensor(INPUT_IDS)
    # Two processes may pick other thread counts and kernels, so float sums differ in the last bits: within
    # CROSS_PROCESS, not bit-equal (a wrong budget or schedule moves these logits by far more than that).
    with torch.no_grad():
        torch.testing.assert_close(remote["default"], pushed(ids).logits, **CROSS_PROCESS)
        torch.testing.assert_close(remote["m1"], pushed(ids, loop_budget=1).logits, **CROSS_PROCESS)
        torch.testing.assert_close(
            remote["sched"], pushed(ids, step_schedule=[0.5, 0.25, 0.25]).logits, **CROSS_PROCESS
        )
    assert (remote["m1"] - remote["default"]).abs().max() > 100 * CROSS_PROCESS["atol"]  # the budget reached it
    assert result["fprm_module"].startswith("transformers_modules") and result["fprm_snippets"] == 1
    fprm_remote = torch.load(tmp_path / "fprm.pt")
    with torch.no_grad():
        local = pushed_fprm(torch.tensor(FPRM_IDS), halting=False)
    torch.testing.assert_close(fprm_remote["logits"], local.logits, **CROSS_PROCESS)
    assert torch.equal(fprm_remote["iterations"], local.iterations)  # halting=False: exactly max_loops, an integer


def test_repeated_push_updates_the_repo(hub, pushed, tmp_path):
    from safetensors.torch import load

    first_commits = hub.commits(REPO)
    first_weights = hub.files(REPO)["model.safetensors"]
    tokenizer = make_tokenizer()
    retrained = make_model(tokenizer, seed=1)
    path = tmp_path / "retrained"
    retrained.save_pretrained(path)
    tokenizer.save_pretrained(path)
    eval_json = tmp_path / "eval2.json"
    eval_json.write_text(json.dumps({**EVAL, "results": [{"metric": "perplexity", "value": 11.0, "loop_budget": 4}]}))
    argv = [
        "--checkpoint",
        str(path),
        "--repo_id",
        REPO,
        "--token",
        TOKEN,
        "--endpoint",
        hub.endpoint,
        "--eval_json",
        str(eval_json),
        "--commit_message",
        "second run",
    ]
    assert publish_main(argv) == 0
    commits = hub.commits(REPO)
    assert commits[:-1] == first_commits and len(commits) == len(first_commits) + 1
    now = hub.files(REPO)
    state = load(now["model.safetensors"])
    assert torch.equal(state["model.embed_tokens.weight"], retrained.model.embed_tokens.weight)
    assert now["model.safetensors"] != first_weights
    assert hub.files(REPO, first_commits[-1])["model.safetensors"] == first_weights  # history kept
    assert "| 11 |" in now["README.md"].decode() and "41.5" not in now["README.md"].decode()


def test_bad_token_fails_clearly_and_changes_nothing(hub, pushed, checkpoint, capsys):
    path, _ = checkpoint
    before, commits = _digest(path), hub.commits(REPO)
    code = publish_main(
        ["--checkpoint", str(path), "--repo_id", REPO, "--token", "hf_wrong", "--endpoint", hub.endpoint]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "rejected the token (HTTP 401" in err and "--token" in err
    assert f"checkpoint at {path} is as it was" in err
    assert _digest(path) == before and hub.commits(REPO) == commits


def test_unreachable_endpoint_fails_clearly(hub, checkpoint, capsys):
    path, _ = checkpoint
    before = _digest(path)
    endpoint = f"http://127.0.0.1:{_free_closed_port()}"
    code = publish_main(["--checkpoint", str(path), "--repo_id", REPO, "--token", TOKEN, "--endpoint", endpoint])
    err = capsys.readouterr().err
    assert code == 1
    assert f"Could not reach the Hub endpoint {endpoint}" in err
    assert _digest(path) == before


def test_private_flag_makes_a_private_repo(hub, checkpoint):
    path, _ = checkpoint
    assert (
        publish_main(
            [
                "--checkpoint",
                str(path),
                "--repo_id",
                "org/secret",
                "--token",
                TOKEN,
                "--endpoint",
                hub.endpoint,
                "--private",
            ]
        )
        == 0
    )
    assert hub.state.repos[("model", "org/secret")].private
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.endpoint, token=False).model_info("org/secret")
    assert HfApi(endpoint=hub.endpoint, token=TOKEN).model_info("org/secret").sha == hub.commits("org/secret")[-1]


def test_user_errors(checkpoint, tmp_path, capsys):
    path, _ = checkpoint
    assert (
        publish_main(
            [
                "--checkpoint",
                str(tmp_path / "nope"),
                "--repo_id",
                REPO,
                "--dry_run",
                "--stage_dir",
                str(tmp_path / "s"),
            ]
        )
        == 2
    )
    assert "no config.json" in capsys.readouterr().err
    assert (
        publish_main(
            ["--checkpoint", str(path), "--repo_id", "bad//id", "--dry_run", "--stage_dir", str(tmp_path / "s")]
        )
        == 2
    )
    assert "bad//id" in capsys.readouterr().err
    no_tok = tmp_path / "no_tok"
    make_model().save_pretrained(no_tok)
    assert (
        publish_main(
            ["--checkpoint", str(no_tok), "--repo_id", REPO, "--dry_run", "--stage_dir", str(tmp_path / "s2")]
        )
        == 2
    )
    assert "No tokenizer" in capsys.readouterr().err
    bad_eval = tmp_path / "bad.json"
    bad_eval.write_text(json.dumps({"perplexity": 3}))
    with pytest.raises(ValueError, match="not an evaluation JSON"):
        load_eval_results(bad_eval)


def test_dry_run_stages_without_network(checkpoint, tmp_path):
    path, _ = checkpoint
    stage = tmp_path / "stage"
    assert (
        publish_main(
            [
                "--checkpoint",
                str(path),
                "--repo_id",
                REPO,
                "--dry_run",
                "--stage_dir",
                str(stage),
                "--endpoint",
                f"http://127.0.0.1:{_free_closed_port()}",
            ]
        )
        == 0
    )
    assert (stage / "README.md").exists() and (stage / "model.safetensors").exists()


def test_lm_eval_results_json_becomes_model_index(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(
        json.dumps(
            {
                "results": {"tiny_lambada": {"alias": "tiny_lambada", "acc,none": 0.25, "acc_stderr,none": 0.1}},
                "config": {"model_args": "pretrained=x,default_loop_budget=2"},
            }
        )
    )
    (result,) = load_eval_results(path)
    assert result["metric_type"] == "acc" and result["metric_value"] == 0.25
    assert result["dataset_name"] == "tiny_lambada" and result["metric_config"] == "pretrained=x,default_loop_budget=2"


def test_push_replaces_stale_weight_shards_but_keeps_the_users_other_files(hub, checkpoint):
    # The stale-weight patterns ("*.safetensors", ...) were fnmatch patterns, whose "*" crosses "/": a push deleted
    # every .safetensors/.bin file anywhere in the repo (an ONNX export, a LoRA adapter, older checkpoints).
    from huggingface_hub import CommitOperationAdd, HfApi

    repo = "org/keeps-user-files"
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(repo)
    user_files = [
        "onnx/model.safetensors",
        "lora/adapter_model.safetensors",
        "checkpoints/step-100/pytorch_model.bin",
        "checkpoints/step-100/model.safetensors.index.json",
        "notes.txt",
    ]
    stale = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    api.create_commit(
        repo,
        [CommitOperationAdd(path_in_repo=p, path_or_fileobj=p.encode()) for p in user_files + stale],
        commit_message="a sharded model and the user's own files",
    )
    path, _ = checkpoint
    assert (
        publish_main(["--checkpoint", str(path), "--repo_id", repo, "--token", TOKEN, "--endpoint", hub.endpoint]) == 0
    )
    files = hub.files(repo)
    assert {p: files.get(p) for p in user_files} == {p: p.encode() for p in user_files}  # untouched
    assert not set(stale) & set(files)  # the previous model's weights are gone
    assert "model.safetensors" in files and files["model.safetensors"] != b"model.safetensors"


def test_the_card_takes_its_prompt_and_training_section_from_the_runs_record(checkpoint, tmp_path):
    path, _ = checkpoint
    stage = tmp_path / "stage"
    assert publish_main(["--checkpoint", str(path), "--repo_id", REPO, "--dry_run", "--stage_dir", str(stage)]) == 0
    card = (stage / "README.md").read_text()
    assert 'tokenizer(["the cat sat"]' in card and 'generator("the cat sat"' in card  # the record's prompt
    training = card.split("## Training", 1)[1].split("##", 1)[0]
    assert "`python -m looped_training.loopformer.train` (variant `loopformer`" in training
    assert "text files: corpus.txt" in training and "300 optimizer steps of 32 × 1 rows of 128 tokens" in training
    assert "λ2 = 0.1 × MSE" in training and "Training took 12 s." in training  # the variant's default λ2
    assert "/home/someone" not in card and "See the repository" not in card and '"The"' not in card


def test_without_a_record_the_card_says_so_and_starts_from_the_start_of_text_token(tmp_path):
    from looped_training.model_cards import NO_RECORD_TEXT

    checkpoint = tmp_path / "bare"
    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    stage = tmp_path / "stage"
    assert (
        publish_main(["--checkpoint", str(checkpoint), "--repo_id", REPO, "--dry_run", "--stage_dir", str(stage)]) == 0
    )
    card = (stage / "README.md").read_text()
    assert NO_RECORD_TEXT in card and 'tokenizer(["<|endoftext|>"]' in card


def _elastic_eval(paths):
    rows = [
        {"budget": m, "schedule": s, "em": 0.1 * m, "ppl": 10.0 / m}
        for m in (1, 2)
        for s in ("uniform", "coarse_to_fine")
    ]
    return {
        "models": [
            {
                "name": f"run{i}",
                "path": str(p),
                "variant": "loopformer",
                "task": "synthetic",
                "results": [{**r, "em": r["em"] + i} for r in rows],
            }
            for i, p in enumerate(paths)
        ]
    }


def test_elastic_eval_json_gives_exact_match_and_perplexity_per_budget_of_this_checkpoint(tmp_path):
    record = {"data": {"task": "synthetic", "synthetic_kind": "arithmetic", "min_depth": 1, "max_depth": 4}}
    path = tmp_path / "elastic_eval.json"
    path.write_text(json.dumps(_elastic_eval([tmp_path / "a", tmp_path / "b"])))
    results = load_eval_results(path, checkpoint=tmp_path / "b", record=record)
    got = {(r["metric_type"], r["metric_config"]): r["metric_value"] for r in results}
    assert got == {
        ("exact_match", "loop_budget=1"): 1.1,
        ("perplexity", "loop_budget=1"): 10.0,
        ("exact_match", "loop_budget=2"): pytest.approx(1.2),
        ("perplexity", "loop_budget=2"): 5.0,
    }
    assert {r["dataset_name"] for r in results} == {"synthetic arithmetic chains mod 10, depth 1..4"}
    with pytest.raises(ValueError, match=r"evaluates 2 models \(\['run0', 'run1'\]\), none of them from"):
        load_eval_results(path, checkpoint=tmp_path / "elsewhere")


def test_an_fprm_run_folder_publishes_its_results_json_as_the_model_index(tmp_path):
    run = tmp_path / "fprm-run"
    make_fprm(seed=0).save_pretrained(run / "model")
    results = {
        "preset": "s5-cpu",
        "task": "s5",
        "train_seconds": 90.0,
        "train_steps": 40,
        "solver": {"max_loops": 4},
        "halting": {"cell_accuracy": 0.75, "exact_accuracy": 0.5, "mean_iterations": 3.5},
        "always_cap": {"cell_accuracy": 0.74, "exact_accuracy": 0.5, "mean_iterations": 4.0},
        "args": {
            "data": {"task": "s5", "train_length": 8, "test_length": 16, "num_train": 64, "num_test": 16},
            "n_backward": 4,
            "max_segments": 16,
            "batch_size": 16,
            "learning_rate": 0.001,
        },
    }
    (run / "results.json").write_text(json.dumps(results))
    stage = tmp_path / "stage"
    assert (
        publish_main(
            ["--checkpoint", str(run / "model"), "--repo_id", FPRM_REPO, "--dry_run", "--stage_dir", str(stage)]
        )
        == 0
    )
    card = (stage / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    (entry,) = meta["model-index"][0]["results"]
    assert entry["dataset"]["name"] == "S5 state tracking (generated; training length 8, test length 16)"
    got = {(m["type"], m["config"]): m["value"] for m in entry["metrics"]}
    assert (
        got[("exact_accuracy", "halting,max_loops=4")] == 0.5
        and got[("mean_iterations", "halting=False,max_loops=4")] == 4.0
    )
    training = card.split("## Training", 1)[1]
    assert "(preset `s5-cpu`) on S5 state tracking" in training and "40 optimizer steps (segments) of 16" in training


CARDS = REPO_ROOT / "tests" / "training" / "cards"  # pushed by `model.push_to_hub` before issue 65 (the mixin)


def test_push_to_hub_with_card_writes_the_packages_card_and_push_to_hub_is_transformers(hub, checkpoint, tmp_path):
    """`push_to_hub_with_card(model, repo_id)` writes the card the models' own `push_to_hub` wrote while they inherited
    it (tests/training/cards/, pushed then), to the byte; `model.push_to_hub` is transformers' own again."""
    path, _ = checkpoint
    code = f"""
    from loopformer_hf import LoopFormerForCausalLM
    from support.tiny_models import sequence_fprm_config, tiny_fprm
    from fprm_hf import FPRMForReasoning
    from looped_training.publish import push_to_hub_with_card

    lf = LoopFormerForCausalLM.from_pretrained(r"{path}")
    push_to_hub_with_card(lf, "org/pushed-lf", token="{TOKEN}", tags=["mine"])
    fprm = tiny_fprm(0, config=sequence_fprm_config(vocab_size=8, num_attention_heads=2, num_hidden_layers=1, max_loops=4))
    push_to_hub_with_card(FPRMForReasoning(fprm.config), "org/pushed-fprm", token="{TOKEN}")
    lf.push_to_hub("org/plain-lf", token="{TOKEN}")
    """
    run_python(
        code, env={**hf_env(tmp_path, hub.endpoint), "PYTHONPATH": str(REPO_ROOT / "tests")}, block_packages=False
    )
    card = hub.files("org/pushed-lf")["README.md"].decode()
    meta = yaml.safe_load(card.split("---")[1])
    assert "is a **LoopFormer**" in card and 'tokenizer(["the cat sat"]' in card and "text files: corpus.txt" in card
    assert {"loopformer", "mine"} <= set(meta["tags"]) and meta["model-index"][0]["results"][0]["metrics"]
    assert "This is the model card of a" not in card
    assert {"model.safetensors", "config.json", "README.md"} <= set(hub.files("org/pushed-lf"))
    fprm_card = hub.files("org/pushed-fprm")["README.md"].decode()
    assert "is an **FPRM**" in fprm_card and "without its training run's record" in fprm_card
    assert card == (CARDS / "pushed_loopformer.md").read_text() and fprm_card == (CARDS / "pushed_fprm.md").read_text()
    assert "is a **LoopFormer**" not in hub.files("org/plain-lf").get("README.md", b"").decode()  # transformers' card
