"""LoRA fine-tuning of LoopFormer (on text) and FPRM (on a task) with PEFT and `transformers.Trainer`.

    # LoopFormer on local text files (or --dataset NAME --text_column text), budgets sampled per batch
    python -m looped_training.finetune_lora --model runs/loopformer-tiny --train_files notes/ --output runs/lora \
        --loop_budgets 2,4,8 --max_steps 200 [--loop_conditioning train|freeze] [--merge]

    # FPRM on a task: a `datasets` folder (save_to_disk) or a JSON-lines file with `input_ids` and `labels`
    python -m looped_training.finetune_lora --model runs/fprm-s5 --task_data s5_train.jsonl --output runs/fprm-lora \
        --max_loops 16 --max_steps 200

Target modules (LoRA on every `nn.Linear` of these names, in every shared block; the blocks are looped, so one
adapter acts at every loop step):

| model | attention | MLP |
|---|---|---|
| LoopFormer | q_proj, k_proj, v_proj, o_proj | up_proj, down_proj (+ gate_proj when hidden_act="swiglu") |
| FPRM | qkv_proj (fused q, k, v, as the authors), o_proj | gate_up_proj (fused), down_proj (SwiGLU) |

Loop-conditioning parameters (`--loop_conditioning`): LoopFormer's `model.loop_conditioning.*` (the t and Δ
embedders) and every block's `adaLN_modulation`; FPRM's `model.residual_scaling` (the α/β of the loop update).
`freeze` (default) keeps them as in the base model (PEFT freezes every base parameter); `train` makes them trainable
through PEFT's `modules_to_save`: a trained copy is stored in the adapter and `merge_and_unload()` puts it in place.

`--model` is a model folder, a Hub id, or a training run's folder (FPRM's model is its `model/`). LoopFormer's text is
prepared once with the model's tokenizer into token files in datasets' cache, as `loopformer.train --train_files`
prepares it, and read in windows of `--block_size` tokens (default 128, or the model's context if shorter).

Outputs: `<output>/adapter` (adapter_model.safetensors + adapter_config.json + tokenizer) and, with `--merge`,
`<output>/merged`, a plain checkpoint (with auto_map and modeling code) that `looped_training.publish` can push. An
`--output` that is a file, or that holds adapter/ or merged/ of an earlier fine-tuning, is refused before any work.
"""

import argparse
import json
import math
import random
import warnings
from pathlib import Path

import torch


LOOPFORMER_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
FPRM_TARGET_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
LOOP_CONDITIONING_MODULES = {"loopformer": ["loop_conditioning", "adaLN_modulation"], "fprm": ["residual_scaling"]}
# The flags only one model type reads (the other would ignore them).
MODEL_TYPE_FLAGS = {
    "loopformer": ["train_files", "dataset", "dataset_config", "loop_budgets"],
    "fprm": ["task_data", "max_loops"],
}
MODEL_NAMES = {"loopformer": "LoopFormer", "fprm": "FPRM"}


def _import_packages():
    import loopformer_hf  # noqa: F401  (Auto registrations)

    try:
        import fprm_hf  # noqa: F401
    except ImportError:  # pragma: no cover
        pass


def default_target_modules(config):
    """The documented LoRA targets for a LoopFormer or FPRM config."""
    if config.model_type == "loopformer":
        return LOOPFORMER_TARGET_MODULES + (["gate_proj"] if config.hidden_act == "swiglu" else [])
    if config.model_type == "fprm":
        return list(FPRM_TARGET_MODULES)
    raise ValueError(f"LoRA targets are defined for model_type 'loopformer' and 'fprm', got {config.model_type!r}.")


def loop_conditioning_modules(model):
    """Names (suffixes, as PEFT's modules_to_save wants them) of the loop-conditioning modules present in `model`."""
    wanted = LOOP_CONDITIONING_MODULES.get(model.config.model_type, [])
    present = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if next(module.parameters(), None) is not None
    }
    return [name for name in wanted if name in present]


