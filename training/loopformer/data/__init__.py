"""LoopFormer data: the synthetic multi-hop reasoning corpus (`synthetic`), text in memory (`text`), flat token files
read by memmap (`token_files`, `TokenWindows`), documents through `datasets` for prepare and streaming (`corpus`),
which of these a text run reads with which tokenizer (`sources`), the byte-level BPE tokenizer (`tokenizer`), what a
run trains and evaluates on (`build.build_data`), and the held-out data of the data arguments
(`looped_training.loopformer.arguments.DataArguments`) that `train` writes next to the model (`TRAINING_META_FILE`)
and `evaluate` reads back."""

from looped_training.loopformer.data import synthetic, text
from looped_training.loopformer.data.token_files import TokenWindows

__all__ = ["TASKS", "TRAINING_META_FILE", "TokenWindows", "held_out_problems", "held_out_text"]

TRAINING_META_FILE = "loopformer_training.json"
TASKS = ("synthetic", "text")


def held_out_problems(data_args):
    """The synthetic held-out problems (a seed the training corpus never uses)."""
    return synthetic.make_problems(
        data_args.num_eval_problems,
        data_args.min_depth,
        data_args.max_depth,
        data_args.num_chains,
        seed=f"{data_args.corpus_seed}-heldout",
        kind=data_args.synthetic_kind,
    )


def held_out_text(data_args, with_train=False):
    """The held-out documents of the in-memory text path (and the training ones, `with_train`)."""
    docs = text.read_text_documents(
        data_args.dataset_name, data_args.dataset_config_name, data_args.train_files, data_args.text_column
    )
    train_text, valid_text = text.split_documents(
        docs, data_args.validation_fraction, data_args.corpus_seed, data_args.max_train_chars
    )
    return (train_text, valid_text) if with_train else valid_text
