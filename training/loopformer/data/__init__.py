"""LoopFormer data: the synthetic multi-hop reasoning corpus (`synthetic`), text in memory (`text`), flat token files
read by memmap (`token_files`, `TokenWindows`), documents through `datasets` for prepare and streaming (`corpus`),
which of these a text run reads with which tokenizer (`sources`), the byte-level BPE tokenizer (`tokenizer`), and the
data arguments a run is trained on, which `train` writes next to the model (`TRAINING_META_FILE`) and `evaluate`
reads back to rebuild the same held-out data."""

from dataclasses import dataclass, field

from looped_training.loopformer.data import synthetic, text
from looped_training.loopformer.data.token_files import TokenWindows

__all__ = ["TASKS", "TRAINING_META_FILE", "DataArguments", "TokenWindows", "held_out_problems", "held_out_text"]

TRAINING_META_FILE = "loopformer_training.json"
TASKS = ("synthetic", "text")


@dataclass
class DataArguments:
    preset: str = field(
        default=None,
        metadata={
            "help": "A shipped preset by name (`python -m looped_training.configs loopformer` lists them): "
            "`--preset synthetic-tiny` reads training/configs/loopformer/synthetic-tiny.yaml, as "
            "`--config` with that file would; flags given override its values."
        },
    )
    task: str = field(default="synthetic", metadata={"help": f"One of {TASKS}."})
    data_dir: str = field(
        default=None,
        metadata={
            "help": "Token files to train on (task=text): the --output_dir of `python -m "
            "looped_training.loopformer.prepare`, or the authors' folder (train.bin, optionally val.bin, uint16 GPT-2 "
            "ids), read by memmap."
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Train straight from a streamed --dataset_name or --train_files (tokenized on the fly, packed into "
            "windows, split across ranks); needs --max_steps."
        },
    )
    tokenizer_name: str = field(
        default=None,
        metadata={
            "help": "Any AutoTokenizer (a Hub id such as gpt2, or a folder), on every text path; default: the one of "
            "--model_name_or_path, else --data_dir's, else the package's BPE trained on the text (in-memory path only)."
        },
    )
    max_eval_samples: int = field(
        default=None,
        metadata={"help": "Held-out windows the Trainer evaluates (token files: all; a stream: 256)."},
    )
    dataset_name: str = field(default=None, metadata={"help": "A datasets name or path (task=text)."})
    dataset_config_name: str = field(default=None, metadata={"help": "The datasets configuration name."})
    train_files: list[str] = field(default=None, metadata={"help": "Text files or folders of .txt (task=text)."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text (dataset_name)."})
    validation_fraction: float = field(
        default=0.05,
        metadata={"help": "Text held out: the tail of each document (in memory), or whole documents (--streaming)."},
    )
    max_train_chars: int = field(default=None, metadata={"help": "Cap on training characters (text, small runs)."})
    block_size: int = field(default=None, metadata={"help": "Tokens per row (default: 128 text, longest problem)."})
    window_targets: bool = field(
        default=True,
        metadata={
            "help": "Text training rows of T tokens train T next-token targets, the last one the token after the row "
            "(the authors' get_batch: y = data[i+1:i+T+1]); False: T - 1 targets a row, as run_clm.py."
        },
    )
    num_train_problems: int = field(default=20000, metadata={"help": "Synthetic training problems."})
    num_eval_problems: int = field(default=400, metadata={"help": "Synthetic held-out problems."})
    min_depth: int = field(default=1, metadata={"help": "Fewest hops of a synthetic problem."})
    max_depth: int = field(default=6, metadata={"help": "Most hops of a synthetic problem."})
    synthetic_kind: str = field(default="arithmetic", metadata={"help": "'arithmetic' chains or 'binding' (hops)."})
    num_chains: int = field(default=2, metadata={"help": "Binding: chains per problem (1 target + distractors)."})
    answer_only_loss: bool = field(default=True, metadata={"help": "Synthetic: CE on the answer tokens only."})
    corpus_seed: int = field(default=0, metadata={"help": "Seed of the synthetic corpus and the text split."})
    tokenizer_vocab_size: int = field(default=None, metadata={"help": "BPE size (default 300 synthetic, 1024 text)."})
    chat_template: str = field(
        default=None,
        metadata={
            "help": "A Jinja chat template file; saved with the tokenizer (tokenizer.chat_template), so that "
            "apply_chat_template and pipeline('text-generation') with chat messages work on the checkpoint."
        },
    )


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
    docs = text.read_text_documents(
        data_args.dataset_name, data_args.dataset_config_name, data_args.train_files, data_args.text_column
    )
    train_text, valid_text = text.split_documents(
        docs, data_args.validation_fraction, data_args.corpus_seed, data_args.max_train_chars
    )
    return (train_text, valid_text) if with_train else valid_text
