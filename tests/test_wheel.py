"""The wheel as a user gets it: built from a copy of the checkout, installed into a fresh virtual
environment outside it, and used from a folder outside it, each README command at tiny sizes: the README's quick
snippet; `python -m looped_training.loopformer.train --preset NAME` (the synthetic preset, and the text preset on the
user's files); `pipeline("text-generation", model=dir)(prompt)` with no other argument; `python -m
looped_training.loopformer.evaluate` without matplotlib (plots skipped with a note); `python -m looped_training.publish`
of its run with the evaluation's elastic_eval.json; `python -m looped_training.fprm.train --preset NAME`, `python -m
looped_training.fprm.evaluate RUN` and the publish of that run; `python -m looped_training.configs accelerate NAME`;
both converters with the README's flags; a LoRA step (`python -m looped_training.finetune_lora`) and its publish.

The new environment sees the test venv's third-party packages (torch, transformers, ...) through a .pth file, so
nothing is downloaded, and not matplotlib (the `train` extra, which a plain install lacks); the project's own packages
come only from the wheel."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from support.hub_helpers import CORPUS, REPO_ROOT, hf_env, last_json_line, save_checkpoint
from support.hub_server import HubServer


PACKAGES = ("loopformer_hf", "fprm_hf", "looped_training")
# The checkout's folder of each installed package (pyproject.toml's package-dir: training/ and model_cards/ install
# as looped_training and looped_training/model_cards).
SOURCE_DIRS = {
    "loopformer_hf": "loopformer_hf",
    "fprm_hf": "fprm_hf",
    "training": "looped_training",
    "model_cards": "looped_training/model_cards",
}
# What the wheel carries besides modules: the model-card templates and the config files (any depth).
PACKAGE_DATA = re.compile(r"looped_training/(model_cards/[^/]+\.md|configs/.+\.(yaml|json))")
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "runs", "outputs"
)
TOKEN = "hf_wheel_test_token"
REPO = "org/wheel-tiny"
PRESET = "s5-cpu"


def _run(cmd, timeout=600, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build from a copy, so the checkout gets no build/ or egg-info (a stale build/lib would leak into the wheel)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO_ROOT, source, ignore=NOT_SOURCE, symlinks=True)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(root / "dist"),
            str(source),
        ]
    )
    (path,) = (root / "dist").glob("*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv outside the checkout with the wheel installed; returns (python, site-packages, clean env, cwd)."""
    root = tmp_path_factory.mktemp("installed")
    env_dir = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    # third-party packages from the test venv; .pth files there (an editable install of the checkout) are not run
    (site / "test_venv_packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # a plain install: no plotting extra (matplotlib is in the test venv, so it is hidden here)
    (site / "zz_no_matplotlib.pth").write_text("import sys; sys.modules['matplotlib'] = None\n")
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_TELEMETRY="1")
    work = root / "work"
    work.mkdir()
    return python, site, env, work


def test_wheel_holds_the_three_packages_and_their_data_only(wheel):
    names = [n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n]
    top = {n.split("/")[0] for n in names}
    assert top == set(PACKAGES), top  # no tests/, benchmarks/, docs/, scripts/, nor a top-level `training`
    expected = set()
    for folder, installed in SOURCE_DIRS.items():
        for path in (REPO_ROOT / folder).rglob("*"):
            rel = f"{installed}/{path.relative_to(REPO_ROOT / folder).as_posix()}"
            if path.is_file() and "__pycache__" not in rel and (rel.endswith(".py") or PACKAGE_DATA.fullmatch(rel)):
                expected.add(rel)
    assert set(names) == expected
    assert "looped_training/configs/accelerate/fsdp.yaml" in names and "looped_training/model_cards/fprm.md" in names


def _readme_quick_snippet():
    """The README's first Python block that builds a LoopFormer (its quick usage snippet)."""
    readme = (REPO_ROOT / "README.md").read_text()
    return next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "LoopFormerConfig(" in block)


