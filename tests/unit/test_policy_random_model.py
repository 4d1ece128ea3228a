"""Qwen's real vocabulary from qwen.tiktoken, and random models of real Qwen3 shapes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kiln.policy.random_model import shape_config


@pytest.fixture(scope="module")
def qwen_tok():
    from kiln.policy.qwen_vocab import build_qwen_tokenizer

    return build_qwen_tokenizer()


def test_shapes_are_the_real_architectures() -> None:
    small = shape_config("qwen3-0.6b")
    assert (small.hidden_size, small.intermediate_size, small.num_hidden_layers) == (1024, 3072, 28)
    assert (small.num_attention_heads, small.num_key_value_heads, small.head_dim) == (16, 8, 128)
    assert small.vocab_size == 151936 and small.tie_word_embeddings is True
    large = shape_config("qwen3-4b", layers=2)
    assert (large.hidden_size, large.intermediate_size, large.num_hidden_layers) == (2560, 9728, 2)
    with pytest.raises(ValueError):
        shape_config("qwen3-9b")


@pytest.mark.timeout(120)
def test_real_vocabulary_and_special_ids(qwen_tok) -> None:
    # Ids of Qwen2/Qwen3's published tokenizer.
    assert qwen_tok.encode("Hello world!", add_special_tokens=False) == [9707, 1879, 0]
    ids = {t: qwen_tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                   "<think>": 151667, "</think>": 151668}
    assert len(qwen_tok) == 151669
    text = 'Count 12 你好 <think>\nok</think>\n\n{"amount": 3}<|im_end|>'
    assert qwen_tok.decode(qwen_tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.timeout(300)
def test_same_seed_same_bytes_and_the_runtime_derives_qwen3_glue(qwen_tok, tmp_path: Path) -> None:
    from kiln.policy.random_model import build_random_model
    from kiln.policy.runtime import PolicyRuntime

    first = build_random_model(tmp_path / "a", shape="tiny", tokenizer=qwen_tok, dtype="float32")
    second = build_random_model(tmp_path / "b", shape="tiny", tokenizer=qwen_tok, dtype="float32")
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(first) == digest(second)
    rt = PolicyRuntime.load(first, device="cpu")
    assert (rt.stop_id, rt.think_close_id, rt.pad_id, rt.supports_thinking) == (151645, 151668, 151643, True)
    prompt = rt.decode(rt.encode_prompt([{"role": "user", "content": "hi"}], thinking=False))
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
