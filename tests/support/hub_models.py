"""Random models of newer families in the hub's folder layout, for the vllm engine's tests.

- :func:`build_qwen35_hub_model`: a Qwen3.5 checkpoint as the hub ships it, a composite
  vision-language ``Qwen3_5Config`` (``text_config`` + ``vision_config``, architectures
  ``Qwen3_5ForConditionalGeneration``, weights under ``model.language_model.*`` and
  ``model.visual.*``) whose text stack keeps the family's pattern (three Gated DeltaNet
  ``linear_attention`` layers, then one ``full_attention`` layer), with a small hidden size.
- :func:`build_qwen3_moe_model`: a ``Qwen3MoeForCausalLM`` with a few small experts, and
  :func:`build_qwen3_dense_model`, a ``Qwen3ForCausalLM`` of the same small sizes.

Both carry Kiln's Qwen tokenizer and template (:func:`kiln.core.policy.qwen_vocab.build_qwen_tokenizer`,
vocabulary 151,936) and weights of ``initializer_range`` 0.2, so sampling is not near-uniform.
Head sizes are ones vLLM's CPU attention accepts (128). ``kiln model random --shape`` builds the
real shapes; these builders stay small on purpose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.policy.qwen_vocab import QWEN3_VOCAB_SIZE

_SPECIAL_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
# Qwen3's vision token ids in its tokenizer (the hub's Qwen3.5 ids are those of its larger vocabulary)
_VISION_IDS = {"image_token_id": 151655, "video_token_id": 151656,
               "vision_start_token_id": 151652, "vision_end_token_id": 151653}


# Text-stack sizes of a Qwen3.5 checkpoint for the benchmark, read from the product's one shape
# table (``kiln model random --shape``, kiln/core/policy/random_model.py); its vocabulary of 248,320
# rows is kept, Kiln's Qwen tokenizer fills the first 151,669.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "linear_num_key_heads", "linear_num_value_heads")


def _real_text_sizes(name: str) -> dict[str, Any]:
    from kiln.core.policy.random_model import SHAPES

    text = SHAPES[name].text or {}
    return {**{key: text[key] for key in _SHAPE_KEYS}, "initializer_range": 0.02}


QWEN35_SHAPES: dict[str, dict[str, Any]] = {"qwen3.5-4b": _real_text_sizes("qwen3.5-4b")}


def _mrope_section(head_dim: int) -> list[int]:
    """The multimodal rotary sections of a head of ``head_dim`` with a quarter of it rotated: they
    cover half the rotated dims ([11, 11, 10] for the shipped 256, as vLLM checks)."""
    half = int(head_dim * 0.25) // 2
    third, rest = divmod(half, 3)
    return [third + (1 if i < rest else 0) for i in range(3)]


def qwen35_hub_config(*, hidden_size: int = 256, groups: int = 1, shape: str | None = None) -> Any:
    """The composite ``Qwen3_5Config``: ``groups`` × (3 linear-attention + 1 full-attention) text
    layers of width ``hidden_size`` (or of ``shape``'s sizes, a key of :data:`QWEN35_SHAPES`), and
    a one-block vision tower."""
    from transformers import Qwen3_5Config

    text = {
        **_SPECIAL_IDS, "vocab_size": QWEN3_VOCAB_SIZE, "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size, "num_hidden_layers": 4 * groups,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 8192, "initializer_range": 0.2, "tie_word_embeddings": True,
        **(QWEN35_SHAPES[shape] if shape else {}),
    }
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": _mrope_section(text["head_dim"]), "mrope_interleaved": True}
    vision = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
              "out_hidden_size": text["hidden_size"], "num_position_embeddings": 64, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, **_VISION_IDS)


def _save(model: Any, out_dir: Path, tokenizer: Any) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer
    if tok is None:
        from kiln.core.policy.qwen_vocab import build_qwen_tokenizer

        tok = build_qwen_tokenizer()
    tok.save_pretrained(str(out_dir))
    model.generation_config.do_sample = True
    model.generation_config.eos_token_id = _SPECIAL_IDS["eos_token_id"]
    model.generation_config.pad_token_id = _SPECIAL_IDS["pad_token_id"]
    model.save_pretrained(str(out_dir))
    return out_dir


def build_qwen35_hub_model(out_dir: Path, *, hidden_size: int = 256, groups: int = 1, seed: int = 0,
                           tokenizer: Any = None, shape: str | None = None, dtype: str = "float32") -> Path:
    """A random ``Qwen3_5ForConditionalGeneration`` checkpoint in the hub layout, in ``dtype``."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from kiln.core.policy.device import TORCH_DTYPES

    config = qwen35_hub_config(hidden_size=hidden_size, groups=groups, shape=shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(TORCH_DTYPES[dtype])
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3_5ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    return _save(model, Path(out_dir), tokenizer)


def build_qwen3_dense_model(out_dir: Path, *, hidden_size: int = 256, layers: int = 2, seed: int = 0,
                            tokenizer: Any = None) -> Path:
    """A random ``Qwen3ForCausalLM`` of the same small sizes as the MoE model, float32."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **_SPECIAL_IDS, vocab_size=QWEN3_VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        max_position_embeddings=8192, initializer_range=0.2, tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return _save(model, Path(out_dir), tokenizer)


def build_qwen3_moe_model(out_dir: Path, *, hidden_size: int = 256, layers: int = 2, experts: int = 4,
                          seed: int = 0, tokenizer: Any = None) -> Path:
    """A random ``Qwen3MoeForCausalLM``: ``experts`` experts per layer, 2 active, float32."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **_SPECIAL_IDS, vocab_size=QWEN3_VOCAB_SIZE, hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_experts=experts,
        num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=8192,
        initializer_range=0.2, tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    return _save(model, Path(out_dir), tokenizer)


__all__ = ["QWEN35_SHAPES", "build_qwen35_hub_model", "build_qwen3_dense_model", "build_qwen3_moe_model", "qwen35_hub_config"]
