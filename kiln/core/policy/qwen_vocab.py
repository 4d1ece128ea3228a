"""Qwen's real BPE vocabulary, offline: ``qwen.tiktoken`` → a transformers fast tokenizer.

The ranks file ships inside the ``dashscope`` wheel (``dashscope/resources/qwen.tiktoken``,
151,643 byte-level BPE ranks); ``scripts/setup.sh`` installs that wheel with ``--no-deps``, so the
file is on disk after setup and nothing is downloaded when a model is built. ``KILN_QWEN_TIKTOKEN``
points at another copy. Conversion uses transformers' ``TikTokenConverter`` (merges recovered from
the ranks) with Qwen's pre-tokenizer split (single digits) and Qwen3's special tokens at their real
ids (151643…151668); the vocabulary is padded to Qwen3's 151,936 embedding rows by the model config.
:func:`harmony_tokenizer` turns it into a gpt-oss-style tokenizer: harmony's special tokens appended
after Qwen3's (151669…151676) and Kiln's harmony template (:mod:`kiln.core.policy.harmony`).
"""

from __future__ import annotations

import base64
import importlib.util
import os
from pathlib import Path

from kiln.core.errors import ModelNotFound
from kiln.core.policy.templates import QWEN3_TEMPLATE
from kiln.core.policy.tokenizer import QWEN_SPLIT_PATTERN, wrap_fast

QWEN_RANKS = 151643
QWEN3_VOCAB_SIZE = 151936
# Qwen3's added tokens, in id order from 151643; True = special (skipped when decoding without specials).
QWEN3_ADDED = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]


def qwen_tiktoken_path() -> Path:
    """Where ``qwen.tiktoken`` is: ``KILN_QWEN_TIKTOKEN``, else inside the installed dashscope
    package (located without importing it)."""
    explicit = os.environ.get("KILN_QWEN_TIKTOKEN")
    if explicit:
        path = Path(explicit)
    else:
        spec = importlib.util.find_spec("dashscope")
        origin = spec.origin if spec is not None else None
        path = Path(origin).parent / "resources" / "qwen.tiktoken" if origin else Path("qwen.tiktoken")
    if not path.is_file():
        raise ModelNotFound(
            f"Qwen's BPE ranks file is not installed ({path})",
            hint="run scripts/setup.sh (it installs `dashscope==2.0.2` with --no-deps, which ships "
            "qwen.tiktoken), or set KILN_QWEN_TIKTOKEN to a copy of the file",
            details={"path": str(path)},
        )
    return path


def read_ranks(path: Path) -> dict[bytes, int]:
    """``base64-token rank`` lines → {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_qwen_tokenizer(path: Path | None = None, *, chat_template: str = QWEN3_TEMPLATE):
    """The Qwen3 fast tokenizer (real vocabulary, special tokens at their real ids)."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return read_ranks(Path(tiktoken_url))

    source = Path(path) if path is not None else qwen_tiktoken_path()
    tok = _Converter(vocab_file=str(source), pattern=QWEN_SPLIT_PATTERN).converted()
    tok.post_processor = None
    base = tok.get_vocab_size(with_added_tokens=False)
    if base != QWEN_RANKS:
        raise ModelNotFound(f"{source} holds {base} ranks, expected Qwen's {QWEN_RANKS}")
    tok.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in QWEN3_ADDED])
    return wrap_fast(
        tok,
        chat_template=chat_template,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        model_max_length=40960,
        split_special_tokens=False,
    )


def harmony_tokenizer(qwen_tok=None):
    """A copy of the Qwen3 tokenizer (``qwen_tok``, else built) with harmony's special tokens
    appended (the ones Qwen3 lacks, in gpt-oss's order), Kiln's harmony template, ``<|return|>`` as
    its end-of-sequence token and ``<|endoftext|>`` as padding. ``qwen_tok`` is not modified."""
    from tokenizers import AddedToken, Tokenizer

    from kiln.core.policy import harmony

    base = qwen_tok if qwen_tok is not None else build_qwen_tokenizer()
    tok = Tokenizer.from_str(base.backend_tokenizer.to_str())
    known = tok.get_vocab(with_added_tokens=True)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in harmony.SPECIAL_TOKENS if t not in known]
    )
    return wrap_fast(
        tok,
        chat_template=harmony.TEMPLATE,
        eos=harmony.RETURN,
        pad=harmony.ENDOFTEXT,
        model_max_length=131072,
        split_special_tokens=False,
    )


__all__ = [
    "QWEN3_ADDED",
    "QWEN3_VOCAB_SIZE",
    "build_qwen_tokenizer",
    "harmony_tokenizer",
    "qwen_tiktoken_path",
    "read_ranks",
]
