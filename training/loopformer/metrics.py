"""What the elastic evaluation measures on one checkpoint (`evaluate_checkpoint`): quality at every loop budget
M = 1..L and schedule on the held-out data its run's record describes, the halting sweep (quality against mean loop
steps per token), hidden states per loop step for the representation metrics, and a few greedy generations. The
command is `python -m looped_training.loopformer.evaluate`; its tables, verdicts and plots are
`looped_training.loopformer.report`'s."""

import dataclasses
import json
import math
import os
from collections import defaultdict

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from looped_training.checkpoints import check_checkpoint, check_model_type, load_model
from looped_training.loopformer import representations
from looped_training.loopformer.arguments import DataArguments
from looped_training.loopformer.data import TRAINING_META_FILE, held_out_problems, synthetic, text_cache
from looped_training.loopformer.data.sources import held_out_windows

SCHEDULES = ("uniform", "coarse_to_fine", "fine_to_coarse")


def load_checkpoint(path):
    """(model, tokenizer, meta) of a training output folder (or a checkpoint-N folder inside one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_checkpoint(path)
    check_model_type(path, "loopformer")
    meta_path = next(
        (
            p
            for p in (
                os.path.join(path, TRAINING_META_FILE),
                os.path.join(os.path.dirname(os.path.abspath(path)), TRAINING_META_FILE),
            )
            if os.path.exists(p)
        ),
        None,
    )
    if meta_path is None:
        raise ValueError(
            f"{path!r} has no {TRAINING_META_FILE} (written by training/loopformer/train.py), so the "
            f"held-out data it was trained for is unknown."
        )
    with open(meta_path) as f:
        meta = json.load(f)
    model = load_model(AutoModelForCausalLM, path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, meta


def build_eval_data(meta, tokenizer, max_rows):
    data_args = DataArguments(**meta["data"])
    block_size = meta["block_size"]
    if data_args.task == "synthetic":
        problems = held_out_problems(data_args)[:max_rows]
        rows = synthetic.tokenize_problems(problems, tokenizer, block_size, answer_only_loss=True)
        rows["prompts"] = [p.prompt for p in problems]
        rows["answers"] = [p.answer for p in problems]
    else:
        if data_args.data_dir is None and not data_args.streaming:  # text files or a dataset: the run's token folder
            data_args = dataclasses.replace(data_args, data_dir=held_out_folder(data_args, tokenizer))
        # the run's own held-out windows: T next-token targets a row, as the authors' estimate_loss scores them
        data = held_out_windows(data_args, tokenizer, block_size, max_rows)
        return data_args.task, data, {"input_ids": data["input_ids"].tolist()}
    tensors = {k: torch.tensor(rows[k]) for k in ("input_ids", "attention_mask", "labels")}
    if "depth" in rows:
        tensors["depth"] = torch.tensor(rows["depth"])
    return data_args.task, tensors, rows


def held_out_folder(data_args, tokenizer):
    """The token folder a text run without `--data_dir` trained from (`text_cache`): the cached one of its BPE where
    it is still there and its tokenizer is the checkpoint's, else the text prepared with the checkpoint's tokenizer
    (the same held-out documents: prepare's seeded hash of their text)."""
    from transformers import AutoTokenizer

    if data_args.tokenizer_name is None:
        folder = text_cache.prepared_folder(data_args, prepare_missing=False)
        if folder is not None and AutoTokenizer.from_pretrained(folder).get_vocab() == tokenizer.get_vocab():
            return folder
    return text_cache.prepared_folder(data_args, tokenizer, data_args.tokenizer_name or text_cache.MODEL_TOKENIZER)


@torch.no_grad()
def quality(model, data, trajectory, batch_size=128, halt_eps=None, **knobs):
    """Perplexity over labelled tokens; exact match per row (all labelled tokens are the argmax); with `halt_eps`,
    also the loop steps spent on each row's scored positions (the positions whose logits are scored). `knobs`: more
    keywords of the model's forward (e.g. the lab model's `halt_criterion`)."""
    ce_sum, count, correct, loops = 0.0, 0, [], []
    n = data["input_ids"].shape[0]
    for start in range(0, n, batch_size):
        ids = data["input_ids"][start : start + batch_size].to(model.device)
        mask = data["attention_mask"][start : start + batch_size].to(model.device)
        if "shift_labels" in data:  # windows with their next token: every position is scored
            labels = data["shift_labels"][start : start + batch_size].to(model.device)
        else:
            labels = data["labels"][start : start + batch_size][:, 1:].to(model.device)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            step_schedule=list(trajectory),
            use_cache=False,
            **({} if halt_eps is None else {"halt_eps": halt_eps}),
            **knobs,
        )
        logits = out.logits[:, : labels.shape[1]].float()
        valid = labels != -100
        ce_sum += float(F.cross_entropy(logits[valid], labels[valid], reduction="sum"))
        count += int(valid.sum())
        hit = (logits.argmax(-1) == labels) | ~valid
        correct += hit.all(-1).tolist()
        if halt_eps is not None:
            counts = out.loop_counts[:, : labels.shape[1]].float()
            loops += ((counts * valid).sum(-1) / valid.sum(-1).clamp(min=1)).tolist()
    return math.exp(ce_sum / max(count, 1)), correct, loops