def add_lora(
    model, r=8, alpha=16, dropout=0.0, target_modules=None, train_loop_conditioning=False, init_lora_weights=True
):
    """Wrap `model` with LoRA adapters. `train_loop_conditioning` makes the loop-conditioning modules trainable
    (modules_to_save); otherwise they stay frozen with the rest of the base model."""
    from peft import LoraConfig, get_peft_model

    if target_modules is None:
        target_modules = default_target_modules(model.config)
    linear_names = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    unknown = [t for t in target_modules if t not in linear_names]
    if not target_modules or unknown:
        raise ValueError(
            f"`target_modules` {list(target_modules)} has names that are not nn.Linear modules of this "
            f"{model.config.model_type} model: {unknown or 'empty list'}; allowed: {linear_names}."
        )
    if not (isinstance(r, int) and r >= 1):
        raise ValueError(f"LoRA rank `r` must be an integer >= 1, got {r!r}.")
    modules_to_save = None
    if train_loop_conditioning:
        modules_to_save = loop_conditioning_modules(model)
        if not modules_to_save:
            raise ValueError(
                f"--loop_conditioning train: this model has no loop-conditioning parameters "
                f"(model_type={model.config.model_type!r}, loop_conditioning="
                f"{getattr(model.config, 'loop_conditioning', None)!r}); use --loop_conditioning freeze."
            )
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        modules_to_save=modules_to_save,
        init_lora_weights=init_lora_weights,
        task_type="CAUSAL_LM" if model.config.model_type == "loopformer" else None,
    )
    with warnings.catch_warnings():
        # PEFT's, not ours: get_peft_model reads `is_gradient_checkpointing`, which transformers 5.24 deprecates
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def loop_conditioning_parameters(peft_model):
    """{name: parameter} of the loop-conditioning parameters the model actually uses (the trained copies when
    they are in modules_to_save, else the base ones)."""
    wanted = LOOP_CONDITIONING_MODULES.get(peft_model.get_base_model().config.model_type, [])
    out = {}
    for name, param in peft_model.named_parameters():
        if not any(f".{w}." in f".{name}" for w in wanted):
            continue
        if "original_module" in name:  # the frozen original kept beside a modules_to_save copy
            continue
        out[name] = param
    return out


class ExtraKwargsCollator:
    """Pads nothing (rows have equal length), stacks columns, and adds forward kwargs: fixed ones (e.g. max_loops)
    and one value per batch drawn from `choices` (e.g. loop_budget), so elastic depth keeps being trained."""

    def __init__(self, fixed=None, choices=None, seed=0):
        self.fixed = dict(fixed or {})
        self.choices = {k: list(v) for k, v in (choices or {}).items() if v}
        self.rng = random.Random(seed)

    def __call__(self, rows):
        batch = {key: torch.stack([torch.as_tensor(row[key]) for row in rows]) for key in rows[0]}
        batch.update(self.fixed)
        for key, values in self.choices.items():
            batch[key] = self.rng.choice(values)
        return batch


def _parse_int_list(text, name):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name} must be a comma-separated list of positive integers, got {text!r}.")
    return values


def _text_dataset(args, tokenizer, vocab_size):
    """The text's windows of `--block_size` tokens, as LoopFormer's train reads `--train_files` / `--dataset_name`:
    prepared once with the model's tokenizer into token files in datasets' cache (`text_cache`; no document held
    out), read by `TokenWindows`."""
    from looped_training.loopformer.arguments import DataArguments
    from looped_training.loopformer.data import text_cache, token_files

    data_args = DataArguments(
        task="text",
        dataset_name=args.dataset,
        dataset_config_name=args.dataset_config,
        train_files=args.train_files,
        text_column=args.text_column,
        validation_fraction=0.0,
    )
    folder = text_cache.prepared_folder(data_args, tokenizer, text_cache.MODEL_TOKENIZER)
    corpus = token_files.open_corpus(folder, args.block_size, verify=True)
    return token_files.TokenWindows(corpus.train, args.block_size, corpus.dtype, vocab_size)


