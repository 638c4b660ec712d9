"""loopformer_hf/authors/auto.py: how transformers' Auto classes reach the authors' Hub repos, and what stays out of
their reach (issue 72, item 7).

- Importing `loopformer_hf` never replaces another library's registration: a model type of theirs ("base_loop", ...)
  that `AutoConfig` already holds is left as it is, one warning names `from_pretrained_authors`, and that function
  loads the repo whatever the registry holds.
- `LoopFormerConfig(**d)` and `LoopFormerConfig.from_dict(d)` of this package's own format never enter the authors'
  folder: no module of it that reads files is imported, and its readers are never called.
- `AutoConfig` on their repo states the model `from_pretrained` builds, and `AutoModelForCausalLM` / `AutoModel` load
  it without any hook in the model classes.
"""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import loopformer_hf
from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM, LoopFormerModel, LoopFormerPreTrainedModel
from loopformer_hf.authors import auto, model_types

from support.hub_helpers import REPO_ROOT
from support.reference_oracle import ARCHITECTURE, N_LOOPS, VOCAB, reference_forward, write_authors_repo

LOADER = "loopformer_hf.authors.from_pretrained_authors"
# the modules of the authors' folder that read a repo's files or parse its code
READERS = ("checkpoints", "code_defaults", "config", "convert", "files", "weights")


