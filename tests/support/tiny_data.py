"""Tiny datasets the tests feed the models."""

import torch
from datasets import Dataset


def grid_dataset(rows=6, labels=True):
    """`rows` 4x4 grids of tokens 0..6 (seed 0) and, with `labels`, random labels 1..6."""
    g = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(0, 7, (rows, 16), generator=g).tolist()}
    if labels:
        data["labels"] = torch.randint(1, 7, (rows, 16), generator=g).tolist()
    return Dataset.from_dict(data)


def left_padded(prompts, pad_token_id=0):
    """One batch of the 1-D token tensors `prompts`, left-padded with `pad_token_id`: (input_ids, attention_mask)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    return ids, mask


# a log-likelihood task for lm-evaluation-harness over a JSON-lines file ({data}), perplexity of the continuation
LM_EVAL_TASK_YAML = """task: tiny_loglik
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
