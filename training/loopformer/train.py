"""Train LoopFormer or one of its baselines as a causal LM with the stock `Trainer` (in the style of run_clm.py).

    python -m looped_training.loopformer.train --preset synthetic-tiny                  # -> outputs/loopformer-synthetic-tiny
    python -m looped_training.loopformer.train --preset synthetic-tiny --variant base_loop --output_dir runs/bl
    python -m looped_training.loopformer.train --preset shakespeare-tiny --train_files my_texts/
    python -m looped_training.loopformer.train --output_dir runs/loopformer --task synthetic --max_steps 600 --use_cpu

A preset is a YAML file shipped in training/configs/loopformer/ (`python -m looped_training.configs loopformer`
lists them); any JSON or YAML file of the same keys goes as `--config FILE` (or FILE as the first argument). Either
sets defaults that the flags given override.

Variants (all the same model class, different configurations; see `VARIANTS`):

| variant        | loop_conditioning | blocks x loops | objective                                            |
|----------------|-------------------|----------------|------------------------------------------------------|
| loopformer     | shortcut (t, Δ)   | k x L          | CE_full + λ1·CE_short + λ2·MSE (ShortcutConsistencyCallback) |
| base_loop      | none              | k x L          | CE_full                                              |
| tmlt           | timestep          | k x L          | CE_full                                              |
| naive_loop_ee  | none              | k x L          | CE_full + λ1·CE_short + λ2·MSE, short = S ~ U{1..L-1} loops |
| tmlt_ee        | timestep          | k x L          | CE_full + λ1·CE_short + λ2·MSE, short = S ~ U{1..L-1} loops |
| base           | none              | (k·L) x 1      | CE (iso-FLOP, not looped)                            |

As the authors' train.py: λ1 = λ2 = 0.1 for LoopFormer and the -EE baselines (the -EE short run is an integer loop
count, the callback's `trajectory="early_exit"`), and the Base-Loop, Naive-Loop-EE and Base blocks have RMSNorms
with a learnable weight (`block_norm_weight`, their models/base_loop.py and base.py).

Data (`--task`): `synthetic` (the embedded multi-hop variable-binding corpus, no network or files) or `text`
(`--dataset_name` of Hugging Face datasets, or `--train_files` text files or folders of .txt files, prepared once
into token files in datasets' cache and reused while the files and settings stay the same; or `--data_dir`, prepare's
folder; or `--streaming`). Without a tokenizer, a byte-level BPE is trained on the training documents and saved with
the model. The output folder holds a model that
`AutoModelForCausalLM.from_pretrained` loads (after `import loopformer_hf`), its tokenizer, its generation config
(new tokens that fit the context after the task's prompts; the synthetic tasks stop at the answer's newline, so
`pipeline("text-generation", model=folder)("3+4=")` needs no other argument), and `loopformer_training.json` (the
run's record: variant, data arguments, a sample prompt; the elastic evaluation and `looped_training.publish` read it).

Several processes (CPU, gloo; accelerate's `--cpu` launcher would start only one without MPI; accelerate's FSDP needs
GPUs, see docs/distributed.md):

    ACCELERATE_USE_CPU=true accelerate launch --config_file "$(python -m looped_training.configs accelerate ddp)" \
        --num_processes 2 -m looped_training.loopformer.train --preset synthetic-tiny ...

Resume a killed run with `--resume_from_checkpoint last` (the newest complete checkpoint in `--output_dir`: one left
incomplete by a kill during its save is skipped with a warning) or a path. An `--output_dir` that holds a run is refused
unless the run resumes it or `--overwrite_output_dir` is given (which deletes the old run first).
"""

import contextlib
import json
import logging
import os
import shutil
import sys
from dataclasses import asdict

import datasets
import torch
import transformers
from transformers import AutoTokenizer, HfArgumentParser, Trainer, default_data_collator, set_seed

