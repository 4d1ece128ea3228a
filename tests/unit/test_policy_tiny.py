"""The tiny demo model: deterministic build, architecture, tokenizer and template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.policy.chat_template import ADDED_TOKENS, CHAT_TEMPLATE, SPECIAL_TOKENS, render
from kiln.core.policy.identity import file_sha256, model_content_sha256
from tests.support.background import BackgroundJobs
from tests.support.models import shared_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    import torch

    torch.set_num_threads(1)
    return shared_tiny_model(tmp_path_factory)


def _digests(root: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(root.iterdir()) if p.is_file()}


@pytest.mark.background("tiny_model_rebuild")
def test_build_is_byte_identical(tiny_model_dir: Path, background_jobs: BackgroundJobs) -> None:
    """A second build, in a child process of this session (started when the session began,
    ``tests/support/background.py``), writes the same bytes as the session's build."""
    again = background_jobs.result("tiny_model_rebuild", timeout_s=280)
    assert again["files"] == _digests(tiny_model_dir)
    assert again["content"] == model_content_sha256(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(again["files"])


def test_architecture(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["hidden_size"] == 64
    assert config["num_hidden_layers"] == 2
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["intermediate_size"] == 128
    assert config["tie_word_embeddings"] is True
    assert config["initializer_range"] == pytest.approx(0.2)
    assert (tiny_model_dir / "model.safetensors").stat().st_size < 2_000_000


def test_tokenizer_and_template(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    assert 700 <= len(tok) <= 1100
    for token in SPECIAL_TOKENS + ADDED_TOKENS:
        tid = tok.convert_tokens_to_ids(token)
        assert tok.decode([tid]) == token
        assert tok.encode(token, add_special_tokens=False) == [tid]
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Count is 3."},
        {"role": "assistant", "reasoning_content": "hmm", "content": '{"amount": 1}'},
        {"role": "user", "content": "Count is 4."},
    ]
    for thinking in (True, False):
        jinja = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        assert jinja == render(messages, thinking=thinking, add_generation_prompt=True)
    text = "héllo wörld {\"amount\": 3} 12345 <think>\n</think>\n\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.timeout(120)
def test_the_guess_warm_up_writes_the_guess_format(tmp_path):
    """``warmup="guess"``: every assistant turn of its transcripts is ``{"guess": N}`` with N in 1..64,
    each observation after the first answers the previous guess, and the counter's transcripts are
    the default's (the demo model's generator is unchanged)."""
    import json
    import random

    from kiln.core.policy import tiny
    from kiln.core.policy.tiny_formats import GUESS

    rng = random.Random(7)
    for _ in range(50):
        messages, _thinking = tiny._transcript(rng, fmt=GUESS)
        users = [m for m in messages if m["role"] == "user"]
        actions = [json.loads(m["content"]) for m in messages if m["role"] == "assistant"]
        assert 1 <= len(actions) <= 8 and all(set(a) == {"guess"} and 1 <= a["guess"] <= 64 for a in actions)
        assert users[0]["content"] == "I picked a number from 1 to 64. You have 8 guesses."
        for turn, (user, previous) in enumerate(zip(users[1:], actions), start=1):
            assert user["content"].startswith(str(previous["guess"]) + " is too") or user["content"].startswith(
                f"You already guessed {previous['guess']};"
            )
            assert user["content"].endswith(f" {8 - turn} guesses left.")
    a, b = random.Random(3), random.Random(3)
    assert tiny._transcript(a) == tiny._transcript(b, fmt=tiny.COUNTER)
    assert json.loads(tiny._transcript(random.Random(3))[0][-1]["content"]).keys() == {"amount"}
