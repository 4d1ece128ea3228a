"""Random-init models of real architectures with Qwen's real tokenizer (``kiln model random``).

For scale tests and benchmarks: the weights are random (throughput, memory, tokenisation and the
token-in/token-out paths are real; quality is not). The folder holds the Qwen3 fast tokenizer built
from ``qwen.tiktoken`` (:mod:`kiln.core.policy.qwen_vocab`) with Kiln's Qwen3-behaviour chat template
(:data:`kiln.core.policy.templates.QWEN3_TEMPLATE`), a model of the named shape saved as safetensors in
``dtype`` with the hub's folder layout, and a generation config. Same seed, same bytes.

Shapes (:data:`SHAPES`): the real configs of Qwen3 0.6B/4B, Qwen3.5 0.8B/4B (the hub's
vision-language layout: ``Qwen3_5ForConditionalGeneration`` with ``text_config`` + ``vision_config``
and the 248,320-row vocabulary), Qwen3-30B-A3B (MoE) and gpt-oss-20b, plus ``tiny`` (a few-MB Qwen3)
and ``qwen3.5-tiny`` (the Qwen3.5 hub layout at a tiny width). ``layers`` keeps fewer layers and the
layer pattern: it must be a multiple of the pattern's period (4 for Qwen3.5: three Gated DeltaNet
layers, one full-attention layer; 2 for gpt-oss: sliding, full), and a composite's vision tower
shrinks in proportion (at least one block; Kiln never loads it, the folder keeps the hub layout).
The tokenizer's special ids are Qwen3's, so a shape whose shipped tokenizer differs (Qwen3.5,
gpt-oss) gets its ``eos``/``pad`` ids set to the copied tokenizer's; its vocabulary size stays
the shipped one (embedding rows above the copied tokenizer's ids exist, as in the real model, and
decode to nothing the tokenizer knows). The gpt-oss shapes (``gpt-oss-20b``, and ``gpt-oss-tiny``
at a tiny width) speak harmony, as the hub's checkpoints do: their tokenizer is the Qwen3 one with
harmony's special tokens appended (:func:`kiln.core.policy.qwen_vocab.harmony_tokenizer`) and
Kiln's harmony template (:mod:`kiln.core.policy.harmony`); ``eos`` is ``<|return|>`` (the
generation config also stops at ``<|call|>``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.core.policy.qwen_vocab import QWEN3_VOCAB_SIZE, build_qwen_tokenizer, harmony_tokenizer

QWEN_EOS, QWEN_PAD = 151645, 151643  # <|im_end|>, <|endoftext|> of the copied Qwen tokenizer
# <|return|> and <|call|> of the harmony tokenizer (harmony's tokens appended after Qwen3's 151,669)
HARMONY_RETURN, HARMONY_CALL = 151670, 151676

# The tiny models' width (Kiln's own tiny Qwen3, the "tiny" shapes): 64 wide, 4 heads of 16, 2 KV heads.
TINY_WIDTH: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}

_QWEN3_COMMON: dict[str, Any] = {
    "vocab_size": QWEN3_VOCAB_SIZE,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 151643,
    "eos_token_id": QWEN_EOS,
    "pad_token_id": QWEN_PAD,
}
# Qwen3.5's text stack (Qwen/Qwen3.5-0.8B and -4B config.json text_config; transformers 5.24's
# Qwen3_5TextConfig documents the same fields): Gated DeltaNet layers with 128-wide key/value
# heads and a 4-tap convolution, one gated full-attention layer in every 4, partial rotary 0.25,
# M-RoPE sections [11, 11, 10], rope theta 1e7, 262,144 positions, vocabulary 248,320.
_QWEN35_TEXT: dict[str, Any] = {
    "vocab_size": 248320,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "eos_token_id": QWEN_EOS,
    "pad_token_id": QWEN_PAD,
}
_QWEN35_VISION: dict[str, Any] = {
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 2304,
}
# Qwen3.5's special ids of the vision placeholders (Qwen3_5Config's defaults, the hub's values).
_QWEN35_TOP: dict[str, Any] = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": True,
}


# openai/gpt-oss-20b's config.json fields its sizes do not change (vocabulary 201,088, 131,072
# positions, attention biases, untied embeddings), with the harmony tokenizer's special ids.
_GPT_OSS_COMMON: dict[str, Any] = {
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": True,
    "eos_token_id": HARMONY_RETURN,
    "pad_token_id": QWEN_PAD,
}


@dataclass(frozen=True)
class Shape:
    """One real shape: transformers' config and model class names, the config values, and for a
    composite checkpoint the text and vision sub-configs (``values`` then holds the top level)."""

    config_class: str
    model_class: str
    values: dict[str, Any]
    period: int = 1  # the layer pattern's length: ``layers`` must be a multiple of it
    text: dict[str, Any] | None = None
    vision: dict[str, Any] | None = None
    template: str = "qwen3"  # the tokenizer and chat template: qwen3, or harmony (gpt-oss)
    notes: str = field(default="", compare=False)


SHAPES: dict[str, Shape] = {
    # Qwen/Qwen3-0.6B's config.json
    "qwen3-0.6b": Shape(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            **_QWEN3_COMMON,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
        },
    ),
    # Qwen/Qwen3-4B's config.json
    "qwen3-4b": Shape(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            **_QWEN3_COMMON,
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
        },
    ),
    # A few-MB model with the real vocabulary and template (tests of the real TI/TO paths).
    "tiny": Shape(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {**_QWEN3_COMMON, **TINY_WIDTH, "num_hidden_layers": 2},
    ),
    # Qwen/Qwen3.5-0.8B's config.json (24 layers, [3 linear, 1 full] x 6, tied embeddings).
    "qwen3.5-0.8b": Shape(
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        dict(_QWEN35_TOP),
        period=4,
        text={
            **_QWEN35_TEXT,
            "hidden_size": 1024,
            "intermediate_size": 3584,
            "num_hidden_layers": 24,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 16,
        },
        vision={
            **_QWEN35_VISION,
            "depth": 12,
            "hidden_size": 768,
            "num_heads": 12,
            "intermediate_size": 3072,
            "out_hidden_size": 1024,
        },
    ),
    # Qwen/Qwen3.5-4B's config.json (32 layers, [3 linear, 1 full] x 8, tied embeddings).
    "qwen3.5-4b": Shape(
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        dict(_QWEN35_TOP),
        period=4,
        text={
            **_QWEN35_TEXT,
            "hidden_size": 2560,
            "intermediate_size": 9216,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
        },
        vision={
            **_QWEN35_VISION,
            "depth": 24,
            "hidden_size": 1024,
            "num_heads": 16,
            "intermediate_size": 4096,
            "out_hidden_size": 2560,
        },
    ),
    # The Qwen3.5 hub layout at a tiny width (real vocabulary): for tests of the composite path.
    "qwen3.5-tiny": Shape(
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        dict(_QWEN35_TOP),
        period=4,
        text={
            **_QWEN35_TEXT,
            **TINY_WIDTH,
            "num_hidden_layers": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "rope_parameters": {**_QWEN35_TEXT["rope_parameters"], "mrope_section": [1, 1, 0]},
        },
        vision={
            **_QWEN35_VISION,
            "depth": 1,
            "hidden_size": 32,
            "num_heads": 2,
            "intermediate_size": 64,
            "out_hidden_size": 64,
        },
    ),
    # Qwen/Qwen3-30B-A3B's config.json (transformers' Qwen3MoeConfig defaults are its -Base
    # sibling's: 2048 wide, 128 experts of 768, 8 per token); 48 layers, normalised top-k.
    "qwen3-30b-a3b": Shape(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_QWEN3_COMMON,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),
    # openai/gpt-oss-20b's config.json (transformers' GptOssConfig documents that checkpoint; its
    # defaults are the 120b's 36 layers and 128 experts): 24 layers alternating sliding (128) and
    # full attention, 32 experts, 4 per token, yarn rope, vocabulary 201,088.
    "gpt-oss-20b": Shape(
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **_GPT_OSS_COMMON,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
        },
        period=2,
        template="harmony",
    ),
    # gpt-oss's layer pattern, experts and vocabulary at a tiny width: for tests of the harmony path.
    "gpt-oss-tiny": Shape(
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **_GPT_OSS_COMMON,
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
        },
        period=2,
        template="harmony",
    ),
}


def _fewer_layers(shape_name: str, shape: Shape, layers: int | None) -> tuple[int | None, int | None]:
    """The text layer count and the vision depth for ``layers`` (None: as shipped)."""
    if layers is None:
        return None, None
    if layers < 1:
        raise ValueError("layers must be >= 1")
    if layers % shape.period:
        raise ValueError(f"layers for {shape_name} must be a multiple of {shape.period} (its layer pattern)")
    if shape.vision is None:
        return layers, None
    shipped = int((shape.text or {})["num_hidden_layers"])
    return layers, max(1, math.ceil(shape.vision["depth"] * layers / shipped))


def shape_config(shape: str, *, layers: int | None = None) -> Any:
    """The transformers config of ``shape`` (``layers`` keeps fewer layers and their pattern)."""
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    spec = SHAPES[shape]
    text_layers, vision_depth = _fewer_layers(shape, spec, layers)
    config_class = getattr(transformers, spec.config_class)
    if spec.text is None:
        values = dict(spec.values)
        if text_layers is not None:
            values["num_hidden_layers"] = text_layers
        return config_class(**values)
    text, vision = dict(spec.text), dict(spec.vision or {})
    if text_layers is not None:
        text["num_hidden_layers"], vision["depth"] = text_layers, vision_depth
    config = config_class(text_config=text, vision_config=vision, **spec.values)
    config.architectures = [spec.model_class]
    return config


def build_random_model(
    out_dir: Path,
    *,
    shape: str = "qwen3-0.6b",
    layers: int | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
    tokenizer: Any = None,
) -> Path:
    """Write the tokenizer, config and random weights into ``out_dir``; returns ``out_dir``.

    ``tokenizer`` reuses an already built Qwen tokenizer (conversion takes several seconds)."""
    import torch
    import transformers

    from kiln.core.policy.device import TORCH_DTYPES

    config = shape_config(shape, layers=layers)
    model_class = getattr(transformers, SHAPES[shape].model_class)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_qwen_tokenizer()
    stops = [QWEN_EOS]
    if SHAPES[shape].template == "harmony":
        tok = harmony_tokenizer(tok)
        stops = [HARMONY_RETURN, HARMONY_CALL]
        assert tok.convert_tokens_to_ids(["<|return|>", "<|call|>"]) == stops
    tok.save_pretrained(str(out_dir))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(TORCH_DTYPES[dtype])
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.do_sample = True
    model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    model.generation_config.pad_token_id = QWEN_PAD
    model.save_pretrained(str(out_dir))
    return out_dir


__all__ = ["HARMONY_CALL", "HARMONY_RETURN", "SHAPES", "Shape", "build_random_model", "shape_config"]