def test_installed_imports_readme_snippet_and_preset_outside_the_checkout(venv):
    python, site, env, work = venv
    code = (
        _readme_quick_snippet()
        + f"""
import json, loopformer_hf, fprm_hf, looped_training
from looped_training.fprm.train import parse_args

model_args, data_args, _, train_args = parse_args(["--preset", "{PRESET}"])
print(json.dumps({{"files": [m.__file__ for m in (loopformer_hf, fprm_hf, looped_training)],
                  "task": data_args.task, "preset": data_args.preset, "output_dir": train_args.output_dir}}))
"""
    )
    result = last_json_line(_run([str(python), "-c", code], cwd=work, env=env).stdout)
    for file in result["files"]:
        assert Path(file).is_relative_to(site) and not Path(file).is_relative_to(REPO_ROOT), file
    assert (work / "my-loopformer" / "config.json").is_file()  # the snippet ran to its end
    assert result["task"] == "s5" and result["preset"] == PRESET and result["output_dir"] == f"outputs/fprm-{PRESET}"


def test_installed_lora_step_then_publish_to_the_hub(venv):
    python, site, env, work = venv
    checkpoint = work / "base"
    save_checkpoint(checkpoint)
    (work / "corpus.txt").write_text("\n".join(CORPUS))
    proc = _run(
        [
            str(python),
            "-m",
            "looped_training.finetune_lora",
            "--model",
            str(checkpoint),
            "--train_files",
            str(work / "corpus.txt"),
            "--output",
            str(work / "lora"),
            "--block_size",
            "16",
            "--batch_size",
            "2",
            "--max_steps",
            "2",
            "--loop_budgets",
            "1,2",
            "--merge",
        ],
        cwd=work,
        env=env,
    )
    summary = last_json_line(proc.stdout)
    assert summary["steps"] == 2
    assert (work / "lora" / "adapter" / "adapter_model.safetensors").is_file()

    with HubServer(tokens={TOKEN}) as hub:
        _run(
            [
                str(python),
                "-m",
                "looped_training.publish",
                "--checkpoint",
                str(work / "lora" / "merged"),
                "--repo_id",
                REPO,
                "--token",
                TOKEN,
            ],
            cwd=work,
            env={**env, **hf_env(work, hub.endpoint)},
        )
        files = hub.files(REPO)
    assert {"model.safetensors", "config.json", "modeling_loopformer.py", "tokenizer.json", "README.md"} <= set(files)
    card = files["README.md"].decode()
    assert f'from_pretrained("{REPO}", trust_remote_code=True)' in card  # rendered from the installed template


def _fails(cmd, **kwargs):
    """`cmd`'s stderr, after checking that it exits 2 with a one-line error and no traceback."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    return proc.stderr.strip().splitlines()[-1]


LF_TINY = [
    "--hidden_size",
    "32",
    "--num_attention_heads",
    "2",
    "--per_device_train_batch_size",
    "8",
    "--max_steps",
    "2",
    "--save_strategy",
    "no",
    "--disable_tqdm",
    "true",
]


def test_shipped_configs_name_no_checkout_path():
    configs = REPO_ROOT / "training" / "configs"
    for path in configs.rglob("*.yaml"):
        values = " ".join(line.split("#")[0] for line in path.read_text().splitlines())
        assert "../" not in values and "shared/data" not in values, path


def test_installed_accelerate_configs_by_name(venv):
    python, site, env, work = venv
    path = Path(
        _run([str(python), "-m", "looped_training.configs", "accelerate", "ddp"], cwd=work, env=env).stdout.strip()
    )
    assert path.is_relative_to(site) and path.is_file() and "distributed_type: MULTI_GPU" in path.read_text()
    listing = _run([str(python), "-m", "looped_training.configs"], cwd=work, env=env).stdout
    assert "accelerate: ddp deepspeed fsdp" in listing and "synthetic-tiny" in listing
    assert "must be one of ['ddp', 'deepspeed', 'fsdp'], got 'dpp'" in _fails(
        [str(python), "-m", "looped_training.configs", "accelerate", "dpp"], cwd=work, env=env
    )


def test_installed_loopformer_preset_pipeline_evaluation_and_publish(venv):
    python, site, env, work = venv
    _run(
        [
            str(python),
            "-m",
            "looped_training.loopformer.train",
            "--preset",
            "synthetic-tiny",
            *LF_TINY,
            "--num_train_problems",
            "64",
            "--num_eval_problems",
            "16",
        ],
        cwd=work,
        env=env,
    )
    run = work / "outputs" / "loopformer-synthetic-tiny"  # the preset's default output folder
    record = json.loads((run / "loopformer_training.json").read_text())
    assert record["data"]["preset"] == "synthetic-tiny" and record["data"]["max_depth"] == 4  # the preset's values

    code = f"""
