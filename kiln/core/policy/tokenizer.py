"""In-process training of the tiny model's byte-level BPE tokenizer (Qwen-style, deterministic).

Byte-level BPE over a Qwen2/Qwen3-style pre-tokenizer split, NFC normaliser, ~1k vocabulary,
special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and added tokens ``<think>``,
``</think>``. Wrapped as a transformers fast tokenizer carrying Kiln's ChatML template
(:mod:`kiln.core.policy.chat_template`). Training takes well under a second and, for the same corpus,
produces byte-identical files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kiln.core.policy.chat_template import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
)

# The split pattern of Qwen2/Qwen3 tokenizers (contractions, letters, single digits, punctuation,
# newlines, spaces).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_bpe(
    corpus: list[str],
    vocab_size: int = 1024,
    special_tokens: tuple[str, ...] | list[str] = tuple(SPECIAL_TOKENS),
    added_tokens: tuple[str, ...] | list[str] = tuple(ADDED_TOKENS),
) -> Tokenizer:
    """Train the raw ``tokenizers.Tokenizer`` on ``corpus`` (deterministic for a given corpus)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()  # the byte-level decoder takes no options
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    if added_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return tok


def wrap_fast(
    tok: Tokenizer,
    *,
    chat_template: str = CHAT_TEMPLATE,
    eos: str = IM_END,
    pad: str = ENDOFTEXT,
    bos: str | None = None,
    model_max_length: int = 4096,
    **options: Any,
):
    """Wrap a raw tokenizer as a transformers fast tokenizer with a chat template (Kiln's by default):
    no UNK, left padding, no clean-up of spaces; ``options`` go to the tokenizer as they are
    (the Qwen3 and harmony ones give ``split_special_tokens``, as their checkpoints do)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=pad,
        bos_token=bos,
        unk_token=None,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        **options,
    )
    fast.chat_template = chat_template
    return fast


def train_and_save(corpus: list[str], out_dir: Path, vocab_size: int = 1024):
    """Train, wrap and ``save_pretrained`` into ``out_dir``; returns the fast tokenizer."""
    fast = wrap_fast(train_bpe(corpus, vocab_size))
    fast.save_pretrained(str(out_dir))
    return fast