def evaluate_halting(model, task, data, eps_values):
    """Adaptive depth per token (the state-change rule): quality against mean loop steps per scored token, at the full
    uniform budget, at each halt_eps of `eps_values`. The lab's other exit rules: benchmarks/halting_rules.py."""
    trajectory = model.config.resolve_trajectory(model.config.num_loops, "uniform")
    return halting_sweep(model, task, data, trajectory, eps_values)


def halting_sweep(model, task, data, trajectory, eps_values, **knobs):
    """One record per halt_eps of `eps_values`: perplexity, exact match (per depth too) and mean loops per scored
    token along `trajectory`, the model called with `knobs` too."""
    results = []
    for eps in eps_values:
        ppl, correct, loops = quality(model, data, trajectory, halt_eps=eps, **knobs)
        record = {
            "halt_eps": eps,
            "mean_loops": sum(loops) / len(loops),
            "ppl": ppl,
            "em": None,
            "em_by_depth": None,
            "mean_loops_by_depth": None,
        }
        if task == "synthetic":
            record["em"] = sum(correct) / len(correct)
            per_depth = defaultdict(list)
            for d, c, l in zip(data["depth"].tolist(), correct, loops):
                per_depth[d].append((c, l))
            record["em_by_depth"] = {str(d): sum(c for c, _ in v) / len(v) for d, v in sorted(per_depth.items())}
            record["mean_loops_by_depth"] = {
                str(d): sum(l for _, l in v) / len(v) for d, v in sorted(per_depth.items())
            }
        results.append(record)
    return results


def evaluate_quality(model, task, data, budgets, schedules, disable_tqdm=None):
    config = model.config
    results, by_trajectory = [], {}
    for budget in tqdm(budgets, desc="budgets", unit="budget", leave=False, disable=disable_tqdm):
        for schedule in schedules:
            record = {
                "budget": budget,
                "schedule": schedule,
                "trajectory": None,
                "ppl": None,
                "em": None,
                "em_by_depth": None,
            }
            try:
                trajectory = config.resolve_trajectory(budget, schedule)
            except ValueError:  # this model only knows uniform steps
                results.append(record)
                continue
            if trajectory not in by_trajectory:
                by_trajectory[trajectory] = quality(model, data, trajectory)
            ppl, correct, _ = by_trajectory[trajectory]
            record.update(trajectory=list(trajectory), ppl=ppl)
            if task == "synthetic":
                record["em"] = sum(correct) / len(correct)
                per_depth = defaultdict(list)
                for d, c in zip(data["depth"].tolist(), correct):
                    per_depth[d].append(c)
                record["em_by_depth"] = {str(d): sum(v) / len(v) for d, v in sorted(per_depth.items())}
            results.append(record)
    return results


