"""Qwen's real vocabulary from qwen.tiktoken, and random models of real Qwen3 shapes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kiln.core.policy.random_model import shape_config


@pytest.fixture(scope="module")
def qwen_tok():
    from kiln.core.policy.qwen_vocab import build_qwen_tokenizer

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
    from kiln.core.policy.random_model import build_random_model
    from kiln.core.policy.runtime import PolicyRuntime

    first = build_random_model(tmp_path / "a", shape="tiny", tokenizer=qwen_tok, dtype="float32")
    second = build_random_model(tmp_path / "b", shape="tiny", tokenizer=qwen_tok, dtype="float32")
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(first) == digest(second)
    rt = PolicyRuntime.load(first, device="cpu")
    assert (rt.stop_id, rt.think_close_id, rt.pad_id, rt.supports_thinking) == (151645, 151668, 151643, True)
    prompt = rt.decode(rt.encode_prompt([{"role": "user", "content": "hi"}], thinking=False))
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_new_shapes_are_the_shipped_configs_with_their_layer_pattern() -> None:
    small = shape_config("qwen3.5-0.8b")
    assert type(small).__name__ == "Qwen3_5Config" and small.architectures == ["Qwen3_5ForConditionalGeneration"]
    text, vision = small.text_config, small.vision_config
    assert (text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (248320, 1024, 3584, 24)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (8, 2, 256)
    assert (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim) == (16, 16, 128)
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"] + text.layer_types[4:]
    assert text.layer_types.count("full_attention") == 6 and (vision.depth, vision.out_hidden_size) == (12, 1024)
    four = shape_config("qwen3.5-4b", layers=8)
    assert (four.text_config.hidden_size, four.text_config.intermediate_size, four.text_config.vocab_size) == (2560, 9216, 248320)
    assert four.text_config.linear_num_value_heads == 32 and four.vision_config.out_hidden_size == 2560
    assert four.text_config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert four.vision_config.depth == 6  # 24 blocks shrunk with the text stack (8 of 32 layers)
    moe = shape_config("qwen3-30b-a3b", layers=2)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.hidden_size) == (128, 8, 768, 2048)
    assert moe.num_hidden_layers == 2 and shape_config("qwen3-30b-a3b").num_hidden_layers == 48
    oss = shape_config("gpt-oss-20b", layers=4)
    assert (oss.vocab_size, oss.num_local_experts, oss.num_experts_per_tok, oss.hidden_size) == (201088, 32, 4, 2880)
    assert oss.layer_types == ["sliding_attention", "full_attention"] * 2 and shape_config("gpt-oss-20b").num_hidden_layers == 24
    for shape, layers in (("qwen3.5-4b", 2), ("qwen3.5-0.8b", 6), ("gpt-oss-20b", 3)):
        with pytest.raises(ValueError, match="multiple of"):
            shape_config(shape, layers=layers)


@pytest.mark.timeout(300)
def test_the_qwen3_5_hub_layout_is_written_and_served_as_its_language_model(qwen_tok, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from kiln.cli.app import app as cli_app
    from kiln.core.policy.families import family_of
    from kiln.core.policy.runtime import PolicyRuntime

    refused = CliRunner().invoke(cli_app, ["model", "random", "--shape", "qwen3.5-tiny", "--layers", "3", str(tmp_path / "x")])
    assert refused.exit_code == 2 and "multiple of 4" in refused.output and not (tmp_path / "x").exists()
    from kiln.core.policy.random_model import build_random_model

    folder = build_random_model(tmp_path / "hub", shape="qwen3.5-tiny", tokenizer=qwen_tok, dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    assert config["text_config"]["vocab_size"] == 248320 and "vision_config" in config
    assert family_of(folder).composite is True
    runtime = PolicyRuntime.load(folder, device="cpu")
    assert type(runtime.model).__name__ == "Qwen3_5ForCausalLM"
    assert runtime.model.get_input_embeddings().weight.shape[0] == 248320
    assert runtime.identity()["runtime"]["model_part"] == "language_model"
    assert (runtime.stop_id, runtime.pad_id, runtime.supports_thinking) == (151645, 151643, True)


@pytest.mark.timeout(120)
def test_the_moe_shapes_have_their_published_parameter_counts() -> None:
    """Built on the meta device (no memory): Qwen3-30B-A3B has 30.5B parameters and gpt-oss-20b 20.9B
    (their model cards' totals); the Qwen3.5 composites carry their vision tower."""
    import torch
    import transformers

    from kiln.core.policy.random_model import SHAPES

    def count(shape: str) -> tuple[float, float]:
        with torch.device("meta"):
            model = getattr(transformers, SHAPES[shape].model_class)(shape_config(shape))
        total = sum(p.numel() for p in model.parameters())
        vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
        return total / 1e9, vision / 1e6

    assert round(count("qwen3-30b-a3b")[0], 1) == 30.5
    assert round(count("gpt-oss-20b")[0], 1) == 20.9
    small, small_vision = count("qwen3.5-0.8b")
    assert 0.8 < small < 0.9 and small_vision > 50