def _run(script, *args):
    done = subprocess.run(
        [sys.executable, "-c", script, str(REPO_ROOT / "tests"), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


# ---- 1. import never replaces another library's registration -------------------------------------------------------

TAKEN_SCRIPT = r"""
import json, sys
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoConfig, PreTrainedConfig


class SomeoneElsesConfig(PreTrainedConfig):  # another library's "base_loop", registered before ours is imported
    model_type = "base_loop"


AutoConfig.register("base_loop", SomeoneElsesConfig)
import loopformer_hf  # noqa: E402
import loopformer_hf  # noqa: E402,F811  (a second import changes nothing)
from loopformer_hf.authors import from_pretrained_authors  # noqa: E402

sys.path.insert(0, sys.argv[1])
from support.reference_oracle import ARCHITECTURE, N_LOOPS, VOCAB, reference_forward, write_authors_repo  # noqa: E402

sd = write_authors_repo(Path(sys.argv[2]) / "repo", model_type="base_loop")
model = from_pretrained_authors(Path(sys.argv[2]) / "repo")
ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    got = model(ids, use_cache=False).logits
expected = reference_forward(sd, ids, [1 / N_LOOPS] * N_LOOPS, model_type=ARCHITECTURE["base_loop"])
print(json.dumps(dict(
    kept=CONFIG_MAPPING["base_loop"] is SomeoneElsesConfig,
    ours={t: CONFIG_MAPPING[t].__module__ for t in ("tmlt", "tmlt_ee", "base_loop_ee", "base")},
    model=type(model).__name__,
    error=float((got - expected).abs().max()),
)))
"""


def test_a_model_type_someone_else_registered_survives_the_import_and_the_loader_still_loads(tmp_path):
    result, stderr = _run(TAKEN_SCRIPT, str(tmp_path))
    assert result["kept"], "import loopformer_hf replaced another library's 'base_loop'"
    assert set(result["ours"].values()) == {"loopformer_hf.authors.auto"}  # the free ones are ours
    warnings = [line for line in stderr.splitlines() if "already holds the model types" in line]
    assert len(warnings) == 1, stderr[-2000:]
    assert LOADER in warnings[0] and "'base_loop'" in warnings[0] and "SomeoneElsesConfig" in warnings[0]
    assert "'tmlt'" not in warnings[0]  # only the taken types are named
    assert result["model"] == "LoopFormerForCausalLM" and result["error"] < 1e-4


def test_without_another_registration_every_type_of_theirs_is_ours_and_nothing_is_said(caplog):
    with caplog.at_level("WARNING", logger="loopformer_hf.authors.auto"):
        assert auto.register_auto_classes() == []  # a second registration of ours changes nothing
    assert not caplog.records
    from transformers import CONFIG_MAPPING

    assert {t: CONFIG_MAPPING[t] for t in model_types.MODEL_TYPES if t != "loopformer"} == {
        c.model_type: c for c in auto.AUTHORS_CONFIG_CLASSES
    }


def test_the_loader_refuses_a_folder_of_ours_and_names_it(tmp_path):
    LoopFormerForCausalLM(LoopFormerConfig(num_loops=2, hidden_size=32, num_attention_heads=2)).save_pretrained(
        tmp_path / "ours"
    )
    with pytest.raises(ValueError, match=r"is not in the authors' layout .*load it with LoopFormerForCausalLM"):
        loopformer_hf.authors.from_pretrained_authors(tmp_path / "ours")
    with pytest.raises(ValueError, match=r"`model_class` must be LoopFormerForCausalLM or LoopFormerModel"):
        loopformer_hf.authors.from_pretrained_authors(tmp_path / "ours", model_class=dict)


# ---- 2. a config of our format never enters the authors' folder -------------------------------------------------------

OWN_FORMAT_SCRIPT = r"""
import json, sys, tempfile

import loopformer_hf
from loopformer_hf import LoopFormerConfig
from transformers import AutoConfig

config = LoopFormerConfig(num_loops=3, hidden_size=32, num_attention_heads=2, num_hidden_layers=2)
d = config.to_dict()
LoopFormerConfig(**d)
LoopFormerConfig.from_dict(d)
LoopFormerConfig.from_dict({k: v for k, v in d.items() if k != "loop_conditioning"})
folder = tempfile.mkdtemp()
config.save_pretrained(folder)
LoopFormerConfig.from_pretrained(folder)
AutoConfig.from_pretrained(folder)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("loopformer_hf.authors"))))
"""


def test_our_own_format_loads_none_of_the_authors_readers():
    """In a fresh process: the constructor, `from_dict`, `from_pretrained` and `AutoConfig` on configs of this
    package's format import no module of the authors' folder that reads files (only auto.py, the registrations)."""
    modules, _ = _run(OWN_FORMAT_SCRIPT)
    assert not [m for m in modules if m.rsplit(".", 1)[-1] in READERS], modules
    assert "loopformer_hf.authors.auto" in modules  # (the registrations: imported by `import loopformer_hf`)


def test_our_own_format_never_calls_the_authors_translation(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a config of our own format reached the authors' translation")

    for name in ("is_reference_config", "translated_config_dict", "authors_config_from_dict"):
        monkeypatch.setattr(auto, name, refuse)
    config = LoopFormerConfig(num_loops=3, hidden_size=32, num_attention_heads=2, default_loop_budget=2)
    d = config.to_dict()
    assert LoopFormerConfig(**d).to_dict() == d
    assert LoopFormerConfig.from_dict(d).to_dict() == d
    config.save_pretrained(tmp_path)
    assert LoopFormerConfig.from_pretrained(tmp_path).default_loop_budget == 2
    assert type(AutoConfig.from_pretrained(tmp_path)) is LoopFormerConfig
    with pytest.raises(AssertionError, match="reached the authors' translation"):  # (the patch is where it would go)
        LoopFormerConfig.from_dict({"model_type": "loopformer"})


# ---- 3. their repo through the Auto classes, no hook in the model classes -------------------------------------------


def test_auto_classes_load_their_repo_without_a_hook_in_the_model_classes(tmp_path, monkeypatch):
    """The model classes' `checkpoint_loaders` hook emptied (the lead's rewrite drops it): AutoConfig states the model
    that loads, AutoModelForCausalLM / AutoModel build plain classes of ours through `from_pretrained_authors`."""
    monkeypatch.setattr(LoopFormerPreTrainedModel, "checkpoint_loaders", [], raising=False)
    sd = write_authors_repo(tmp_path / "repo", model_type="tmlt")
    config = AutoConfig.from_pretrained(tmp_path / "repo")
    assert isinstance(config, auto.LoopFormerAuthorsConfig) and config.loop_conditioning == "timestep"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    assert type(model) is LoopFormerForCausalLM and type(model.config) is LoopFormerConfig
    keep = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert keep(config) == keep(model.config)  # AutoConfig is the config the model was built with
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = reference_forward(sd, ids, [1 / N_LOOPS] * N_LOOPS, model_type=ARCHITECTURE["tmlt"])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, expected, atol=1e-4, rtol=0)
    base = AutoModel.from_pretrained(tmp_path / "repo")
    assert type(base) is LoopFormerModel
    # what AutoConfig returned saves as a config of ours, and builds ours
    config.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "loopformer"
    assert type(AutoConfig.from_pretrained(tmp_path / "saved")) is LoopFormerConfig
    assert type(AutoModelForCausalLM.from_config(config)) is LoopFormerForCausalLM


def test_without_the_hook_a_model_class_refuses_their_repo_rather_than_loading_it_at_random(tmp_path, monkeypatch):
    """`LoopFormerForCausalLM.from_pretrained(<their repo>)` reaches the loader through the model classes'
    `checkpoint_loaders` hook; without it transformers would read their weights under our names (none matches) and
    initialise the model at random. The config's `get_config_dict` refuses that, naming the loader."""
    write_authors_repo(tmp_path / "repo")
    monkeypatch.setattr(LoopFormerPreTrainedModel, "checkpoint_loaders", [], raising=False)
    for model_class in (LoopFormerForCausalLM, LoopFormerModel):
        with pytest.raises(ValueError, match=rf"is one of the authors' repos.*AutoModelForCausalLM.*{LOADER}"):
            model_class.from_pretrained(tmp_path / "repo")
    assert LoopFormerConfig.from_pretrained(tmp_path / "repo").num_loops == N_LOOPS  # a config's caller: translated
