"""The authors' checkpoints (Hub fixed-point-reasoners/fprm, folders sudoku/ and maze/) load, compute and
halt as published.

The stand-ins are built from their code and files (tests/support/fprm_reference_oracle.py): their state dict at the
real sizes (d 512, 2 blocks, 16 prefix rows; 26 keys, 13,656,578 values for Sudoku, as a third-party loader records
for sudoku/step_78120), saved as their pretrain.py saves it (`_orig_mod.model.inner.*`, no extension), with
all_config.yaml in sudoku/ and none in maze/. The oracle is the re-implementation of their forward in that file.
"""

import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from fprm_hf import FPRMConfig, FPRMForReasoning, FPRMModel
from fprm_hf.authors.checkpoints import PublishedCheckpointError
from support import REPO_ROOT
from support.fprm_reference_oracle import PUBLISHED_STEPS, Reference, published_settings, write_published_folder

TOL = dict(rtol=1e-4, atol=1e-4)
NEWEST, OLDER = max(PUBLISHED_STEPS), min(PUBLISHED_STEPS)
# the model file their pretrain.py copies beside a run: loading must never import or run it
COPIED_SOURCE = "import pathlib\npathlib.Path(__file__).with_name('EXECUTED').write_text('ran')\nraise SystemExit(3)\n"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A local copy of the Hub repo's layout: sudoku/ (steps, all_config.yaml, the copied model file), maze/ (steps)."""
    root = tmp_path_factory.mktemp("fprm-published")
    weights = {
        "sudoku": write_published_folder(root / "sudoku", "sudoku", model_source=COPIED_SOURCE),
        "maze": write_published_folder(root / "maze", "maze", with_yaml=False),
    }
    return root, weights


@pytest.fixture(scope="module")
def sudoku(repo):
    return FPRMForReasoning.from_pretrained(repo[0], subfolder="sudoku").eval()


# ---- 1. loads as published ----------------------------------------------------------------------------------------


def test_the_newest_step_loads_with_the_values_of_the_files(repo, sudoku):
    root, weights = repo
    c = sudoku.config
    assert c.authors_checkpoint["step"] == NEWEST and c.authors_checkpoint["file"] == f"sudoku/step_{NEWEST}"
    # from the tensors
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (11, 512, 2, 1536)
    assert (c.conv_type, c.conv_kernel_size, c.conv_bias, c.num_prefix_tokens) == ("2d", 3, False, 16)
    assert (c.residual_scaling, c.puzzle_emb_ndim, c.num_puzzle_identifiers, c.use_q_head) == (
        "input_independent",
        512,
        1,
        True,
    )
    # from all_config.yaml, their defaults and the data path
    assert (c.num_attention_heads, c.alpha1, c.alpha2, c.init_std, c.norm_placement) == (8, 0.75, 0.25, 6.0, "none")
    assert (c.halt_eps, c.gamma_eval, c.patience, c.max_loops, c.rms_norm_eps, c.causal) == (
        0.1,
        0.99,
        5,
        1000,
        1e-5,
        False,
    )
    assert c.grid_size == [9, 9] and c.fixed_init is False and c.halt_scope == "sample"
    sources = c.authors_checkpoint["sources"]
    assert sources["num_heads"] == "all_config.yaml arch.num_heads"
    assert sources["rms_norm_eps"].endswith("models/config.py ReasoningModelConfig default")
    assert sources["stepsize_decay_eval"].endswith("fprm_config.py FPRMConfig default") is False  # the YAML states it
    assert "data/sudoku-extreme-1k-aug-1000" in sources["seq_len"] and sources["hidden_size"].startswith("weights:")
    # the weights are the newest step's
    theirs = weights["sudoku"][NEWEST]
    torch.testing.assert_close(sudoku.model.embed_tokens.weight, theirs["model.inner.embed_tokens.embedding_weight"])
    torch.testing.assert_close(sudoku.q_head.bias, theirs["model.inner.q_head.bias"])