import loopformer_hf  # noqa: F401  (registers the model with the Auto classes)
from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM
from looped_training.arguments import TrainingArguments, given_flags, parse_args_with_config
from looped_training.loopformer.arguments import (
    VARIANTS,
    DataArguments,
    ModelArguments,
    ScheduleArguments,
    ShortcutArguments,
)
from looped_training.checkpoints import (
    RUN_RECORD,
    CheckpointError,
    RunRecordCallback,
    check_checkpoint,
    check_resume_config,
    check_resume_data,
    check_run_length,
    finished_run,
    load_model,
    resolve_resume,
)
from looped_training.run_folder import (
    FINAL_STAGING,
    claim_output_dir,
    finish_final_save,
    output_dir_lock,
    start_final_save,
)
from looped_training.configs import find_preset, with_preset
from looped_training.loopformer import continued
from looped_training.loopformer.data import TRAINING_META_FILE, held_out_problems, sources, synthetic
from looped_training.loopformer.data.build import build_data
from looped_training.loopformer.objective import ShortcutConsistencyCallback
from looped_training.schedules import LR_WARMUPS, ReferenceWarmupCallback

# the command as users type it (`--help`, one-line errors); argparse would say "train.py"
PROG = "python -m looped_training.loopformer.train"
logger = logging.getLogger(__name__)

# text runs: the record's sample prompt (the card's and the generation config's) is the first held-out row's start
TEXT_PROMPT_TOKENS = 16


# the training arguments the elastic report compares with the authors' run (written to loopformer_training.json)
OPTIMIZER_FIELDS = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "max_grad_norm",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
)


def build_config(model_args, vocab_size, block_size):
    if model_args.variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {tuple(VARIANTS)}, got {model_args.variant!r}.")
    conditioning, looped, _, _, block_norm_weight = VARIANTS[model_args.variant]
    k, L = model_args.num_blocks, model_args.num_loops
    return LoopFormerConfig(
        vocab_size=model_args.vocab_size or vocab_size,
        hidden_size=model_args.hidden_size,
        num_attention_heads=model_args.num_attention_heads,
        intermediate_size=model_args.intermediate_size or 4 * model_args.hidden_size,
        num_hidden_layers=k if looped else k * L,
        num_loops=L if looped else 1,
        loop_conditioning=conditioning,
        block_norm_weight=block_norm_weight,
        initializer_scheme=model_args.initializer_scheme,
        position_embedding_type=model_args.position_embedding_type,
        max_position_embeddings=block_size,
    )


def build_callback(model_args, shortcut_args, training_args):
    _, _, trajectory, default_lambda2, _ = VARIANTS[model_args.variant]
    if trajectory is None:
        return None
    lambda2 = shortcut_args.lambda_consistency
    return ShortcutConsistencyCallback(
        lambda_short=shortcut_args.lambda_short,
        lambda_consistency=default_lambda2 if lambda2 is None else lambda2,
        warmup_steps=shortcut_args.consistency_warmup_steps,
        consistency=shortcut_args.consistency,
        trajectory=trajectory,
        seed=shortcut_args.shortcut_seed,
        log_trajectories_dir=training_args.output_dir if shortcut_args.log_trajectories else None,
    )


def build_trainer(
    model, tokenizer, train_dataset, eval_dataset, model_args, shortcut_args, schedule_args, training_args
):
    """The stock Trainer of a run: the variant's objective callback (which feeds each training forward its short
    trajectory) and the learning-rate warm-up of `schedule_args`."""
    callback = build_callback(model_args, shortcut_args, training_args)
    callbacks = [] if callback is None else [callback]
    # shift_labels is a forward keyword (as for Llama), not a named argument: the Trainer would drop it. Every field
    # of these datasets is a forward argument, so there is nothing else to remove.
    training_args.remove_unused_columns = False
    if schedule_args.lr_warmup == "reference":
        callbacks.append(ReferenceWarmupCallback())
    trainer_class = NodeSplitTrainer if isinstance(train_dataset, datasets.IterableDataset) else Trainer
    return trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset if training_args.eval_strategy != "no" else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=callbacks,
    )


