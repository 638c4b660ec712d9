"""What a LoopFormer run trains and evaluates on (`build_data`): the synthetic corpus with its BPE, or text, streamed
or from token files (`--data_dir`, or the folder `--train_files` / `--dataset_name` is prepared into once), with the
tokenizer `sources` chooses."""

import datasets

from looped_training.loopformer.data import TASKS, held_out_problems, sources, synthetic, text_cache, token_files
from looped_training.loopformer.data.tokenizer import train_bpe_tokenizer


def build_data(data_args, model_args, source=None, rank=0, world_size=1, evaluate=True):
    """(tokenizer, train dataset, eval dataset or None, block_size). `source`: the (model, tokenizer) of
    --model_name_or_path, whose tokenizer and context the data then follows. `evaluate`: whether the run evaluates
    (a streamed run reads its held-out windows only then)."""
    if data_args.task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}, got {data_args.task!r}.")
    source_model, source_tokenizer = source or (None, None)
    if data_args.task == "synthetic":
        train_problems = synthetic.make_problems(
            data_args.num_train_problems,
            data_args.min_depth,
            data_args.max_depth,
            data_args.num_chains,
            seed=data_args.corpus_seed,
            kind=data_args.synthetic_kind,
        )
        eval_problems = held_out_problems(data_args)
        tokenizer = source_tokenizer or train_bpe_tokenizer(
            [p.text for p in train_problems], data_args.tokenizer_vocab_size or 300
        )
        longest = max(map(len, tokenizer([p.text for p in train_problems + eval_problems])["input_ids"]))
        block_size = data_args.block_size or longest
        train = synthetic.tokenize_problems(train_problems, tokenizer, block_size, data_args.answer_only_loss)
        evaluation = synthetic.tokenize_problems(eval_problems, tokenizer, block_size, data_args.answer_only_loss)
        train.pop("depth"), evaluation.pop("depth")
        return tokenizer, datasets.Dataset.from_dict(train), datasets.Dataset.from_dict(evaluation), block_size
    folder = data_args.data_dir
    if folder is None and not data_args.streaming:  # text files or a dataset: prepared once into datasets' cache
        folder = text_cache.prepared_folder(
            data_args, source_tokenizer, text_cache.MODEL_TOKENIZER if source_tokenizer is not None else None
        )
    corpus = token_files.open_corpus(folder) if folder is not None else None
    tokenizer = sources.choose_tokenizer(data_args, corpus, source_tokenizer)
    context = source_model.config.max_position_embeddings if source_model is not None else None
    block_size = data_args.block_size or context or sources.DEFAULT_BLOCK_SIZE
    if context is not None and block_size > context and source_model.config.position_embedding_type == "learned":
        raise ValueError(
            f"--block_size {block_size} is longer than --model_name_or_path's context of {context} learned positions."
        )
    vocab_size = (
        source_model.config.vocab_size if source_model is not None else model_args.vocab_size or len(tokenizer)
    )
    if corpus is not None:
        # the text cache's folder is the run's own: no held-out document is refused where the run evaluates
        train, evaluation = sources.token_data(
            folder, data_args, block_size, vocab_size, evaluate=evaluate and data_args.data_dir is None
        )
        return tokenizer, train, evaluation, block_size
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary of {vocab_size}: its ids "
            f"would have no embedding."
        )
    train = sources.stream_windows(data_args, tokenizer, block_size, "train", rank, world_size)
    evaluation = sources.stream_eval_windows(data_args, tokenizer, block_size) if evaluate else None
    return tokenizer, train, evaluation, block_size
