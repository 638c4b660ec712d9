"""Training that starts from a trained FPRM (`python -m looped_training.fprm.train --model_name_or_path ...`): the
authors' models (`fixed-point-reasoners/fprm --subfolder sudoku [--step N]`, loaded as
`FPRMForReasoning.from_pretrained` loads them), or a folder saved by this package. The model's shape and solver
settings come from the checkpoint: a model flag given on the command line or in a preset that says otherwise is
refused by name. `--eval_before_training` evaluates the model on `--data`'s test split before the first step as
`python -m looped_training.fprm.evaluate_authors` does (the same report, from the same seed), and again after the last."""

import torch

# ModelArguments field -> the FPRMConfig field that answers it (a default None means "the config's own")
CONFIG_FIELDS = {
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_hidden_layers",
    "residual_scaling": "residual_scaling",
    "outer_only": "outer_only",
    "norm_type": "norm_type",
    "norm_placement": "norm_placement",
    "alpha1": "alpha1",
    "alpha2": "alpha2",
    "fixed_init": "fixed_init",
    "num_prefix_tokens": "num_prefix_tokens",
    "init_std": "init_std",
    "conv_kernel_size": "conv_kernel_size",
    "halt_eps": "halt_eps",
    "patience": "patience",
    "gamma_train": "gamma_train",
    "gamma_eval": "gamma_eval",
    "use_q_head": "use_q_head",
    "puzzle_emb_ndim": "puzzle_emb_ndim",
}


def _load_kwargs(model_args):
    return {k: v for k, v in (("subfolder", model_args.subfolder), ("step", model_args.step)) if v is not None}


def _source_error(model_args, error):
    where = model_args.model_name_or_path + (f" --subfolder {model_args.subfolder}" if model_args.subfolder else "")
    return ValueError(f"--model_name_or_path {where} does not load as an FPRM: {str(error).splitlines()[0]}")


def check_continued_flags(model_args, data_args, eval_args, given):
    """A ValueError (one line and exit 2 as a command, before any work) for flags that cannot go together:
    `--subfolder`/`--step` without `--model_name_or_path`, `--eval_before_training` without `--data`, and model flags
    that contradict the checkpoint's config (read alone, without its weights)."""
    if model_args.model_name_or_path is None:
        for flag in ("subfolder", "step"):
            if getattr(model_args, flag) is not None:
                raise ValueError(f"`--{flag}` names a folder or step of `--model_name_or_path`, which is not given.")
    if eval_args.eval_before_training and data_args.data is None:
        raise ValueError(
            "`--eval_before_training` evaluates on the test split of `--data` (the authors' folder), which is not "
            "given."
        )
    if model_args.model_name_or_path is None:
        return
    from transformers import AutoConfig

    from fprm_hf import FPRMConfig  # (the import registers "fprm" with AutoConfig)
    from fprm_hf.authors.checkpoints import is_authors_layout

    # the authors' folder has no config.json, which AutoConfig reads: FPRMConfig derives it from the files
    where = {"subfolder": model_args.subfolder} if model_args.subfolder else {}
    config_class = FPRMConfig if is_authors_layout(model_args.model_name_or_path, where) else AutoConfig
    try:
        config = config_class.from_pretrained(model_args.model_name_or_path, **_load_kwargs(model_args))
    except (OSError, ValueError) as error:
        raise _source_error(model_args, error) from None
    if getattr(config, "model_type", None) != "fprm":
        raise ValueError(
            f"--model_name_or_path {model_args.model_name_or_path} holds a {config.model_type!r} model, not an FPRM."
        )
    contradicting = [
        f"--{flag} {getattr(model_args, flag)} (the checkpoint has {getattr(config, name)})"
        for flag, name in CONFIG_FIELDS.items()
        if flag in given
        and getattr(model_args, flag) is not None
        and getattr(model_args, flag) != getattr(config, name)
    ]
    if contradicting:
        raise ValueError(
            f"The model comes from --model_name_or_path, so its shape and solver are the checkpoint's: "
            f"{', '.join(contradicting)}; leave these flags out (--train_halt_eps and the --eval_* flags set the "
            f"solver of training and evaluation)."
        )


def load_source(model_args):
    """The checkpoint's model, fp32 weights to train."""
    from fprm_hf import FPRMForReasoning

    try:
        return FPRMForReasoning.from_pretrained(
            model_args.model_name_or_path, dtype=torch.float32, **_load_kwargs(model_args)
        )
    except (OSError, ValueError) as error:
        raise _source_error(model_args, error) from None


def authors_protocol(model, test, task, eval_args, seed, device):
    """`python -m looped_training.fprm.evaluate_authors`'s report of `model` on the test split `test` (an `AuthorsSplit`)
    of the folder, as that command computes it for the same `--seed`, `--batch_size` (here `--eval_batch_size`),
    `--max_loops` (`--eval_max_loops`) and `--halt_eps` (`--eval_halt_eps`): z0 drawn per puzzle from the seed, the
    model's halt_scope."""
    from looped_training.fprm.evaluate_authors import evaluate, task_at

    solver = {"max_loops": eval_args.eval_max_loops}
    if eval_args.eval_halt_eps is not None:
        solver["halt_eps"] = eval_args.eval_halt_eps
    ratings = test["rating"] if "rating" in test.column_names else None
    model.to(device)
    return evaluate(
        model,
        test["input_ids"],
        test["labels"],
        ratings,
        task_at(task, model.config),
        batch_size=eval_args.eval_batch_size,
        seed=seed,
        **solver,
    )


__all__ = ["authors_protocol", "check_continued_flags", "load_source"]