class NodeSplitTrainer(Trainer):
    """The stock Trainer for a training stream that `split_dataset_by_node` already split across ranks: accelerate
    would split it again (or send rank 0's batches to all), so its loader is prepared as a single process's."""

    def get_train_dataloader(self):
        from accelerate.data_loader import prepare_data_loader

        loader = torch.utils.data.DataLoader(
            self.train_dataset,
            batch_size=self._train_batch_size,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        return prepare_data_loader(loader, self.args.device, num_processes=1, process_index=0, put_on_device=True)


def check_sharding(trainer):
    """Refuse a run whose launcher asked for FSDP or DeepSpeed that accelerate did not set up (accelerate 1.15): every
    rank would silently hold and train a full replica under plain DDP."""
    wanted = {
        "FSDP": os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or bool(trainer.args.fsdp),
        "DeepSpeed": os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        or bool(trainer.args.deepspeed),
    }
    enabled = {"FSDP": trainer.is_fsdp_enabled, "DeepSpeed": trainer.is_deepspeed_enabled}
    needs = {
        "FSDP": "processes on GPUs (or other accelerators), not on CPU",
        "DeepSpeed": "processes not forced onto the CPU by --use_cpu or ACCELERATE_USE_CPU",
    }
    for name in wanted:
        if wanted[name] and not enabled[name]:
            raise ValueError(
                f"{name} was requested (accelerate config or training arguments) but accelerate set up "
                f"{trainer.accelerator.distributed_type} without it: accelerate enables {name} only for {needs[name]}. "
                f"On CPU, launch with the DDP config instead (`python -m looped_training.configs accelerate ddp` "
                f"prints its path)."
            )


MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE")


def check_launcher(environ=os.environ):
    """Refuse a run that `accelerate launch --cpu --num_processes N` (N > 1) started as one process: without mpirun,
    accelerate's --cpu launcher runs the script once (it sets MASTER_ADDR for the N processes but starts none of the
    others), which would train a single process silently."""
    cpu = environ.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1", "yes")
    if cpu and "MASTER_ADDR" in environ and not any(k in environ for k in MPI_SIZES):
        raise ValueError(
            "accelerate launch --cpu --num_processes N started one process, not N (its --cpu launcher starts several "
            "only through mpirun): launch with the DDP config, `ACCELERATE_USE_CPU=true accelerate launch "
            '--config_file "$(python -m looped_training.configs accelerate ddp)" --num_processes N -m '
            "looped_training.loopformer.train ...`, or leave out --num_processes."
        )


def read_chat_template(path):
    """The text of a `--chat_template` file (None without one), read before any work."""
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ValueError(f"--chat_template {path!r} is not a file; give a Jinja chat template file.")
    with open(path, encoding="utf-8") as f:
        return f.read()


def check_resume_matches(checkpoint, tokenizer, config):
    """A resumed run rebuilds its tokenizer and model config from the flags: they must be the checkpoint's, or the
    restored weights would meet other token ids (silently) or other shapes (deep in `load_state_dict`)."""
    saved = AutoTokenizer.from_pretrained(checkpoint).get_vocab()
    now = tokenizer.get_vocab()
    if saved != now:
        moved = sum(saved.get(token) != index for token, index in now.items())
        raise ValueError(
            f"The data flags of this run train a tokenizer whose vocabulary differs from {checkpoint}'s ({moved} of "
            f"{len(now)} tokens have other ids): resume with the data flags (corpus, --tokenizer_vocab_size, "
            f"--validation_fraction, ...) of the run that wrote it."
        )
    check_resume_config(checkpoint, config)


def set_chat_template(tokenizer, template, path):
    """Set the template on the tokenizer (saved with it) after checking that it renders a conversation."""
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 raises its own TemplateError subclasses
        raise ValueError(
            f"--chat_template {path!r} does not render a conversation ({type(e).__name__}: {e})."
        ) from None


def main(argv=None):
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, ShortcutArguments, ScheduleArguments, TrainingArguments), prog=PROG
    )
    argv = with_preset(sys.argv[1:] if argv is None else argv, "loopformer")
    preset = find_preset(argv)
    defaults = {"output_dir": f"outputs/loopformer-{preset}"} if preset else None
    (model_args, data_args, shortcut_args, schedule_args, training_args), config_file = parse_args_with_config(
        parser, argv, defaults
    )
    given = given_flags(parser, argv, config_file)
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if training_args.should_log else logging.WARNING,
    )
    transformers.utils.logging.set_verbosity_warning()
    if model_args.variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {tuple(VARIANTS)}, got {model_args.variant!r}.")
    if schedule_args.lr_warmup not in LR_WARMUPS:
        raise ValueError(f"`lr_warmup` must be one of {LR_WARMUPS}, got {schedule_args.lr_warmup!r}.")
    check_run_length(training_args)
    check_launcher()
    if schedule_args.torch_threads is not None and schedule_args.torch_threads < 1:
        raise ValueError(f"`--torch_threads` must be an integer >= 1, got {schedule_args.torch_threads}.")
    if schedule_args.torch_threads:
        torch.set_num_threads(schedule_args.torch_threads)
    sources.check_text_flags(data_args, training_args.max_steps)
    if shortcut_args.consistency not in ("mse", "kl"):
        raise ValueError(f"`consistency` must be 'mse' or 'kl', got {shortcut_args.consistency!r}.")
    if training_args.ddp_find_unused_parameters is None:
        # Every variant's training forward uses every parameter (tests/training/test_distributed.py checks it), so DDP's extra
        # autograd traversal is not needed; the Trainer would turn it on (and torch then warns that it found nothing).
        training_args.ddp_find_unused_parameters = False
    if data_args.data_dir is not None:  # the record's path reads from any folder (evaluate, a resume)
        data_args.data_dir = os.path.abspath(data_args.data_dir)
    created = not os.path.exists(training_args.output_dir)
    try:
        with output_dir_lock(training_args.output_dir, hold=training_args.process_index == 0) as unwritable:
            return train(model_args, data_args, shortcut_args, schedule_args, training_args, unwritable, given)
    except BaseException:
        if created and training_args.process_index == 0:  # a refused run leaves no empty --output_dir behind
            with contextlib.suppress(OSError):
                os.rmdir(training_args.output_dir)
        raise


