"""The bad-input registry's LoopFormer rows: its config, forward and generate, per-row knobs, loading (its own saves
and the authors' Hub repos) and its converter; with the tiny model and folders they run on."""

import json
from functools import lru_cache
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from support.bad_inputs.shared import LF, Case, _truncated, cli, command, field_error, refused_setting

# ---- tiny models, built once -------------------------------------------------------------------------------------


def loopformer_config(**overrides):
    from support.tiny_models import tiny_loopformer_config

    kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=32)
    return tiny_loopformer_config(**{**kwargs, **overrides})


@lru_cache(maxsize=None)
def loopformer():
    from loopformer_hf import LoopFormerForCausalLM

    torch.manual_seed(0)
    return LoopFormerForCausalLM(loopformer_config()).eval()


def shortcut_consistency(*args, **kwargs):
    from loopformer_hf import ShortcutConsistency

    return ShortcutConsistency(*args, **kwargs)


IDS = torch.tensor([[3, 4, 5]])
IDS2 = IDS.repeat(2, 1)  # a batch of two rows, for per-row knobs


def loopformer_pickle_as_safetensors(tmp):
    """As `pickle_as_safetensors`, for a saved LoopFormer folder."""
    folder = Path(tmp) / "model"
    loopformer().save_pretrained(folder)
    torch.save({"weight": torch.zeros(2)}, folder / "model.safetensors")
    return folder


