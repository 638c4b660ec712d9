"""LoopFormer data: the synthetic multi-hop reasoning corpus (`synthetic`), flat token files read by memmap
(`token_files`, `TokenWindows`), text files or a dataset prepared once into such files in datasets' cache
(`text_cache`), documents through `datasets` for prepare and streaming (`corpus`),
which of these a text run reads with which tokenizer (`sources`), the byte-level BPE tokenizer (`tokenizer`), what a
run trains and evaluates on (`build.build_data`), and the held-out data of the data arguments
(`looped_training.loopformer.arguments.DataArguments`) that `train` writes next to the model (`TRAINING_META_FILE`)
and `evaluate` reads back."""

from looped_training.loopformer.data import synthetic
from looped_training.loopformer.data.token_files import TokenWindows

__all__ = ["TASKS", "TRAINING_META_FILE", "TokenWindows", "held_out_problems"]

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
