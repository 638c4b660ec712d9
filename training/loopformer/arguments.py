"""The flags of `python -m looped_training.loopformer.train`, in the style of transformers' run_clm.py: the model
(`ModelArguments`, its variant one of `VARIANTS`), the data (`DataArguments`, which the run writes next to the model
and `python -m looped_training.loopformer.evaluate` reads back), the shortcut-consistency objective
(`ShortcutArguments`), the learning-rate warm-up (`ScheduleArguments`), and `looped_training.arguments.TrainingArguments`;
and those of `python -m looped_training.loopformer.prepare` (`PrepareArguments`, checked by `check_args`)."""

from dataclasses import dataclass, field

from looped_training.arguments import check_output_path
from looped_training.loopformer.data import TASKS
from looped_training.schedules import LR_WARMUPS

# variant -> (loop_conditioning, looped, callback trajectory or None, default λ2, weighted block norms)
VARIANTS = {
    "loopformer": ("shortcut", True, "shortcut", 0.1, False),
    "base_loop": ("none", True, None, 0.0, True),
    "tmlt": ("timestep", True, None, 0.0, False),
    "naive_loop_ee": ("none", True, "early_exit", 0.1, True),
    "tmlt_ee": ("timestep", True, "early_exit", 0.1, False),
    "base": ("none", False, None, 0.0, True),
}


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default=None,
        metadata={
            "help": "Continue training from these weights and their tokenizer: a folder or Hub id of a LoopFormer "
            "(ours, or one of the authors' repos). The model's shape is the checkpoint's; a model flag "
            "that contradicts it is refused."
        },
    )
    variant: str = field(default="loopformer", metadata={"help": f"One of {tuple(VARIANTS)}."})
    hidden_size: int = field(default=128, metadata={"help": "Width d of the residual stream."})
    num_blocks: int = field(default=1, metadata={"help": "k, shared blocks per loop step (base: k·L blocks, 1 step)."})
    num_loops: int = field(default=8, metadata={"help": "L, loop steps of the training trajectory."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads."})
    intermediate_size: int = field(default=None, metadata={"help": "MLP width (default 4·hidden_size)."})
    position_embedding_type: str = field(default="learned", metadata={"help": "'learned' or 'rope'."})
    vocab_size: int = field(
        default=None,
        metadata={"help": "Embedding rows (default: the tokenizer's size; the authors' GPT-2 runs have 50304)."},
    )
    initializer_scheme: str = field(
        default="reference",
        metadata={
            "help": "'reference' (the authors' effective init) or 'zero_adaln' (adaLN zeroed); see LoopFormerConfig."
        },
    )


@dataclass
class ScheduleArguments:
    lr_warmup: str = field(
        default="reference",
        metadata={
            "help": f"One of {LR_WARMUPS}: 'reference' warms up as the authors' get_lr, peak·(s+1)/(W+1) over the W "
            f"warm-up steps, then the Trainer's --lr_scheduler_type (cosine_with_min_lr is then theirs); "
            f"'trainer': the Trainer's own warm-up, peak·s/W (step 0 at lr 0)."
        },
    )
    # how fast a step runs, not what it computes (as fprm.train's; docs/training.md, "Threads and a busy machine")
    torch_threads: int | None = field(
        default=None,
        metadata={"help": "torch.set_num_threads (1 is fastest for small models on a busy CPU; default: torch's)"},
    )


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
            "--model_name_or_path, else --data_dir's, else the package's BPE trained on the text by prepare (not "
            "with --streaming)."
        },
    )
    max_eval_samples: int = field(
        default=None,
        metadata={"help": "Held-out windows the Trainer evaluates (token files: all; a stream: 256)."},
    )
    dataset_name: str = field(
        default=None,
        metadata={
            "help": "A datasets name or path (task=text; a folder of .txt: one document a file, as --train_files). "
            "Without --data_dir or --streaming, prepared once into token files in datasets' cache and reused."
        },
    )
    dataset_config_name: str = field(default=None, metadata={"help": "The datasets configuration name."})
    train_files: list[str] = field(
        default=None,
        metadata={
            "help": "Text files or folders of .txt, one document a file (task=text); prepared once into token files "
            "in datasets' cache (reused while the files and settings stay the same), unless --streaming."
        },
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text (dataset_name)."})
    validation_fraction: float = field(
        default=0.05,
        metadata={"help": "Share of whole documents held out (prepare's seeded hash), streamed or not."},
    )
    max_train_chars: int = field(
        default=None,
        metadata={"help": "Refused: it capped the in-memory text path, now gone (cap a run with --max_steps)."},
    )
    block_size: int = field(default=None, metadata={"help": "Tokens per row (default: 128 text, longest problem)."})
    window_targets: bool = field(
        default=True,
        metadata={
            "help": "Text windows of T tokens train T next-token targets, the last one the token after the window (the "
            "authors' get_batch: y = data[i+1:i+T+1]), on every text path; false is refused (it was the gone "
            "in-memory path's run_clm rows of T - 1 targets)."
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


@dataclass
class ShortcutArguments:
    lambda_short: float = field(default=0.1, metadata={"help": "λ1: weight of CE on the short trajectory."})
    lambda_consistency: float = field(default=None, metadata={"help": "λ2 (default 0.1 for loopformer and -EE)."})
    consistency_warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up of λ1, λ2 (steps)."})
    consistency: str = field(default="mse", metadata={"help": "'mse' on final hidden states or 'kl' on logits."})
    shortcut_seed: int = field(default=0, metadata={"help": "Seed of the trajectory sampler (same on all ranks)."})
    log_trajectories: bool = field(default=False, metadata={"help": "Write each rank's sampled trajectories."})


@dataclass
class PrepareArguments:
    output_dir: str = field(metadata={"help": "Folder of train.bin, val.bin, tokens.json and the tokenizer."})
    dataset_name: str = field(default=None, metadata={"help": "A datasets name or path (its train split)."})
    dataset_config_name: str = field(default=None, metadata={"help": "The datasets configuration name."})
    train_files: list[str] = field(
        default=None,
        metadata={"help": "Text files or folders of .txt (one document a file), or .json/.jsonl/.csv/.parquet files."},
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text (not for .txt files)."})
    tokenizer_name: str = field(
        default=None,
        metadata={"help": "Any AutoTokenizer (a Hub id such as gpt2, or a folder); default: train the package's BPE."},
    )
    tokenizer_vocab_size: int = field(default=1024, metadata={"help": "Size of the BPE trained without a tokenizer."})
    validation_fraction: float = field(default=0.05, metadata={"help": "Share of whole documents held out (val.bin)."})
    seed: int = field(default=0, metadata={"help": "Seed of the document split."})
    num_proc: int = field(default=1, metadata={"help": "Processes of the tokenizing map (not with --streaming)."})
    streaming: bool = field(default=False, metadata={"help": "Stream the corpus instead of downloading it whole."})
    max_documents: int = field(default=None, metadata={"help": "Read the first N documents only (small runs)."})
    batch_size: int = field(default=1000, metadata={"help": "Documents a map batch."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Replace a corpus prepared with other flags in --output_dir."}
    )


def check_args(args):
    """Every mistake a flag can make, before any work."""
    if (args.dataset_name is None) == (not args.train_files):
        raise ValueError("Give exactly one of --dataset_name or --train_files.")
    if not 0 <= args.validation_fraction < 1:
        raise ValueError(f"--validation_fraction must lie in [0, 1), got {args.validation_fraction}.")
    for name in ("num_proc", "batch_size", "max_documents"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}.")
    if args.streaming and args.num_proc > 1:
        raise ValueError(
            "--num_proc tokenizes an Arrow dataset in processes; a --streaming corpus is tokenized as it "
            "arrives: leave --num_proc at 1."
        )
    if args.streaming and args.tokenizer_name is None:
        raise ValueError("--streaming needs --tokenizer_name: the package's BPE is trained on the whole corpus first.")
    check_output_path("--output_dir", args.output_dir, folder=True)