def test_where_each_value_came_from_is_logged(repo, caplog):
    import transformers

    root, _ = repo
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level("INFO", logger="fprm_hf.authors.checkpoints"):
            FPRMForReasoning.from_pretrained(root / "sudoku", step=OLDER)
    finally:
        transformers.logging.disable_propagation()
    lines = [r.getMessage() for r in caplog.records if r.name == "fprm_hf.authors.checkpoints"]
    line = next(m for m in lines if f"step_{OLDER}: " in m and "num_heads from" in m)
    assert "num_heads from all_config.yaml arch.num_heads" in line
    assert "hidden_size from weights: embed_tokens.embedding_weight (11, 512)" in line
    assert "rms_norm_eps from GitHub nilskiKonjIzDunava/fprm models/config.py ReasoningModelConfig default" in line


def test_step_picks_another_and_an_unknown_step_is_named(repo):
    root, weights = repo
    older = FPRMForReasoning.from_pretrained(root / "sudoku", step=OLDER)
    assert older.config.authors_checkpoint["step"] == OLDER
    torch.testing.assert_close(older.lm_head.weight, weights["sudoku"][OLDER]["model.inner.lm_head.weight"])
    with pytest.raises(PublishedCheckpointError, match=rf"has no step_12345; its steps: \[{OLDER}, {NEWEST}\]"):
        FPRMForReasoning.from_pretrained(root / "sudoku", step=12345)


def test_the_config_class_and_the_auto_classes_give_the_same_model(repo, sudoku):
    """`FPRMConfig.from_pretrained` derives the config from the files; `AutoConfig`, which reads config.json alone
    (nothing of transformers' is patched), gives transformers' own error, and the Auto model classes load the folder
    given that config."""
    root, _ = repo
    config = FPRMConfig.from_pretrained(root, subfolder="sudoku")
    assert isinstance(config, FPRMConfig) and config.to_dict() == sudoku.config.to_dict()
    with pytest.raises((OSError, ValueError), match="config.json"):  # transformers' own (an empty local folder's)
        AutoConfig.from_pretrained(root, subfolder="sudoku")
    auto = AutoModelForTokenClassification.from_pretrained(root, subfolder="sudoku", config=config)
    assert isinstance(auto, FPRMForReasoning)
    assert all(torch.equal(v, sudoku.state_dict()[k]) for k, v in auto.state_dict().items())
    base = FPRMModel.from_pretrained(root / "maze", step=OLDER)
    assert isinstance(base, FPRMModel) and base.config.authors_checkpoint["step"] == OLDER
    assert FPRMConfig.from_pretrained(root / "maze", step=OLDER).to_dict() == base.config.to_dict()


def test_the_maze_folder_states_no_yaml_so_their_maze_experiment_config_is_named(repo, caplog):
    import transformers

    root, _ = repo
    transformers.utils.logging.warning_once.cache_clear()  # said once per process: an earlier test may have said it
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level("WARNING", logger="fprm_hf.authors.checkpoints"):
            maze = FPRMForReasoning.from_pretrained(root / "maze")
    finally:
        transformers.logging.disable_propagation()
    c = maze.config
    assert (c.vocab_size, c.conv_type, c.conv_kernel_size, c.norm_placement, c.grid_size) == (
        6,
        "causal_1d",
        4,
        "output",
        [30, 30],
    )
    assert (c.num_attention_heads, c.alpha1, c.alpha2, c.init_std, c.max_loops) == (8, 0.75, 0.25, 6.0, 1000)
    assert "cfg_pretrain_maze.yaml" in c.authors_checkpoint["sources"]["num_heads"]
    assert "maze-30x30-hard-1k-noaug" in c.authors_checkpoint["sources"]["seq_len"]
    warned = [r.getMessage() for r in caplog.records if r.name == "fprm_hf.authors.checkpoints"]
    assert any("states no all_config.yaml" in w and "cfg_pretrain_maze.yaml" in w for w in warned), warned


