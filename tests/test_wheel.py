"""The wheel as a user gets it (issue 13): built from a copy of the checkout, installed into a fresh virtual environment
outside it, and used from a folder outside it: the README's quick snippet, an FPRM preset, a LoRA step
(`python -m looped_training.finetune_lora`) and `python -m looped_training.publish` of its result to the test Hub.

The new environment sees the test venv's third-party packages (torch, transformers, ...) through a .pth file, so
nothing is downloaded; the project's own packages come only from the wheel."""

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

from _hub_helpers import CORPUS, REPO_ROOT, hf_env, last_json_line, save_checkpoint
from hub_server import HubServer


PACKAGES = ("loopformer_hf", "fprm_hf", "looped_training")
# What the wheel carries besides modules: the model-card templates and the config files (any depth).
PACKAGE_DATA = re.compile(r"looped_training/(model_cards/[^/]+\.md|configs/.+\.(yaml|json))")
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    "runs", "outputs")
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
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(root / "dist"), str(source)])
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
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)])
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
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*"):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if path.is_file() and "__pycache__" not in rel and (rel.endswith(".py") or PACKAGE_DATA.fullmatch(rel)):
                expected.add(rel)
    assert set(names) == expected
    assert "looped_training/configs/accelerate/fsdp.yaml" in names and "looped_training/model_cards/fprm.md" in names


def _readme_quick_snippet():
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Use it like Llama", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_installed_imports_readme_snippet_and_preset_outside_the_checkout(venv):
    python, site, env, work = venv
    code = _readme_quick_snippet() + f"""
import json, loopformer_hf, fprm_hf, looped_training
from looped_training.fprm.train import parse_args

model_args, data_args, _, train_args = parse_args(["--preset", "{PRESET}"])
print(json.dumps({{"files": [m.__file__ for m in (loopformer_hf, fprm_hf, looped_training)],
                  "task": data_args.task, "preset": data_args.preset, "output_dir": train_args.output_dir}}))
"""
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
    proc = _run([str(python), "-m", "looped_training.finetune_lora", "--model", str(checkpoint), "--train_files",
                 str(work / "corpus.txt"), "--output", str(work / "lora"), "--block_size", "16", "--batch_size", "2",
                 "--max_steps", "2", "--loop_budgets", "1,2", "--merge"], cwd=work, env=env)
    summary = last_json_line(proc.stdout)
    assert summary["steps"] == 2
    assert (work / "lora" / "adapter" / "adapter_model.safetensors").is_file()

    with HubServer(tokens={TOKEN}) as hub:
        _run([str(python), "-m", "looped_training.publish", "--checkpoint", str(work / "lora" / "merged"),
              "--repo_id", REPO, "--token", TOKEN], cwd=work, env={**env, **hf_env(work, hub.endpoint)})
        files = hub.files(REPO)
    assert {"model.safetensors", "config.json", "modeling_loopformer.py", "tokenizer.json", "README.md"} <= set(files)
    card = files["README.md"].decode()
    assert f'from_pretrained("{REPO}", trust_remote_code=True)' in card  # rendered from the installed template