def _task_dataset(path):
    import datasets

    path = Path(path)
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
    elif path.is_file():
        ds = datasets.Dataset.from_list([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    else:
        raise ValueError(f"--task_data {path} is neither a saved datasets folder nor a JSON-lines file.")
    missing = {"input_ids", "labels"} - set(ds.column_names)
    if missing:
        raise ValueError(f"--task_data needs columns input_ids and labels; {path} has {ds.column_names}.")
    keep = [c for c in ("input_ids", "labels", "puzzle_identifiers") if c in ds.column_names]
    return ds.select_columns(keep)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m looped_training.finetune_lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="base checkpoint folder or Hub repo id")
    p.add_argument("--output", required=True)
    data = p.add_argument_group("data (one of)")
    data.add_argument("--train_files", nargs="+", default=None, help="LoopFormer: .txt files or folders")
    data.add_argument("--dataset", default=None, help="LoopFormer: a datasets name or path (train split)")
    data.add_argument("--dataset_config", default=None)
    data.add_argument("--text_column", default="text")
    data.add_argument("--task_data", default=None, help="FPRM: datasets folder or JSON-lines with input_ids, labels")
    p.add_argument(
        "--block_size",
        type=int,
        default=None,
        help="LoopFormer: tokens per training row (default: 128, or the model's context if shorter)",
    )
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--lora_alpha", type=int, default=16)
    p.add_argument("--lora_dropout", type=float, default=0.0)
    p.add_argument("--target_modules", default=None, help="comma-separated; default: the documented ones")
    p.add_argument(
        "--loop_conditioning",
        choices=["freeze", "train"],
        default="freeze",
        help="freeze (default) or train the loop-conditioning parameters",
    )
    p.add_argument(
        "--loop_budgets",
        default=None,
        help="LoopFormer: budgets sampled per batch, e.g. 2,4,8 (default: the config's default budget)",
    )
    p.add_argument("--max_loops", type=int, default=None, help="FPRM: solver cap during fine-tuning")
    p.add_argument("--max_steps", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge", action="store_true", help="also save merge_and_unload() as <output>/merged")
    return p


def _check_numeric_flags(args):
    """The numbers no model accepts. Each failed deep inside (--block_size 0: ZeroDivisionError in the chunker;
    --batch_size 0, --lora_dropout 1.5, --learning_rate -1: torch errors after the model was loaded) or did something
    else than asked without a word (--max_steps 0 or -1: the Trainer's 3 epochs; --lora_alpha 0: an adapter scaled
    by 0 that never changes the model; --lora_dropout 1: every input to the adapter dropped)."""
    for flag in ("block_size", "batch_size", "max_steps", "lora_r", "lora_alpha"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be an integer >= 1, got {value}.")
    if not 0.0 <= args.lora_dropout < 1.0:  # NaN fails this too
        raise ValueError(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}.")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise ValueError(f"--learning_rate must be a finite number > 0, got {args.learning_rate}.")


def check_output(output):
    """Refuse an --output that is a file (`FileExistsError` deep in the save, after the training) or that holds the
    adapter or merged model of an earlier fine-tuning: the new adapter would replace the old one, and a merged/ of the
    old one would be left beside it as if it were the new one's."""
    from looped_training.arguments import check_output_path

    out = Path(output)
    check_output_path("--output", output, folder=True)  # a file, a path under one, a folder it may not write
    earlier = [name for name in ("adapter", "merged") if (out / name).exists()]
    if earlier:
        raise ValueError(
            f"--output {output} already holds {' and '.join(f'{n}/' for n in earlier)} of an earlier "
            f"fine-tuning, which this one would replace or leave stale: give a new --output, or move "
            f"those away first."
        )


def resolve_model(model):
    """The model folder of `--model`: a training run's folder holds FPRM's model in `model/` (LoopFormer's is the run
    folder itself); a Hub id or a model folder is returned as given."""
    path = Path(model)
    if path.is_dir() and not (path / "config.json").exists() and (path / "model" / "config.json").exists():
        print(f"--model {model}: a training run's folder; fine-tuning its model, {path / 'model'}")
        return str(path / "model")
    return model


def parse_args(argv=None):
    """The flags, `loop_budgets` as a list of ints. A value no model accepts is argparse's error (exit 2), before
    anything is loaded: it would fail at a training step, or (--max_loops 0) be read as not given."""
    from looped_training.arguments import check_model_source

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_numeric_flags(args)
        check_output(args.output)
        check_model_source("--model", args.model)  # a path that is not there: not tried as a Hub repo id
        if args.loop_budgets is not None:
            args.loop_budgets = _parse_int_list(args.loop_budgets, "--loop_budgets")
        if args.max_loops is not None:
            from fprm_hf.configuration_fprm import check_max_loops

            check_max_loops(args.max_loops, "--max_loops")
    except ValueError as e:
        parser.error(str(e))
    return args


def check_flags_apply(args, config):
    """Refuses a flag that `config`'s model type does not read, a block longer than this LoopFormer's learned position
    table, and a loop budget this LoopFormer does not allow (drawn per batch, it would fail at whichever step first
    drew it)."""
    for model_type, flags in MODEL_TYPE_FLAGS.items():
        given = [f"--{flag}" for flag in flags if getattr(args, flag) is not None]
        if given and model_type != config.model_type:
            raise ValueError(
                f"{', '.join(given)}: only for {MODEL_NAMES[model_type]} models, and --model "
                f"{args.model} is model_type {config.model_type!r}."
            )
    if config.model_type == "loopformer":
        if (args.dataset is None) == (not args.train_files):
            raise ValueError(
                f"Give exactly one of --dataset (a datasets name or path) or --train_files (text files or folders) "
                f"for LoopFormer; got --dataset {args.dataset!r}, --train_files {args.train_files!r}."
            )
        context = config.max_position_embeddings
        if config.position_embedding_type == "learned" and args.block_size > context:
            # the first training step failed with "Position ... is beyond max_position_embeddings"
            raise ValueError(
                f"--block_size {args.block_size} is longer than the model's context of {context} tokens "
                f"(max_position_embeddings, learned positions); give --block_size <= {context}."
            )
        for budget in args.loop_budgets or []:
            try:
                config.resolve_trajectory(budget)  # the check the forward runs
            except ValueError as e:
                raise ValueError(f"--loop_budgets {budget}: {e}") from None


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

    from looped_training.checkpoints import load_model

    _import_packages()
    set_seed(args.seed)
    args.model = resolve_model(args.model)
    config = AutoConfig.from_pretrained(args.model)
    if args.block_size is None:
        args.block_size = min(128, config.max_position_embeddings) if config.model_type == "loopformer" else 128
    if config.model_type not in MODEL_NAMES:
        raise ValueError(f"--model must be a LoopFormer or FPRM checkpoint, got model_type {config.model_type!r}.")
    check_flags_apply(args, config)
    tokenizer = None
    if config.model_type == "loopformer":
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = load_model(AutoModelForCausalLM, args.model)
        train = _text_dataset(args, tokenizer, model.config.vocab_size)
        collator = ExtraKwargsCollator(choices={"loop_budget": args.loop_budgets or []}, seed=args.seed)
    else:  # fprm
        import fprm_hf

        if not args.task_data:
            raise ValueError("FPRM fine-tuning needs --task_data (a datasets folder or JSON-lines file).")
        model = load_model(fprm_hf.FPRMForReasoning, args.model)
        train = _task_dataset(args.task_data)
        collator = ExtraKwargsCollator(fixed=None if args.max_loops is None else {"max_loops": args.max_loops})

    targets = args.target_modules.split(",") if args.target_modules else None
    peft_model = add_lora(
        model,
        r=args.lora_r,
        alpha=args.lora_alpha,
        dropout=args.lora_dropout,
        target_modules=targets,
        train_loop_conditioning=args.loop_conditioning == "train",
    )
    peft_model.print_trainable_parameters()
    training_args = TrainingArguments(
        output_dir=args.output,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        logging_steps=max(1, args.max_steps // 10),
        save_strategy="no",
        report_to="none",
        remove_unused_columns=False,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=peft_model, args=training_args, train_dataset=train, data_collator=collator)
    result = trainer.train()

    out = Path(args.output)
    peft_model.save_pretrained(out / "adapter")
    if tokenizer is not None:
        tokenizer.save_pretrained(out / "adapter")
    if args.merge:
        merged = peft_model.merge_and_unload()
        merged.save_pretrained(out / "merged")
        if tokenizer is not None:
            tokenizer.save_pretrained(out / "merged")
    summary = {
        "train_loss": result.training_loss,
        "steps": result.global_step,
        "adapter": str(out / "adapter"),
        "merged": str(out / "merged") if args.merge else None,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, "python -m looped_training.finetune_lora")
