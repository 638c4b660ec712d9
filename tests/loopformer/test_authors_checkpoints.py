"""The authors' checkpoints (armenjeddi/LoopFormer-*, Base-Loop-*) load into our classes, exactly.

Stand-in repos are written here in their Hub layout, as their GitHub `GPT.from_pretrained` reads it: config.json
with their model type and nanoGPT keys (or the GPT-2 aliases their loader also accepts) and `steps`, weights named
as their `GPT`'s state dict under a wrapper prefix, the tied head stored once as `transformer.wte.weight`, their
generation_config.json and a tokenizer. Random weights; every logit is checked against the independent oracle of
tests/support/reference_oracle.py, never against our own modules.
"""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import loopformer_hf  # noqa: F401  (registers the Auto classes, theirs included)
from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM, LoopFormerModel

from support.hub_helpers import REPO_ROOT
from support.instruments import warnings_logged
from support.reference_oracle import (
    ARCHITECTURE,
    BLOCK,
    N_EMBD,
    N_HEAD,
    N_LAYER,
    N_LOOPS,
    VOCAB,
    reference_forward,
    reference_state_dict,
    write_authors_repo,
)

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


@pytest.mark.parametrize(
    "model_type,prefix",
    [("loopformer", "gpt."), ("base_loop", "model."), ("base_loop_ee", "module."), ("tmlt", "gpt.model.")],
)
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
    assert (config.max_position_embeddings, config.vocab_size, config.default_step_schedule) == (
        BLOCK,
        VOCAB,
        "uniform",
    )
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


def test_transformers_loading_options_work_as_for_llama(tmp_path, ids):
    """transformers' from_pretrained reads their repo: device_map, dtype and the loading report."""
    sd = write_authors_repo(tmp_path / "repo", stated=(), code=CODE)
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "repo", device_map={"": "cpu"}, dtype=torch.float16, output_loading_info=True
    )
    assert model.dtype == torch.float16 and model.device.type == "cpu"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    sd16 = {k: v.half().float() for k, v in sd.items()}
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, use_cache=False).logits.float(), reference_forward(sd16, ids, FULL), atol=0.05, rtol=0
        )


# ---- 2. never silently random ------------------------------------------------------------------------------------


def test_trust_remote_code_does_not_replace_the_registered_classes(tmp_path, ids):
    """With `import loopformer_hf` transformers uses the registered (local) classes even when the repo carries
    remote code and `trust_remote_code=True`; the authors' code runs in a process that does not import us."""
    sd = write_authors_repo(tmp_path / "repo")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", trust_remote_code=True)
    assert type(model) is LoopFormerForCausalLM
    assert_matches_oracle(model, sd, ids, "loopformer")


# ---- 3. the repos as published: a config.json that states no sizes ------------------------------------------------
# Public traces of armenjeddi/LoopFormer-3block-8iterations: a 296-byte config.json (architectures, auto_map, dtype,
# model_type, transformers_version); the sizes come from the configuration class in the repo's own code. Unknown:
# which keys the 1- and 2-block repos state. Every case below is loaded and checked against the oracle.

GITHUB_HEADS = 32  # their GitHub GPTConfig's n_head, the last source of a head count
CODE = {"n_head": str(N_HEAD), "n_embd": str(N_EMBD), "steps": f"[1/{N_LOOPS}]*{N_LOOPS}", "dropout": "0.0"}


def assert_computes_their_forward(model, sd, ids, model_type, n_head, loops):
    """The repo's default trajectory (M = L) and one shorter, against the oracle of their forward (fp32, 1e-4)."""
    arch = ARCHITECTURE[model_type]
    full, short = [1 / loops] * loops, ([0.5, 0.5] if model_type == "loopformer" else [1 / 2] * 2)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, use_cache=False).logits,
            reference_forward(sd, ids, full, n_head=n_head, model_type=arch),
            atol=1e-4,
            rtol=0,
        )
        torch.testing.assert_close(
            model(ids, step_schedule=short, use_cache=False).logits,
            reference_forward(sd, ids, short, n_head=n_head, model_type=arch),
            atol=1e-4,
            rtol=0,
        )