def generation_defaults(data_args, tokenizer, eval_dataset, block_size):
    """(a sample prompt, the generation config's fields) of a run: as many new tokens as the context leaves after the
    task's longest held-out prompt (learned positions end at block_size), for the synthetic tasks the answer's
    newline as a stop token beside <|endoftext|>, and greedy decoding (`do_sample=False` written out: a pipeline
    samples at temperature 0.7 unless the model's generation config says otherwise; `generate` is greedy either
    way)."""
    eos = [tokenizer.eos_token_id]
    if data_args.task == "synthetic":
        problems = held_out_problems(data_args)
        prompt = problems[0].prompt
        longest = max(len(tokenizer(p.prompt)["input_ids"]) for p in problems)
        newline = tokenizer(synthetic.END_OF_ANSWER, add_special_tokens=False)["input_ids"]
        if len(newline) == 1:
            eos = [newline[0], *eos]
    else:
        prompt = tokenizer.decode(first_row(eval_dataset)["input_ids"][:TEXT_PROMPT_TOKENS])
        longest = len(tokenizer(prompt)["input_ids"])
    return prompt, {"max_new_tokens": max(1, block_size - longest), "eos_token_id": eos, "do_sample": False}


def first_row(dataset):
    """The first row of a map-style or streamed dataset."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return next(iter(dataset))
    return dataset[0]


def final_save_complete(output_dir):
    """Whether `output_dir` holds a run's whole final save: its record (written last) and a model that loads."""
    if not os.path.isfile(os.path.join(output_dir, TRAINING_META_FILE)):
        return False
    try:
        check_checkpoint(output_dir)
    except CheckpointError:
        return False
    return True


def run_record(
    model_args, data_args, shortcut_args, schedule_args, training_args, tokenizer, eval_dataset, block_size
):
    """The run's record (`loopformer_training.json`): what the elastic evaluation, `publish` and a resume read."""
    prompt, generation = generation_defaults(data_args, tokenizer, eval_dataset, block_size)
    return {
        "variant": model_args.variant,
        "model": asdict(model_args),
        "data": asdict(data_args),
        "shortcut": asdict(shortcut_args) if VARIANTS[model_args.variant][2] is not None else None,
        "block_size": block_size,
        "prompt": prompt,
        "generation": generation,
        "train_runtime_s": None,
        "optimizer": {
            **{k: getattr(training_args, k) for k in OPTIMIZER_FIELDS},
            "lr_warmup": schedule_args.lr_warmup,
        },
    }


# data flags a resume may change: they name or decorate the data, not which rows are trained on
RESUME_FREE_DATA_FLAGS = ("preset", "chat_template")


def save_final(output_dir, model, tokenizer, record, write_state, saved=False):
    """A run's final files, written aside and moved into `output_dir` (`finish_final_save`): the model (`saved`: the
    Trainer has written it aside already) with its tokenizer and generation config, `trainer_state.json`
    (`write_state(folder)`) and `record` as `loopformer_training.json`, last. A kill at any point leaves no
    half-written file in `output_dir`, and a record only beside a whole model."""
    staging = os.path.join(output_dir, FINAL_STAGING)
    if not saved:
        start_final_save(output_dir)
        model.generation_config.update(**record["generation"])
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    write_state(staging)
    with open(os.path.join(staging, TRAINING_META_FILE), "w") as f:
        json.dump(record, f, indent=2)
    finish_final_save(output_dir, last=(RUN_RECORD, TRAINING_META_FILE))


