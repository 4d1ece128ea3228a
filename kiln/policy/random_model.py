"""Random-init models of real architectures with Qwen's real tokenizer (``kiln model random``).

For scale tests and benchmarks: the weights are random (throughput, memory, tokenisation and the
token-in/token-out paths are real; quality is not). The folder holds the Qwen3 fast tokenizer built
from ``qwen.tiktoken`` (:mod:`kiln.policy.qwen_vocab`) with Kiln's Qwen3-behaviour chat template
(:data:`kiln.policy.templates.QWEN3_TEMPLATE`), a ``Qwen3ForCausalLM`` of the named shape (optionally
fewer layers) saved as safetensors in ``dtype``, and a generation config. Same seed, same bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.policy.qwen_vocab import QWEN3_VOCAB_SIZE, build_qwen_tokenizer

_QWEN3_COMMON: dict[str, Any] = {
    "vocab_size": QWEN3_VOCAB_SIZE,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
}
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-0.6B's config.json
    "qwen3-0.6b": {**_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16},
    # Qwen/Qwen3-4B's config.json
    "qwen3-4b": {**_QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32},
    # A few-MB model with the real vocabulary and template (tests of the real TI/TO paths).
    "tiny": {**_QWEN3_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
}


def shape_config(shape: str, *, layers: int | None = None) -> Any:
    """The ``Qwen3Config`` of ``shape`` (``layers`` overrides the layer count)."""
    from transformers import Qwen3Config

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    values = dict(SHAPES[shape])
    if layers is not None:
        if layers < 1:
            raise ValueError("layers must be >= 1")
        values["num_hidden_layers"] = int(layers)
    return Qwen3Config(**values)


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
    from transformers import Qwen3ForCausalLM

    from kiln.policy.device import TORCH_DTYPES

    config = shape_config(shape, layers=layers)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_qwen_tokenizer()
    tok.save_pretrained(str(out_dir))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(TORCH_DTYPES[dtype])
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.do_sample = True
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(str(out_dir))
    return out_dir


__all__ = ["SHAPES", "build_random_model", "shape_config"]