@pytest.mark.parametrize("model_type", ["loopformer", "base_loop", "base_loop_ee"])
@pytest.mark.parametrize("with_code", [False, True], ids=["no-code", "their-config-class"])
def test_a_config_that_states_no_sizes(tmp_path, ids, model_type, with_code):
    """Sizes from the weights; heads and trajectory from their configuration class (parsed, never run: its module
    raises when imported) or, without one, their GitHub defaults (32 heads, steps [1/8]*8 or 8)."""
    sd = write_authors_repo(
        tmp_path / "repo",
        model_type=model_type,
        stated=(),
        code=CODE if with_code else None,
        n_head=N_HEAD if with_code else GITHUB_HEADS,
    )
    config = json.loads((tmp_path / "repo" / "config.json").read_text())
    assert sorted(config) == ["architectures", "auto_map", "dtype", "model_type", "transformers_version"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    n_head, loops = (N_HEAD, N_LOOPS) if with_code else (GITHUB_HEADS, 8)
    assert (model.config.num_attention_heads, model.config.num_loops, model.config.hidden_size) == (
        n_head,
        loops,
        N_EMBD,
    )
    source = "configuration_loopformer.py's LoopFormerGPTConfig default" if with_code else None
    sources = model.config.authors_config_sources
    assert sources["num_attention_heads"] == (source or "their GitHub GPTConfig's default")
    assert sources["trajectory"] == (source or "their forward's default (steps=[1/8]*8 or 8)")
    assert_computes_their_forward(model, sd, ids, model_type, n_head, loops)


@pytest.mark.parametrize("model_type", ["loopformer", "base_loop", "base_loop_ee"])
@pytest.mark.parametrize("n_layer", [1, 2])
@pytest.mark.parametrize("trajectory_in", ["config.json", "code", "name", "nowhere"])
def test_one_and_two_block_repos_that_state_only_n_layer(tmp_path, ids, model_type, n_layer, trajectory_in):
    loops = {"config.json": 3, "code": N_LOOPS, "name": 6, "nowhere": 8}[trajectory_in]
    folder = tmp_path / (f"LoopFormer-{n_layer}block-{loops}iterations" if trajectory_in == "name" else "repo")
    steps = [1 / loops] * loops if model_type == "loopformer" else loops
    code = dict(CODE, n_layer="3", steps=repr(steps) if trajectory_in == "code" else "None")
    sd = write_authors_repo(
        folder,
        model_type=model_type,
        n_layer=n_layer,
        loops=loops,
        steps=steps,
        code=code,
        stated=("n_layer", "steps") if trajectory_in == "config.json" else ("n_layer",),
    )
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert (model.config.num_hidden_layers, model.config.num_loops) == (n_layer, loops)
    assert model.config.authors_config_sources["trajectory"].startswith(
        {
            "config.json": "config.json",
            "code": "configuration_loopformer.py",
            "name": "the repo's name",
            "nowhere": "their forward's default",
        }[trajectory_in]
    )
    assert_computes_their_forward(model, sd, ids, model_type, N_HEAD, loops)


def test_where_the_heads_and_trajectory_came_from_is_logged_once(tmp_path, caplog):
    import transformers

    write_authors_repo(tmp_path / "repo", stated=(), code=CODE)
    transformers.logging.set_verbosity_info()
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level("INFO", logger="loopformer_hf.authors.config"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    finally:
        transformers.logging.disable_propagation()
        transformers.logging.set_verbosity_warning()
    lines = [r.getMessage() for r in caplog.records if r.name == "loopformer_hf.authors.config"]
    assert len(lines) == 1 and f"{N_HEAD} attention heads from configuration_loopformer.py" in lines[0], lines
    assert "trajectory (L=4, uniform) from configuration_loopformer.py" in lines[0]


@pytest.mark.parametrize("where", ["config.json", "code"])
def test_steps_not_summing_to_one_are_refused_naming_the_sum(tmp_path, where):
    """Their forward would run t from 0 to 0.5 ([0.125]*4): refused, never renormalised to [0.25]*4."""
    steps = [0.125] * 4
    code = dict(CODE, steps=repr(steps)) if where == "code" else CODE
    write_authors_repo(tmp_path / "repo", steps=steps, code=code, stated=("steps",) if where == "config.json" else ())
    source = {"config.json": r"config\.json", "code": r"configuration_loopformer\.py's LoopFormerGPTConfig"}[where]
    with pytest.raises(
        ValueError, match=rf"`steps`=\[0\.125, 0\.125, 0\.125, 0\.125\] \({source}.*sum to 0\.5, not 1"
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_a_default_of_their_code_that_the_weights_contradict_is_named(tmp_path):
    write_authors_repo(tmp_path / "repo", stated=(), code=dict(CODE, n_layer="3"))  # 2 blocks stored
    with pytest.raises(
        ValueError,
        match=r"`n_layer`: configuration_loopformer\.py's LoopFormerGPTConfig default says "
        r"3, but the weights say 2",
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")


def test_their_architecture_name_and_dtype_spelling(tmp_path):
    write_authors_repo(tmp_path / "repo", stated=(), code=CODE, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "repo" / "config.json").read_text())
    assert config["architectures"] == ["LoopFormerGPTForCausalLM"] and config["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    assert type(model) is LoopFormerForCausalLM and model.dtype == torch.bfloat16
    assert model.config.architectures == ["LoopFormerForCausalLM"]


def test_a_head_stored_only_as_lm_head_loads_as_their_loader_does(tmp_path, ids):
    """Their `_fix_tied` fills transformer.wte.weight from lm_head.weight when only the head was saved."""
    sd = write_authors_repo(
        tmp_path / "repo",
        drop=("transformer.wte.weight",),
        extra={"gpt.lm_head.weight": reference_state_dict()["transformer.wte.weight"]},
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert_matches_oracle(model, sd, ids, "loopformer")


def test_saving_a_loaded_repo_writes_this_packages_layout(tmp_path):
    """The load hands transformers a state dict under our names: the loaded model keeps no conversion to revert on
    save, so the folder is ours."""
    from safetensors import safe_open

    write_authors_repo(tmp_path / "repo", stated=(), code=CODE)
    AutoModelForCausalLM.from_pretrained(tmp_path / "repo").save_pretrained(tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("c_attn" in n for n in names)
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["authors_config_sources"]["num_attention_heads"].startswith("configuration_loopformer.py")


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _shard(folder):
    """Their model.safetensors split into two shards with an index, as save_pretrained shards a large model."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("damage", ["truncated", "missing shard"])
def test_a_damaged_or_missing_weights_file_is_named_by_from_pretrained_and_the_converter(tmp_path, damage):
    folder = tmp_path / "repo"
    write_authors_repo(folder)
    if damage == "truncated":
        _truncate(folder / "model.safetensors")
        named = "model.safetensors"
    else:
        _shard(folder)
        (folder / "model-00002-of-00002.safetensors").unlink()
        named = "model-00002-of-00002.safetensors"
    with pytest.raises(OSError, match=named.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(folder)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopformer_hf.convert_authors",
            "--hub_repo",
            str(folder),
            "--output_dir",
            str(tmp_path / "out"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_sharded_repo_loads(tmp_path, ids):
    sd = write_authors_repo(tmp_path / "repo")
    _shard(tmp_path / "repo")
    assert_matches_oracle(AutoModelForCausalLM.from_pretrained(tmp_path / "repo"), sd, ids, "loopformer")


# ---- 4. AutoConfig is the config the model loads with (issue 55) ------------------------------------------------

SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "num_loops",
    "default_step_schedule",
    "loop_conditioning",
)


@pytest.mark.parametrize(
    "stated,code",
    [((), None), ((), CODE), (("n_layer",), None), (None, None)],
    ids=["nothing", "their-code", "n_layer-only", "all"],
)
def test_autoconfig_is_the_config_from_pretrained_builds(tmp_path, stated, code):
    """PEFT, vLLM, pipelines and finetune_lora read AutoConfig: it must state the sizes the model loads with
    (before: their GitHub defaults 2048 wide, 1024 context, while the model was 64 / 64)."""
    from transformers import AutoConfig

    write_authors_repo(tmp_path / "repo", stated=stated, code=code, n_head=N_HEAD if code or stated is None else 32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    for config in (AutoConfig.from_pretrained(tmp_path / "repo"), LoopFormerConfig.from_pretrained(tmp_path / "repo")):
        assert {k: getattr(config, k) for k in SIZES} == {k: getattr(model.config, k) for k in SIZES}
        assert (config.hidden_size, config.max_position_embeddings, config.num_hidden_layers) == (
            N_EMBD,
            BLOCK,
            N_LAYER,
        )
        assert config.authors_config_sources == model.config.authors_config_sources


def _warnings_of(caplog, load):
    return warnings_logged(caplog, "loopformer_hf.authors.config", load)


def test_an_assumed_head_count_is_a_warning_that_names_it(tmp_path, caplog):
    write_authors_repo(tmp_path / "repo", stated=(), n_head=GITHUB_HEADS)  # no n_head anywhere, no code
    model, lines = _warnings_of(caplog, lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "repo"))
    assert model.config.num_attention_heads == GITHUB_HEADS
    heads = [line for line in lines if "attention-head count" in line]
    assert len(heads) == 1 and f"assumed {GITHUB_HEADS}, their GitHub GPTConfig's default" in heads[0], lines
    assert "num_attention_heads=N" in heads[0]


def test_a_loop_count_the_repos_name_contradicts_is_stated(tmp_path, caplog):
    """A 1x24 repo whose code says steps=[1/8]*8: the code is taken (L=8), and the warning says so."""
    folder = tmp_path / "LoopFormer-1block-24iterations"
    write_authors_repo(folder, stated=(), n_layer=1, loops=8, code=dict(CODE, n_layer="1", steps="[1/8]*8"))
    model, lines = _warnings_of(caplog, lambda: AutoModelForCausalLM.from_pretrained(folder))
    assert (model.config.num_hidden_layers, model.config.num_loops) == (1, 8)
    (line,) = [line for line in lines if "loop steps" in line]
    assert "L=8 loop steps from configuration_loopformer.py" in line and "1block-24iterations" in line
    assert "num_loops=24" in line


def test_a_tensor_of_the_wrong_shape_is_named_before_any_loading_report(tmp_path, capfd):
    """transformers printed a LOAD REPORT (reading as success) and then raised its RuntimeError (issue 55)."""
    write_authors_repo(
        tmp_path / "repo", extra={"gpt.transformer.h.blocks.0.attn.c_attn.weight": torch.zeros(192, 32)}
    )
    with pytest.raises(
        ValueError,
        match=r"gpt\.transformer\.h\.blocks\.0\.attn\.c_attn\.weight has shape \(192, 32\), "
        r"the model needs \(192, 64\)",
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "MISMATCH" not in out + err
