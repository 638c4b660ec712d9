"""A TRM checkpoint in the authors' layout (their models/recursive_reasoning/trm.py at 9e0ebf3: `H_init` / `L_init`,
the Q-head, the block stack as `L_level`, all under `model.inner.`) loads as `FPRMConfig(recursion="trm")`, through
`python -m fprm_hf.convert_authors` and through `from_pretrained` on a folder of their step files (issue 73, item 3).

Random weights written in their layout (tests/support/trm_reference_oracle.py, which imports nothing from fprm_hf);
the logits and Q-halt logits are compared with their forward re-implemented there (`TheirTRM`, which
tests/fprm/test_recursion_trm.py checks the model against on weights mapped by hand).
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from support.hub_helpers import REPO_ROOT
from support.trm_reference_oracle import TRM_SETTINGS, TheirTRM, trm_state_dict

from fprm_hf import FPRMConfig, FPRMForReasoning
from fprm_hf.convert_authors import convert

pytestmark = pytest.mark.usefixtures("one_thread")

# their config/arch/trm.yaml's way of giving n_backwards_L (an omegaconf reference), at the oracle's tiny size
TRM_YAML = {**TRM_SETTINGS, "n_backwards_L": "${.L_cycles}"}


def batch(n=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    s = TRM_SETTINGS
    return {
        "inputs": torch.randint(0, s["vocab_size"], (n, s["seq_len"]), generator=g),
        "puzzle_identifiers": torch.randint(0, s["num_puzzle_identifiers"], (n,), generator=g),
    }


def assert_computes_their_trm(model, sd):
    """The loaded model's evaluation (halt_max_steps ACT steps from H_init / L_init) against theirs on `sd`."""
    data = batch()
    theirs = TheirTRM(sd, TRM_SETTINGS)
    expected, _ = theirs.evaluate(data)
    with torch.no_grad():
        out = model.eval()(data["inputs"], puzzle_identifiers=data["puzzle_identifiers"])
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-4)
    assert float(expected.abs().max()) > 0.5  # logits worth comparing
    # their Q-head reads z_H[:, 0] after the last ACT step: the halting logits agree too
    z_H = out.solver_state.hidden
    q = F.linear(z_H[:, 0], theirs.w["q_head.weight"], theirs.w["q_head.bias"])[..., 0]
    torch.testing.assert_close(out.q_halt_logits, q, rtol=0, atol=1e-5)


def test_the_converter_loads_their_trm_step_file(tmp_path):
    sd = trm_state_dict(TRM_SETTINGS, seed=21)
    torch.save(sd, tmp_path / "step_100")
    model = convert(tmp_path / "step_100", [TRM_YAML], tmp_path / "out")
    config = model.config
    assert config.recursion == "trm"
    assert (config.H_cycles, config.L_cycles, config.n_backwards_L) == (2, 3, 3)
    assert (config.halt_max_steps, config.halt_exploration_prob) == (3, 0.5)
    assert torch.equal(model.model.H_init, sd["model.inner.H_init"])
    assert torch.equal(model.model.L_init, sd["model.inner.L_init"])
    assert torch.equal(model.q_head.weight, sd["model.inner.q_head.weight"])
    assert_computes_their_trm(model, sd)
    assert_computes_their_trm(FPRMForReasoning.from_pretrained(tmp_path / "out"), sd)


def test_python_m_convert_authors_on_their_trm_files(tmp_path):
    """The command as a user of their code runs it: their torch.save'd step file (compiled: `_orig_mod.`) and the
    arch YAML with its `${.L_cycles}` reference."""
    sd = trm_state_dict(TRM_SETTINGS, seed=22)
    torch.save({f"_orig_mod.{k}": v for k, v in sd.items()}, tmp_path / "step_7")
    (tmp_path / "trm.yaml").write_text(yaml.safe_dump(TRM_YAML))
    run = subprocess.run(
        [sys.executable, "-m", "fprm_hf.convert_authors", "--checkpoint", str(tmp_path / "step_7")]
        + ["--config", str(tmp_path / "trm.yaml"), "--output", str(tmp_path / "out")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert_computes_their_trm(FPRMForReasoning.from_pretrained(tmp_path / "out"), sd)


def test_from_pretrained_on_a_folder_of_their_trm_step_files(tmp_path):
    """Their pretrain.py's run folder: step_N files and all_config.yaml (`arch:` as their Hydra run merged it)."""
    sd = trm_state_dict(TRM_SETTINGS, seed=23)
    folder = tmp_path / "trm-run"
    folder.mkdir()
    torch.save({f"_orig_mod.{k}": v for k, v in sd.items()}, folder / "step_40")
    arch = {**TRM_SETTINGS, "name": "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1"}
    (folder / "all_config.yaml").write_text(yaml.safe_dump({"arch": arch, "data_paths": ["data/custom"]}))
    model = FPRMForReasoning.from_pretrained(folder)
    assert model.config.recursion == "trm" and model.config.authors_checkpoint["step"] == 40
    assert_computes_their_trm(model, sd)
    config = FPRMConfig.from_pretrained(folder)
    assert config.to_dict() == model.config.to_dict()


def test_their_trm_settings_that_are_missing_or_not_computed_are_refused(tmp_path):
    sd = trm_state_dict(TRM_SETTINGS, seed=24)
    settings = {k: v for k, v in TRM_SETTINGS.items() if k != "halt_max_steps"}
    with pytest.raises(ValueError, match=r"missing settings \['halt_max_steps'\]: a TRM checkpoint"):
        convert(sd, [settings], tmp_path / "a")
    with pytest.raises(ValueError, match=r"q_logit_from_puzzle_emb=False"):
        convert(sd, [dict(TRM_SETTINGS, q_logit_from_puzzle_emb=False)], tmp_path / "b")
    half = {k: v for k, v in sd.items() if k != "model.inner.L_init"}
    with pytest.raises(ValueError, match=r"holds H_init without \{'L_init'\}"):
        convert(half, [TRM_SETTINGS], tmp_path / "c")