def test_round_trip_and_publish_with_a_card_crediting_their_repo_and_step(repo, sudoku, tmp_path):
    sudoku.save_pretrained(tmp_path / "saved")
    again = FPRMForReasoning.from_pretrained(tmp_path / "saved").eval()
    drop = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert drop(again.config.to_dict()) == drop(sudoku.config.to_dict())
    assert sudoku.state_dict().keys() == again.state_dict().keys()
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in sudoku.state_dict().items())
    ids = torch.randint(1, 11, (2, 81), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(ids, max_loops=3).logits, sudoku(ids, max_loops=3).logits, rtol=0, atol=0)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "looped_training.publish",
            "--checkpoint",
            str(tmp_path / "saved"),
            "--repo_id",
            "someone/fprm-sudoku",
            "--dry_run",
            "--stage_dir",
            str(tmp_path / "stage"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    card = (tmp_path / "stage" / "README.md").read_text()
    assert f"`sudoku/step_{NEWEST}` read from `{repo[0]}`, a folder in the layout of their Hub repo" in card
    assert "[fixed-point-reasoners/fprm](https://huggingface.co/fixed-point-reasoners/fprm)" in card
    assert "nilskiKonjIzDunava/fprm" in card


HUB_SCRIPT = """
import sys, json, torch, fprm_hf
from fprm_hf import FPRMConfig, FPRMForReasoning
from looped_training.publish import main as publish
model = FPRMForReasoning.from_pretrained("fixed-point-reasoners/fprm", subfolder="sudoku")
older = FPRMForReasoning.from_pretrained("fixed-point-reasoners/fprm", subfolder="sudoku", step=10)
same = FPRMConfig.from_pretrained("fixed-point-reasoners/fprm", subfolder="sudoku").to_dict() == model.config.to_dict()
model.save_pretrained(sys.argv[1] + "/saved")
code = publish(["--checkpoint", sys.argv[1] + "/saved", "--repo_id", "me/fprm", "--dry_run", "--stage_dir",
                sys.argv[1] + "/stage"])
print(json.dumps(dict(step=model.config.authors_checkpoint["step"], older=older.config.authors_checkpoint["step"],
                      repo=model.config.authors_checkpoint["repo"], same=same, publish=code,
                      hidden=model.config.hidden_size)))
"""


def test_from_the_hub_by_repo_id_and_subfolder(tmp_path):
    """The call users make, against a Hub server holding a (small) stand-in of the repo: the newest step of the
    listing, `step=` another, FPRMConfig the same config, the card naming their repo."""
    import json
    import os

    import huggingface_hub.constants
    from huggingface_hub import HfApi
    from support.hub_server import HubServer

    write_published_folder(
        tmp_path / "repo" / "sudoku", "sudoku", steps=(10, 20), hidden_size=64, num_heads=4, puzzle_emb_ndim=64
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_XET": "1"}
    with pytest.MonkeyPatch.context() as patch, HubServer(tokens={"hf_token"}) as hub:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        api = HfApi(endpoint=hub.endpoint, token="hf_token")
        api.create_repo("fixed-point-reasoners/fprm")
        api.upload_folder(folder_path=str(tmp_path / "repo"), repo_id="fixed-point-reasoners/fprm")
        done = subprocess.run(
            [sys.executable, "-c", HUB_SCRIPT, str(tmp_path)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(env, HF_ENDPOINT=hub.endpoint, HF_HUB_OFFLINE="0"),
        )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == dict(step=20, older=10, repo="fixed-point-reasoners/fprm", same=True, publish=0, hidden=64)
    card = (tmp_path / "stage" / "README.md").read_text()
    assert "`sudoku/step_20` of their Hub repo [fixed-point-reasoners/fprm]" in card
    # offline, the cache serves a step named by `step=`; without one the folder cannot be listed, and says so
    offline = dict(env, HF_HUB_OFFLINE="1")
    load = (
        "from fprm_hf import FPRMForReasoning; m = FPRMForReasoning.from_pretrained('fixed-point-reasoners/fprm', "
        "subfolder='sudoku'{}); print(m.config.authors_checkpoint['step'])"
    )
    cached = subprocess.run(
        [sys.executable, "-c", load.format(", step=20")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=offline,
    )
    assert cached.returncode == 0 and cached.stdout.split()[-1] == "20", cached.stderr[-3000:]
    unlisted = subprocess.run(
        [sys.executable, "-c", load.format("")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=offline,
    )
    assert unlisted.returncode != 0 and "the Hub could not be listed: pass step=N" in unlisted.stderr


# ---- 2. safe -------------------------------------------------------------------------------------------------------


def test_nothing_is_executed_and_a_pickle_is_refused(repo, tmp_path):
    import argparse

    root, _ = repo
    assert (root / "sudoku" / "fp_trm_singlez.py").exists() and not (root / "sudoku" / "EXECUTED").exists()
    folder = tmp_path / "sudoku"
    folder.mkdir()
    torch.save({"model": argparse.Namespace(x=1)}, folder / "step_10")  # an object only pickle can rebuild
    with pytest.raises(PublishedCheckpointError, match=r"step_10: refused, it needs pickle") as error:
        FPRMForReasoning.from_pretrained(folder)
    assert "\n" not in str(error.value) and "\x1b" not in str(error.value)  # one line, no terminal escapes
    assert str(error.value).endswith("argparse.Namespace was not an allowed global by default.")


# ---- 3. exact ------------------------------------------------------------------------------------------------------


def _against_their_forward(model, sd, task, batch, iterations, dtype=torch.float32):
    """States, residuals and logits after 1 and after `iterations` iterations from the same z0, eval mode."""
    s = published_settings(task)
    ref = Reference(sd, s)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, s["vocab_size"], (batch, s["seq_len"]), generator=g)
    puzzles = torch.zeros(batch, dtype=torch.long)
    core = model.model
    with torch.no_grad():
        x = core.embed(ids, puzzles)
        ref_x = ref.input_embeddings(ids, puzzles)
        torch.testing.assert_close(x, ref_x, **TOL)
        state = core.initial_solver_state(x, generator=torch.Generator().manual_seed(11))
        ref_state = ref.reset(state.hidden.clone())
        cos_sin = ref.cos_sin(ref_x.shape[1])
        for it in range(1, iterations + 1):
            ref_state = ref.step(ref_state, ref.L_level(ref_state["y"], ref_x, cos_sin), training=False)
            out = model(ids, puzzle_identifiers=puzzles, solver_state=state, max_loops=1, halting=False)
            state = out.solver_state
            torch.testing.assert_close(state.residuals, ref_state["residues"], **TOL)
            if it in (1, iterations):
                torch.testing.assert_close(out.logits, ref.logits(ref_state["y"]), **TOL)
    return state


def test_sudoku_computes_their_forward_at_the_real_size(repo, sudoku):
    _, weights = repo
    sd = weights["sudoku"][NEWEST]
    state = _against_their_forward(sudoku, sd, "sudoku", batch=2, iterations=20)
    assert state.iterations.tolist() == [20, 20]


def test_maze_computes_their_forward_at_the_real_size(repo):
    root, weights = repo
    maze = FPRMForReasoning.from_pretrained(root / "maze").eval()
    _against_their_forward(maze, weights["maze"][NEWEST], "maze", batch=1, iterations=6)


def test_bf16_their_forward_dtype_runs(repo):
    root, _ = repo
    bf16 = FPRMForReasoning.from_pretrained(root / "sudoku", dtype=torch.bfloat16).eval()
    fp32 = FPRMForReasoning.from_pretrained(root / "sudoku").eval()
    assert bf16.dtype == torch.bfloat16
    ids = torch.randint(1, 11, (2, 81), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        low, high = bf16(ids, max_loops=1), fp32(ids, max_loops=1)
    assert low.logits.dtype == torch.bfloat16 and bool(torch.isfinite(low.logits).all())
    scale = float(high.logits.abs().max())
    assert float((low.logits.float() - high.logits).abs().max()) < 0.05 * scale


# ---- 4. halting as they evaluate --------------------------------------------------------------------------------


def _their_batch_halting(model, ids, max_loops=60):
    """Their evaluation loop (models/fixed_point_reasoning/fprm.py, `if not self.training`), one iteration at a time:
    every row iterates until the batch's largest residual < fp_thresh or largest step size < 1e-3."""
    state = None
    for step in range(1, max_loops + 1):
        out = model(ids, solver_state=state, max_loops=1, halting=False)
        state = out.solver_state
        if float(state.residuals.max()) < model.config.halt_eps or float(state.eta.max()) < 1e-3:
            return step, out
    return max_loops, out


def test_batch_halting_stops_every_row_at_their_rule_and_differs_from_per_sample():
    torch.manual_seed(0)
    config = FPRMConfig(
        vocab_size=6,
        grid_size=4,
        conv_type="2d",
        hidden_size=32,
        num_attention_heads=4,
        num_prefix_tokens=0,
        init_std=1.0,
        halt_eps=1e-3,
        max_loops=60,
    )
    model = FPRMForReasoning(config).eval()
    ids = torch.randint(0, 6, (6, 16), generator=torch.Generator().manual_seed(4))
    per_sample = model(ids)
    batch = model(ids, halt_scope="batch")
    steps, theirs = _their_batch_halting(model, ids, max_loops=60)
    # the batch rule: every row ran the same number of iterations, the step their loop stops at
    assert batch.iterations.tolist() == [steps] * 6
    torch.testing.assert_close(batch.logits, theirs.logits, rtol=0, atol=0)
    # per sample: each row stopped at its own first r < τ, which differs between rows here
    assert len(set(per_sample.iterations.tolist())) > 1 and max(per_sample.iterations.tolist()) == steps
    trace = model(ids, max_loops=steps, halting=False, output_residual_trace=True).residual_trace
    first_below = [int((row < config.halt_eps).nonzero()[0]) + 1 for row in trace]
    assert per_sample.iterations.tolist() == first_below
    # the config field does the same as the argument, in evaluation mode only
    model.config.halt_scope = "batch"
    assert model(ids).iterations.tolist() == [steps] * 6
    with pytest.raises(ValueError, match=r"`halt_scope` must be one of \('sample', 'batch'\), got 'rows'"):
        model(ids, halt_scope="rows")


# ---- bad input -----------------------------------------------------------------------------------------------------


def _folder(tmp_path, name="sudoku", **kwargs):
    folder = tmp_path / name
    write_published_folder(folder, name, steps=(10,), **kwargs)
    return folder


def test_a_folder_without_step_files_is_named(tmp_path):
    (tmp_path / "sudoku").mkdir()
    (tmp_path / "sudoku" / "all_config.yaml").write_text("arch: {name: x, loss: {name: y}}\n")
    with pytest.raises(PublishedCheckpointError, match=r"sudoku holds no step_N files \(its files: \['all_config"):
        FPRMForReasoning.from_pretrained(tmp_path / "sudoku")


def test_a_truncated_step_file_is_named(tmp_path):
    folder = _folder(tmp_path)
    data = (folder / "step_10").read_bytes()
    (folder / "step_10").write_bytes(data[: len(data) // 2])
    with pytest.raises(PublishedCheckpointError, match=r"step_10: not a readable torch state dict") as error:
        FPRMForReasoning.from_pretrained(folder)
    assert "\n" not in str(error.value)


def test_a_step_file_in_torchs_legacy_serialization_loads_as_the_zip_one(tmp_path):
    # issue 64: refused as "truncated or damaged?" (a legacy file cannot be memory-mapped); it is a valid file
    folder, legacy_folder = _folder(tmp_path), tmp_path / "legacy" / "sudoku"
    zipped = FPRMForReasoning.from_pretrained(folder).state_dict()
    legacy_folder.mkdir(parents=True)
    state = torch.load(folder / "step_10", weights_only=True)
    torch.save(state, legacy_folder / "step_10", _use_new_zipfile_serialization=False)
    legacy = FPRMForReasoning.from_pretrained(legacy_folder).state_dict()
    assert legacy.keys() == zipped.keys() and all(torch.equal(legacy[k], zipped[k]) for k in zipped)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("norm_type", "sandwich", r"`norm_type` must be one of .* got 'sandwich'"),
        ("mlp_t", True, r"unsupported settings: mlp_t=True"),
        ("hidden_size", 256, r"all_config.yaml arch states hidden_size=256, the weights show 512"),
        ("conv_type", "conv1d", r"states conv_type='conv1d', the weights show 'conv2d'"),
    ],
)
def test_a_yaml_value_their_code_or_the_weights_reject_is_named(tmp_path, field, value, message):
    import yaml

    folder = _folder(tmp_path)
    dump = yaml.safe_load((folder / "all_config.yaml").read_text())
    dump["arch"][field] = value
    (folder / "all_config.yaml").write_text(yaml.dump(dump))
    with pytest.raises(ValueError, match=message):
        FPRMForReasoning.from_pretrained(folder)
    with pytest.raises(ValueError, match=message):
        FPRMConfig.from_pretrained(folder)


def test_a_yaml_field_their_config_does_not_define_is_warned_and_ignored_as_theirs_does(tmp_path, caplog):
    import transformers
    import yaml

    folder = _folder(tmp_path)
    dump = yaml.safe_load((folder / "all_config.yaml").read_text())
    dump["arch"]["scale_init"] = 2.0
    (folder / "all_config.yaml").write_text(yaml.dump(dump))
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level("WARNING", logger="fprm_hf.authors.checkpoints"):
            model = FPRMForReasoning.from_pretrained(folder)
    finally:
        transformers.logging.disable_propagation()
    assert model.config.hidden_size == 512
    assert any("['scale_init']" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_folder_nothing_determines_the_heads_of_is_refused_naming_them(tmp_path):
    folder = _folder(tmp_path, name="sudoku", with_yaml=False)
    renamed = folder.rename(tmp_path / "mine")  # no YAML and no task in the name: nothing states num_heads
    with pytest.raises(
        PublishedCheckpointError, match=r"nothing determines \['num_heads', 'seq_len', 'pos_encodings'\]"
    ):
        FPRMForReasoning.from_pretrained(renamed)


def test_a_folder_with_a_config_json_is_not_read_as_theirs(tmp_path):
    folder = tmp_path / "ours"
    FPRMForReasoning(
        FPRMConfig(vocab_size=6, grid_size=4, conv_type="2d", hidden_size=32, num_attention_heads=4)
    ).save_pretrained(folder)
    (folder / "step_10").write_bytes(b"not read")
    assert FPRMForReasoning.from_pretrained(folder).config.hidden_size == 32
    with pytest.raises((OSError, ValueError), match="config.json"):  # transformers' own answer, unchanged
        AutoConfig.from_pretrained(tmp_path)


def test_a_config_of_our_format_never_enters_the_authors_folder(tmp_path, monkeypatch):
    """`FPRMConfig(**d)`, `FPRMConfig.from_dict(d)` and `from_pretrained` of a folder of ours read no file of theirs:
    every reader of fprm_hf/authors/ raises here, and none is reached (issue 72, item 7)."""
    import fprm_hf.authors.checkpoints as checkpoints
    import fprm_hf.authors.layout as layout
    import fprm_hf.authors.settings as settings

    def refuse(*args, **kwargs):
        raise AssertionError("a config of our own format reached the authors' readers")

    for module, name in [
        (checkpoints, "is_authors_layout"),
        (checkpoints, "authors_checkpoint_config"),
        (checkpoints, "read_step_file"),
        (checkpoints, "read_arch"),
        (settings, "resolve_settings"),
        (layout, "build_config"),
        (layout, "map_reference_state_dict"),
    ]:
        monkeypatch.setattr(module, name, refuse)
    config = FPRMConfig(hidden_size=32, num_attention_heads=4, recursion="trm", H_cycles=2)
    d = config.to_dict()
    assert FPRMConfig(**d).to_dict() == d
    assert FPRMConfig.from_dict(d).to_dict() == d
    config.save_pretrained(tmp_path)
    assert FPRMConfig.from_pretrained(tmp_path).H_cycles == 2
    assert type(AutoConfig.from_pretrained(tmp_path)) is FPRMConfig