def without_num_loops(tmp):
    """A saved LoopFormer folder whose config.json lost its `num_loops` (written by hand, or by another tool)."""
    folder = Path(tmp) / "model"
    loopformer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["num_loops"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def authors_repo(tmp, config=None, **kwargs):
    """A stand-in repo in the layout of the authors' Hub checkpoints (tests/support/reference_oracle.py), its config.json
    updated with `config`."""
    from support.reference_oracle import write_authors_repo

    folder = Path(tmp) / "authors"
    write_authors_repo(folder, **kwargs)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def auto_load(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def from_authors_repo(tmp, **kwargs):
    return auto_load(authors_repo(tmp, **kwargs))


def _restate(folder, **values):
    """`folder` with config.json stating `values` as well."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, **values)))
    return folder


LF_CONVERT = cli("loopformer_hf.convert_authors")
LF_CONVERT_CMD = command("loopformer_hf.convert_authors")


def saved_with_invalid_generation_loop_budget(tmp):
    import copy

    model = copy.deepcopy(loopformer())
    model.generation_config.loop_budget = -3
    model.save_pretrained(Path(tmp) / "model")


def loopformer_config_folder(tmp):
    """A folder with a LoopFormer config.json (what finetune_lora reads before loading the model)."""
    folder = Path(tmp) / "base"
    loopformer_config().save_pretrained(folder)
    return folder


CASES = [
    # LoopFormer configuration (the same check runs for config.json, from_pretrained kwargs and attribute sets)
    *(
        refused_setting(f"{LF} config", loopformer_config, field, value, message)
        for field, value, message in (
            ("default_loop_budget", -3, field_error("default_loop_budget", "positive integer, got -3")),
            ("default_loop_budget", 0, field_error("default_loop_budget", "positive integer, got 0")),
            (
                "default_loop_budget",
                2.5,
                field_error("default_loop_budget", r"expected int, got float \(value: 2\.5\)"),
            ),
            (
                "halt_kv_fill",
                "bogus",
                field_error("halt_kv_fill", r"expected one of \('recompute', 'reuse'\), got bogus"),
            ),
            *(
                (flag, "no", field_error(flag, r"expected bool, got str \(value: 'no'\)"))
                for flag in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_cache")
            ),
            ("num_loops", 0, field_error("num_loops", "positive integer, got 0")),
            ("default_loop_budget", 64, r"`default_loop_budget`=64 exceeds .*max_loop_budget=32"),
        )
    ),
    # RoPE settings (position_embedding_type="rope"), checked as transformers' `rope_parameters`
    *(
        Case(
            f"{LF} config",
            f"position_embedding_type='rope', rope_parameters={value!r}",
            lambda t, value=value: loopformer_config(position_embedding_type="rope", rope_parameters=value),
            StrictDataclassError,
            message,
        )
        for value, message in (
            ("yarn", field_error("rope_parameters", r"expected dict, got str \(value: 'yarn'\)")),
            ({"rope_type": "nope"}, r"rope_type.*must be one of \('default', 'linear'.*got 'nope'"),
            ({"rope_type": "linear", "factor": -2.0}, r"'factor'.*positive number, got -2\.0"),
            ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor.*\(0, 1\], got 1\.5"),
            ({"rope_type": "linear"}, r"rope_parameters.*Missing required keys .*'factor'"),
        )
    ),
    Case(
        f"{LF} config",
        "rope_parameters={'rope_type': 'linear', 'factor': 2.0} with learned positions",
        lambda t: loopformer_config(rope_parameters={"rope_type": "linear", "factor": 2.0}),
        StrictDataclassError,
        r"rope_parameters.*apply to position_embedding_type='rope'.*'learned'",
    ),
    Case(
        f"{LF} config",
        "hidden_size=30, num_attention_heads=4",
        lambda t: loopformer_config(hidden_size=30),
        StrictDataclassError,
        r"divisible by `num_attention_heads`",
    ),
    Case(
        f"{LF} config",
        "config.max_loop_budget_factor = 0 (attribute set)",
        lambda t: setattr(loopformer_config(), "max_loop_budget_factor", 0),
        StrictDataclassError,
        field_error("max_loop_budget_factor", "positive integer, got 0"),
    ),
    # LoopFormer forward / generate
    Case(
        f"{LF} forward",
        "loop_budget=10**6",
        lambda t: loopformer()(IDS, loop_budget=10**6),
        ValueError,
        r"exceeds the largest loop budget.*max_loop_budget=32",
    ),
    Case(
        f"{LF} forward",
        "loop_budget=2.5",
        lambda t: loopformer()(IDS, loop_budget=2.5),
        ValueError,
        r"loop_budget.*integer >= 1, got 2\.5",
    ),
    Case(
        f"{LF} forward",
        "step_schedule=[0.5, 0.4]",
        lambda t: loopformer()(IDS, step_schedule=[0.5, 0.4]),
        ValueError,
        r"must sum to 1",
    ),
    Case(
        f"{LF} forward",
        "step_schedule='bogus'",
        lambda t: loopformer()(IDS, step_schedule="bogus"),
        ValueError,
        r"step_schedule.*got 'bogus'",
    ),
    # per-row knobs (tests/loopformer/test_trajectory_per_row.py), on a batch of two rows
    Case(
        f"{LF} forward",
        "loop_budget=[1, 2, 4] for a batch of 2",
        lambda t: loopformer()(IDS2, loop_budget=[1, 2, 4]),
        ValueError,
        r"`loop_budget` gives 3 values, one per row, but the batch has 2 rows",
    ),
    Case(
        f"{LF} forward",
        "loop_budget=torch.tensor([2, 0])",
        lambda t: loopformer()(IDS2, loop_budget=torch.tensor([2, 0])),
        ValueError,
        r"Row 1 of the batch: `loop_budget` must be an integer >= 1, got 0",
    ),
    Case(
        f"{LF} generate",
        "loop_budget=[]",
        lambda t: loopformer().generate(IDS, max_new_tokens=1, loop_budget=[]),
        ValueError,
        r"`loop_budget` is empty \(\[\]\): give an integer >= 1 for the whole batch, or one per row",
    ),
    Case(
        f"{LF} forward",
        "loop_budget=torch.tensor(3) (0-dim)",
        lambda t: loopformer()(IDS, loop_budget=torch.tensor(3)),
        ValueError,
        r"got a 0-dim tensor tensor\(3\): give an int .* or a 1-D integer tensor with one budget per row",
    ),
    Case(
        f"{LF} forward",
        "loop_budget=[2, 10**6]",
        lambda t: loopformer()(IDS2, loop_budget=[2, 10**6]),
        ValueError,
        r"Row 1 of the batch: `loop_budget`=1000000 exceeds the largest loop budget",
    ),
    Case(
        f"{LF} forward",
        "step_schedule=[None, [0.5, 0.4]]",
        lambda t: loopformer()(IDS2, step_schedule=[None, [0.5, 0.4]]),
        ValueError,
        r"Row 1 of the batch: .*must sum to 1",
    ),
    Case(
        f"{LF} forward",
        "step_schedule=[[0.5, 0.5], None] with loop_budget=3",
        lambda t: loopformer()(IDS2, loop_budget=3, step_schedule=[[0.5, 0.5], None]),
        ValueError,
        r"Row 0 of the batch: `loop_budget`=3 disagrees with `step_schedule` of length 2",
    ),
    Case(
        f"{LF} forward",
        "halt_eps=0.1, halt_criterion='kl' (an argument removed from the library)",
        lambda t: loopformer()(IDS2, halt_eps=0.1, halt_criterion="kl"),
        TypeError,
        r"`halt_criterion` and `halt_head` are no arguments of LoopFormer any more.*benchmarks/halting_rules.py",
    ),
    Case(
        f"{LF} forward",
        "halt_eps=0",
        lambda t: loopformer()(IDS, halt_eps=0),
        ValueError,
        r"halt_eps.*positive finite float, got 0",
    ),
    Case(
        f"{LF} forward",
        "labels=..., short_step_schedule=[0.5, 0.5] (the former separate objective arguments)",
        lambda t: loopformer()(IDS, labels=IDS, short_step_schedule=[0.5, 0.5]),
        TypeError,
        r"got \['short_step_schedule'\] as separate arguments.*shortcut_consistency=ShortcutConsistency",
    ),
    Case(
        f"{LF} forward",
        "shortcut_consistency=ShortcutConsistency([0.5, 0.5], lambda_short=-1)",
        lambda t: shortcut_consistency([0.5, 0.5], lambda_short=-1),
        ValueError,
        r"`lambda_short` must be a finite number >= 0, got -1",
    ),
    Case(
        f"{LF} forward",
        "input_ids of shape (1, 0)",
        lambda t: loopformer()(torch.zeros(1, 0, dtype=torch.long)),
        ValueError,
        r"input_ids.*at least one token",
    ),
    Case(
        f"{LF} generate",
        "halt_eps=0.1, prefill_chunk_size=2",
        lambda t: loopformer().generate(IDS, max_new_tokens=1, halt_eps=0.1, prefill_chunk_size=2),
        ValueError,
        r"halt_eps.*chunked prefill",
    ),
    Case(
        f"{LF} forward",
        "4-D int 0/1 attention_mask",
        lambda t: loopformer()(IDS, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.long).tril()),
        ValueError,
        r"4-D `attention_mask` must be bool .* or float .*got torch.int64",
    ),
    Case(
        f"{LF} forward",
        "4-D attention_mask of the wrong size",
        lambda t: loopformer()(IDS, attention_mask=torch.ones(1, 1, 3, 4, dtype=torch.bool)),
        ValueError,
        r"must have shape \(batch=1 or 1, 1, q_len=3, kv_len=3\), got \(1, 1, 3, 4\)",
    ),
    Case(
        f"{LF} forward",
        "attention_mask=[[1, 2, 1]]",
        lambda t: loopformer()(IDS, attention_mask=torch.tensor([[1, 2, 1]])),
        ValueError,
        r"only 0 \(padding\) and 1 .*got \[2\]",
    ),
    Case(
        f"{LF} forward",
        "position_ids of the wrong length",
        lambda t: loopformer()(IDS, position_ids=torch.arange(2)[None]),
        ValueError,
        r"position_ids.*new tokens=3.*got Tensor \(1, 2\)",
    ),
    Case(
        f"{LF} forward",
        "position_ids=[[-1, 0, 1]]",
        lambda t: loopformer()(IDS, position_ids=torch.tensor([[-1, 0, 1]])),
        ValueError,
        r"position_ids.*>= 0, got -1",
    ),
    Case(
        f"{LF} forward",
        "float position_ids",
        lambda t: loopformer()(IDS, position_ids=torch.arange(3.0)[None]),
        ValueError,
        r"position_ids.*integer tensor.*torch.float32",
    ),
    Case(
        f"{LF} forward",
        "float input_ids",
        lambda t: loopformer()(IDS.float()),
        ValueError,
        r"input_ids.*integer tensor.*got torch.float32",
    ),
    Case(
        f"{LF} forward",
        "inputs_embeds of width 16 (hidden_size 32)",
        lambda t: loopformer()(inputs_embeds=torch.zeros(1, 3, 16)),
        ValueError,
        r"inputs_embeds.*hidden_size=32.*\(1, 3, 16\)",
    ),
    Case(
        f"{LF} forward",
        "float64 inputs_embeds",
        lambda t: loopformer()(inputs_embeds=torch.zeros(1, 3, 32, dtype=torch.float64)),
        ValueError,
        r"inputs_embeds.*torch.float32 tensor.*got torch.float64",
    ),
    Case(
        f"{LF} forward",
        "a cache of 2 sequences for 1",
        lambda t: loopformer()(IDS[:, :1], cache=loopformer()(IDS.expand(2, 3), use_cache=True).cache),
        ValueError,
        r"cache holds 2 sequences; this call gives 1",
    ),
    Case(
        f"{LF} forward",
        "labels with a token id >= vocab_size",
        lambda t: loopformer()(IDS, labels=IDS + 97),
        ValueError,
        r"`labels` must lie in \[0, 96\] \(vocab_size=97\) or be -100 \(ignored\), got \[100, 101, 102\]",
    ),
    Case(
        f"{LF} forward",
        "labels of shape (1, 2)",
        lambda t: loopformer()(IDS, labels=IDS[:, :2]),
        ValueError,
        r"`labels` must be an integer tensor of the shape of the input \(1, 3\).*got Tensor \(1, 2\)",
    ),
    Case(
        f"{LF} forward",
        "float labels",
        lambda t: loopformer()(IDS, labels=IDS.float()),
        ValueError,
        r"`labels` must be an integer tensor.*torch\.float32",
    ),
    # LoopFormer loading
    Case(
        f"{LF} from_pretrained",
        "a folder whose model.safetensors is a pickle",
        lambda t: loopformer().from_pretrained(loopformer_pickle_as_safetensors(t)),
        OSError,
        r"model/model\.safetensors' is not a safetensors file \(safetensors: .*\)\. Nothing was loaded",
    ),
    Case(
        f"{LF} from_pretrained",
        "a config.json without num_loops (it loaded with 8, other logits)",
        lambda t: loopformer().from_pretrained(without_num_loops(t)),
        ValueError,
        r"config\.json must give `num_loops`, got none.*Add \"num_loops\": L",
    ),
    # the authors' Hub checkpoints (a repo in their layout never loads at random)
    Case(
        f"{LF} from_pretrained",
        "an authors' repo with a tensor no mapping knows",
        lambda t: from_authors_repo(t, extra={"gpt.transformer.h.blocks.0.attn.rotary.weight": torch.ones(4)}),
        ValueError,
        r"unknown keys.*'gpt\.transformer\.h\.blocks\.0\.attn\.rotary\.weight'",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' repo without a tensor the model needs",
        lambda t: from_authors_repo(t, drop=("transformer.norm_f.weight",)),
        ValueError,
        r"missing keys.*model\.norm\.weight.*Nothing was initialised at random",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' repo whose c_attn has the wrong shape",
        lambda t: from_authors_repo(t, extra={"gpt.transformer.h.blocks.0.attn.c_attn.weight": torch.zeros(192, 32)}),
        ValueError,
        r"gpt\.transformer\.h\.blocks\.0\.attn\.c_attn\.weight has shape \(192, 32\), the model needs "
        r"\(192, 64\).*Nothing was loaded",
    ),
    Case(
        f"{LF} from_pretrained",
        "a config.json of model_type base_loop over LoopFormer's weights",
        lambda t: from_authors_repo(t, config={"model_type": "base_loop", "width": 64}),
        ValueError,
        r"model_type 'base_loop', but the weights hold a 'loopformer' model",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' config.json stating n_embd=128 over weights 64 wide",
        lambda t: auto_load(_restate(authors_repo(t), n_embd=128)),
        ValueError,
        r"`n_embd`: config\.json says 128, but the weights say 64 \(transformer\.wte\.weight has shape",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' config.json with steps [0.125]*4 (sum 0.5)",
        lambda t: auto_load(_restate(authors_repo(t), steps=[0.125] * 4)),
        ValueError,
        r"`steps`=\[0\.125, 0\.125, 0\.125, 0\.125\] \(config\.json\) sum to 0\.5, not 1",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' repo with a truncated model.safetensors",
        lambda t: auto_load(_truncated(authors_repo(t) / "model.safetensors").parent),
        OSError,
        r"model\.safetensors' is not a whole safetensors file.*truncated",
    ),
    Case(
        "loopformer_hf.convert_authors",
        "--hub_repo FOLDER whose model.safetensors is truncated",
        lambda t: LF_CONVERT(
            "--hub_repo", str(_truncated(authors_repo(t) / "model.safetensors").parent), "--output_dir", "{tmp}/out"
        )(t),
        SystemExit,
        r"model\.safetensors' is not a whole safetensors file",
    ),
    Case(
        f"{LF} from_pretrained",
        "an authors' repo with quantum_mode=True (an unknown option)",
        lambda t: auto_load(authors_repo(t), quantum_mode=True),
        ValueError,
        r"neither config fields nor loading options: \['quantum_mode'\]",
    ),
]


WEAK_ROWS = [
    *(
        Case(
            f"{LF} forward",
            f"loop_budget={text}",
            lambda t, value=value: loopformer()(IDS2, loop_budget=value),
            ValueError,
            r"`loop_budget` as a tensor must be a 1-D integer tensor with one budget per row, got a " + got,
        )
        for text, value, got in (
            ("torch.tensor([2.0, 2.0])", torch.tensor([2.0, 2.0]), r"1-D torch\.float32 tensor"),
            ("torch.tensor([[2, 2]])", torch.tensor([[2, 2]]), r"2-D torch\.int64 tensor of shape \(1, 2\)"),
        )
    ),
    Case(
        f"{LF} save_pretrained",
        "generation_config.loop_budget = -3",
        saved_with_invalid_generation_loop_budget,
        ValueError,
        r"generation_config sets a loop knob of `generate` that this model refuses: `loop_budget` must be an "
        r"integer >= 1, got -3",
    ),
]