import json, loopformer_hf
from transformers import pipeline
pipe = pipeline("text-generation", model={str(run)!r})
out = pipe({record["prompt"]!r}, return_tensors=True)[0]["generated_token_ids"]
print(json.dumps({{"tokens": len(out), "context": pipe.model.config.max_position_embeddings}}))
"""
    generated = last_json_line(_run([str(python), "-c", code], cwd=work, env=env).stdout)
    assert generated["tokens"] <= generated["context"]

    proc = _run(
        [
            str(python),
            "-m",
            "looped_training.loopformer.evaluate",
            str(run),
            "--output_dir",
            "eval",
            "--max_rows",
            "8",
            "--repr_rows",
            "4",
            "--schedules",
            "uniform",
        ],
        cwd=work,
        env=env,
    )
    assert "matplotlib is not installed: no plots" in proc.stderr and "Exact match" in proc.stdout
    assert (work / "eval" / "elastic_eval.json").is_file() and not list((work / "eval").glob("*.png"))

    with HubServer(tokens={TOKEN}) as hub:
        _run(
            [
                str(python),
                "-m",
                "looped_training.publish",
                "--checkpoint",
                str(run),
                "--repo_id",
                "org/lf-tiny",
                "--token",
                TOKEN,
                "--eval_json",
                str(work / "eval" / "elastic_eval.json"),
            ],
            cwd=work,
            env={**env, **hf_env(work, hub.endpoint)},
        )
        files = hub.files("org/lf-tiny")
    card = files["README.md"].decode()
    assert f'tokenizer(["{record["prompt"]}"]' in card and "preset `synthetic-tiny`" in card
    assert "type: exact_match" in card and str(work) not in card
    assert json.loads(files["generation_config.json"])["max_new_tokens"] == record["generation"]["max_new_tokens"]


def test_installed_text_preset_trains_on_the_users_files(venv):
    python, site, env, work = venv
    (work / "plays").mkdir(exist_ok=True)
    (work / "plays" / "corpus.txt").write_text("\n".join(CORPUS * 10))
    common = [
        str(python),
        "-m",
        "looped_training.loopformer.train",
        "--preset",
        "shakespeare-tiny",
        *LF_TINY,
        "--block_size",
        "16",
        "--tokenizer_vocab_size",
        "300",
    ]
    assert "Give exactly one of --dataset_name or --train_files" in _fails(
        [*common, "--output_dir", "no-data"], cwd=work, env=env
    )
    _run([*common, "--train_files", "plays", "--output_dir", "text-run"], cwd=work, env=env)
    assert (work / "text-run" / "model.safetensors").is_file()


def test_installed_fprm_preset_evaluation_and_publish(venv):
    python, site, env, work = venv
    _run(
        [
            str(python),
            "-m",
            "looped_training.fprm.train",
            "--preset",
            PRESET,
            "--output_dir",
            "fprm-run",
            "--max_steps",
            "2",
            "--num_train",
            "32",
            "--num_test",
            "8",
            "--train_length",
            "8",
            "--test_length",
            "16",
            "--hidden_size",
            "32",
            "--intermediate_size",
            "64",
            "--per_device_train_batch_size",
            "8",
            "--eval_max_loops",
            "4",
            "--time_budget_minutes",
            "0",
        ],
        cwd=work,
        env=env,
    )
    trained = json.loads((work / "fprm-run" / "results.json").read_text())
    proc = _run([str(python), "-m", "looped_training.fprm.evaluate", "fprm-run"], cwd=work, env=env)
    assert "matplotlib is not installed" in proc.stdout
    again = json.loads((work / "fprm-run" / "eval" / "results.json").read_text())
    assert again["halting"]["cell_accuracy"] == trained["halting"]["cell_accuracy"]  # the same test set, rebuilt
    assert "fprm-nope' is not a folder" in _fails(
        [str(python), "-m", "looped_training.fprm.evaluate", "fprm-nope"], cwd=work, env=env
    )
    with HubServer(tokens={TOKEN}) as hub:
        _run(
            [
                str(python),
                "-m",
                "looped_training.publish",
                "--checkpoint",
                "fprm-run/model",
                "--repo_id",
                "org/fprm-tiny",
                "--token",
                TOKEN,
            ],
            cwd=work,
            env={**env, **hf_env(work, hub.endpoint)},
        )
        card = hub.files("org/fprm-tiny")["README.md"].decode()
    assert "type: exact_accuracy" in card and f"preset `{PRESET}`" in card


def test_installed_converters_run_with_the_readmes_flags(venv, tmp_path):
    """The README's converter commands (their required shape flags included) on random checkpoints of the authors'
    layouts."""
    import torch
    import yaml

    from support.reference_oracle import reference_state_dict as loopformer_reference
    from support.fprm_reference_oracle import BASE, SEQ_LEN, VOCAB, reference_state_dict as fprm_reference

    python, site, env, work = venv
    torch.save(loopformer_reference(d=64, n_layer=3, vocab=97, block=64), work / "ckpt.pt")
    _run(
        [
            str(python),
            "-m",
            "loopformer_hf.convert_authors",
            "--checkpoint",
            "ckpt.pt",
            "--output",
            "loopformer-3x8",
            "--n-layer",
            "3",
            "--n-loops",
            "8",
            "--n-embd",
            "64",
            "--n-head",
            "4",
            "--vocab-size",
            "97",
            "--block-size",
            "64",
        ],
        cwd=work,
        env=env,
    )
    assert json.loads((work / "loopformer-3x8" / "config.json").read_text())["num_loops"] == 8

    (work / "config" / "arch").mkdir(parents=True, exist_ok=True)
    arch = {k: v for k, v in BASE.items() if k not in ("vocab_size", "seq_len", "num_puzzle_identifiers")}
    (work / "config" / "arch" / "fprm.yaml").write_text(yaml.safe_dump(arch))
    (work / "config" / "cfg_pretrain.yaml").write_text(yaml.safe_dump({"arch": {"max_iter_eval": 12}}))
    (work / "dataset.json").write_text(
        json.dumps({"vocab_size": VOCAB, "seq_len": SEQ_LEN, "num_puzzle_identifiers": 3})
    )
    torch.save(fprm_reference(BASE), work / "step_50000")
    _run(
        [
            str(python),
            "-m",
            "fprm_hf.convert_authors",
            "--checkpoint",
            "step_50000",
            "--config",
            "config/arch/fprm.yaml",
            "--config",
            "config/cfg_pretrain.yaml",
            "--dataset-json",
            "dataset.json",
            "--output",
            "out/fprm",
        ],
        cwd=work,
        env=env,
    )
    assert json.loads((work / "out" / "fprm" / "config.json").read_text())["max_loops"] == 12