@torch.no_grad()
def step_states(model, data, meta, max_rows):
    """Hidden states per loop step (embeddings first) at the full trajectory, on `max_rows` held-out rows."""
    ids = data["input_ids"][:max_rows].to(model.device)
    mask = data["attention_mask"][:max_rows].to(model.device)
    config = model.config
    if config.num_loops > 1:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            output_hidden_states=True,
            use_cache=False,
            loop_budget=config.num_loops,
            step_schedule="uniform",
        )
        return list(out.hidden_states), mask
    k = meta["model"]["num_blocks"]
    captured = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o: captured.append(o[0] if isinstance(o, tuple) else o))
        for layer in model.model.layers
    ]
    try:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [out.hidden_states[0]] + [captured[i] for i in range(k - 1, len(captured), k)], mask


@torch.no_grad()
def generations(model, tokenizer, task, rows, budgets, num_prompts=3):
    """Greedy `generate(loop_budget=M)` continuations of a few held-out prompts for each budget M."""
    samples = []
    if task == "synthetic":
        prompts = rows["prompts"][:num_prompts]
        answers = rows["answers"][:num_prompts]
        max_new = 3
    else:
        prompts = [tokenizer.decode(r[:24]) for r in rows["input_ids"][:num_prompts]]
        answers = [None] * len(prompts)
        max_new = 32
    for budget in budgets:
        for prompt, answer in zip(prompts, answers):
            enc = tokenizer(prompt, return_tensors="pt").to(model.device)
            kwargs = {"loop_budget": budget} if model.config.num_loops > 1 else {}
            out = model.generate(
                **enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tokenizer.pad_token_id, **kwargs
            )
            text = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            if task == "synthetic":
                text = text.split(synthetic.END_OF_ANSWER)[0]
            samples.append({"budget": budget, "prompt": prompt, "generated": text, "answer": answer})
    return samples


def check_generate_budgets(paths, budgets):
    """Refuse, before any evaluation, a `--generate_budgets` value outside 1..L of a looped checkpoint (it was
    silently dropped). Base (num_loops = 1, not looped) has one depth and generates once whatever is asked."""
    from transformers import AutoConfig

    for path in paths:
        check_checkpoint(path)
        num_loops = AutoConfig.from_pretrained(path).num_loops
        high = sorted({b for b in budgets if b > num_loops})
        if num_loops > 1 and high:
            raise ValueError(
                f"--generate_budgets {high}: {path!r} has num_loops L={num_loops}, so the allowed budgets are "
                f"1..{num_loops}."
            )


def evaluate_checkpoint(
    path,
    name=None,
    max_rows=400,
    repr_rows=32,
    schedules=SCHEDULES,
    generate_budgets=(),
    halt_eps=(),
    disable_tqdm=None,
    device="cpu",
    halting=None,
):
    """The evaluation record of the checkpoint at `path`; `halting(model, task, data, halt_eps)` runs the halt_eps
    sweep (default: `evaluate_halting`, the state-change rule; the lab's rules: benchmarks/halting_rules.py)."""
    model, tokenizer, meta = load_checkpoint(path)
    model.to(device)
    task, data, rows = build_eval_data(meta, tokenizer, max_rows)
    L = meta["model"]["num_loops"]
    budgets = list(range(1, model.config.num_loops + 1))
    record = {
        "name": name or os.path.basename(os.path.normpath(path)),
        "path": path,
        "variant": meta["variant"],
        "task": task,
        "num_loops": L,
        "num_blocks": meta["model"]["num_blocks"],
        "parameters": model.num_parameters(),
        "train_runtime_s": meta.get("train_runtime_s"),
        "results": evaluate_quality(model, task, data, budgets, schedules, disable_tqdm),
    }
    if task == "synthetic":
        # guessing among the answers the held-out problems have (a digit mod 10 for the arithmetic chains)
        record["chance"] = {"em": 1 / len(set(rows["answers"])), "ppl": float(len(set(rows["answers"])))}
    if halt_eps and model.config.num_loops > 1:
        record["halting"] = (halting or evaluate_halting)(model, task, data, halt_eps)
    states, mask = step_states(model, data, meta, repr_rows)
    record["representations"] = representations.per_step_metrics(states, mask)
    if generate_budgets:  # checked against num_loops in `check_generate_budgets`; Base has a single depth
        gen_budgets = sorted(set(generate_budgets)) if model.config.num_loops > 1 else [1]
        record["generations"] = generations(model, tokenizer, task, rows, gen_budgets)
    return record
