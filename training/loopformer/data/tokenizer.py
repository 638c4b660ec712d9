"""A byte-level BPE trained with `tokenizers` on the training text, wrapped as a `PreTrainedTokenizerFast`.

Saved next to the weights (`tokenizer.json`, `tokenizer_config.json`), so `AutoTokenizer.from_pretrained(folder)`
returns it.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"


def train_bpe_tokenizer(texts, vocab_size=512, min_frequency=2):
    """Train a byte-level BPE of at most `vocab_size` tokens (256 bytes + merges + `<|endoftext|>`) on `texts`."""
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"`vocab_size` must be an integer >= 257 (256 bytes + <|endoftext|>), got {vocab_size!r}.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        padding_side="left",  # batched generation pads on the left; training rows are padded by the data code
    )