def train(model_args, data_args, shortcut_args, schedule_args, training_args, unwritable=None, given=frozenset()):
    """The run `main` parsed, in its locked `output_dir`: the Trainer, or None if the resumed checkpoint already ends
    the run. `unwritable`: the `output_dir_lock`'s refusal of a folder the run may not write, raised unless the run
    is finished (nothing to write). `given`: the flags the user gave (a continued run refuses model flags that
    contradict its checkpoint)."""
    resume = resolve_resume(
        training_args.resume_from_checkpoint, training_args.output_dir, LoopFormerConfig.model_type
    )
    claim_output_dir(training_args, resume)
    chat_template = read_chat_template(data_args.chat_template)

    set_seed(training_args.seed)
    source = None
    if model_args.model_name_or_path is not None:
        source = continued.load_source(model_args.model_name_or_path, LoopFormerForCausalLM)
        continued.model_args_of(source[0].config, model_args, given, VARIANTS)
    # each machine's first process prepares text files into the datasets cache; the others then find it there
    with training_args.main_process_first(desc="preparing the text"):
        tokenizer, train_dataset, eval_dataset, block_size = build_data(
            data_args,
            model_args,
            source,
            training_args.process_index,
            training_args.world_size,
            evaluate=training_args.eval_strategy != "no",
        )
    if chat_template is not None:
        set_chat_template(tokenizer, chat_template, data_args.chat_template)
    config = source[0].config if source is not None else build_config(model_args, len(tokenizer), block_size)
    config.pad_token_id = config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
    record = run_record(
        model_args,
        data_args,
        shortcut_args,
        schedule_args,
        training_args,
        tokenizer,
        train_dataset if eval_dataset is None else eval_dataset,
        block_size,
    )
    if resume is not None:
        check_resume_data(resume, TRAINING_META_FILE, record["data"], RESUME_FREE_DATA_FLAGS)
        check_resume_matches(resume, tokenizer, config)
        # after the config check: a finished run resumed with flags of another model is refused, not a no-op
        # killed during its final save, after its last checkpoint: the resume finishes that save from the checkpoint
        incomplete = training_args.should_save and not final_save_complete(training_args.output_dir)
        if finished_run(resume, training_args, training_args.output_dir if incomplete else None):
            if incomplete and unwritable is not None:
                raise unwritable
            if incomplete:
                save_final(
                    training_args.output_dir,
                    load_model(LoopFormerForCausalLM, resume),
                    tokenizer,
                    record,
                    lambda folder: shutil.copy(os.path.join(resume, RUN_RECORD), folder),
                )
            return None
    if unwritable is not None:
        raise unwritable
    model = source[0] if source is not None else LoopFormerForCausalLM(config)
    logger.info(
        "%s: %d parameters, %d blocks x %d loops, %s; %s train rows of %d tokens",
        model_args.variant,
        model.num_parameters(),
        config.num_hidden_layers,
        config.num_loops,
        config.loop_conditioning,
        "streamed" if isinstance(train_dataset, torch.utils.data.IterableDataset) else len(train_dataset),
        block_size,
    )

    trainer = build_trainer(
        model, tokenizer, train_dataset, eval_dataset, model_args, shortcut_args, schedule_args, training_args
    )
    trainer.add_callback(RunRecordCallback(TRAINING_META_FILE, record))
    check_sharding(trainer)
    result = trainer.train(resume_from_checkpoint=resume)
    # train_results.json and all_results.json before the final save, whose record is the last file a run writes: a
    # run stopped after it has nothing left to write
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    staging = start_final_save(training_args.output_dir) if trainer.is_world_process_zero() else None
    model.generation_config.update(**record["generation"])  # saved with the model as generation_config.json
    trainer.save_model(staging)  # writes on the main process only
    if trainer.is_world_process_zero():
        save_final(
            training_args.output_dir,
            model,
            tokenizer,
            {**record, "train_runtime_s": result.metrics.get("train_runtime")},
            lambda folder: trainer.state.save_to_json(os.path.join(folder, RUN_RECORD)),
            saved=True,
        )
    return trainer


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, PROG)
