"""Test helpers: tiny random-weight models of the hybrid and MoE families, with their real layer pattern.

Each builder makes a transformers config of the family's own config class with its real layer
pattern (Gated DeltaNet ``linear_attention`` layers beside a ``full_attention`` one for qwen3_5 and
qwen3_next, Mamba beside attention for granitemoehybrid, short ``conv`` layers for lfm2, routed
experts for qwen3_moe, sliding-window attention with sinks and experts for gpt_oss), a tiny
hidden size and the tiny model's vocabulary (1024), and seeds the random init. :func:`hybrid_model` returns the model in memory (sampler tests);
:func:`hybrid_model_dir` saves it beside a copy of the tiny model's tokenizer and chat template
(a folder :class:`kiln.core.policy.runtime.PolicyRuntime` loads). :func:`reference_decode` is the
brute-force batch-of-one decode the tiled sampler is checked against: transformers' own
``DynamicCache`` and the model's own attention, one row, one token per forward.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

VOCAB = 1024  # the tiny model's tokenizer (kiln.core.policy.tiny.VOCAB_SIZE)

FAMILIES = ("qwen3_5", "qwen3_next", "granitemoehybrid", "lfm2", "qwen3_moe", "gpt_oss")
HYBRID = ("qwen3_5", "qwen3_next", "granitemoehybrid", "lfm2")


def hybrid_config(family: str, *, vocab_size: int = VOCAB, eos: int = 2, pad: int = 0) -> Any:
    """The tiny config of ``family`` (its real layer pattern, 4 layers)."""
    import transformers as tf

    ids = {"vocab_size": vocab_size, "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": pad}
    attention = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                 "initializer_range": 0.2, "tie_word_embeddings": True}
    linear = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4}
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(**ids, **attention, **linear, intermediate_size=64, num_hidden_layers=4,
                                    layer_types=pattern)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**ids, **attention, **linear, intermediate_size=64, num_hidden_layers=4,
                                  layer_types=pattern, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            **ids, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            initializer_range=0.2, tie_word_embeddings=True, num_hidden_layers=4,
            layer_types=["mamba", "mamba", "mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=64, mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_d_head=16,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, position_embedding_type="rope",
        )
    if family == "lfm2":
        return tf.Lfm2Config(**ids, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64, initializer_range=0.2, num_hidden_layers=4,
                             layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
                             block_auto_adjust_ff_dim=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**ids, **attention, intermediate_size=64, num_hidden_layers=2, num_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    if family == "gpt_oss":  # sliding + full attention with sinks, 4 experts; a window shorter than a prompt
        return tf.GptOssConfig(**ids, **attention, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=4)
    raise ValueError(f"unknown family {family!r}")


def hybrid_model(family: str, *, seed: int = 5, overrides: dict[str, Any] | None = None, **ids: Any) -> Any:
    """A random-weight causal LM of ``family`` in eval mode, float32, frozen (``overrides``: config
    fields set after the family's own)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hybrid_config(family, **ids)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # gpt-oss's attention sinks have no sdpa implementation: eager, as it is served
        attention = "eager" if family == "gpt_oss" else "sdpa"
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model.eval()
    model.requires_grad_(False)
    return model


def hybrid_model_dir(family: str, out_dir: Path, tiny_dir: Path, *, seed: int = 5) -> Path:
    """Save ``family``'s tiny model with the tiny model's tokenizer and chat template into ``out_dir``."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in Path(tiny_dir).iterdir():
        if path.is_file() and (path.name.startswith("tokenizer") or path.name.startswith("special_tokens")
                               or path.name.startswith("chat_template")):
            shutil.copy(path, out_dir / path.name)
    tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    hybrid_model(family, seed=seed, vocab_size=len(tok), eos=eos, pad=pad).save_pretrained(str(out_dir))
    return out_dir


def reference_decode(model: Any, prompt: list[int], seed: int, max_new_tokens: int, stop_id: int
                     ) -> tuple[list[int], list[float]]:
    """One row decoded alone at temperature 1 through transformers' own ``DynamicCache``: its ids
    and log-probs. The token rule is Kiln's documented one (inverse CDF of the row's seeded
    float64 uniforms, drawn up front), written out here independently of the sampler."""
    import torch
    from transformers import DynamicCache

    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) % (1 << 64))
    uniforms = torch.rand(max_new_tokens, generator=gen, dtype=torch.float64)
    cache = DynamicCache(config=model.config)
    ids: list[int] = []
    lps: list[float] = []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        for t in range(max_new_tokens):
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            cdf = lp.double().exp().cumsum(dim=-1)
            token = min(int(torch.searchsorted(cdf, uniforms[t] * cdf[-1], right=True)), cdf.shape[-1] - 1)
            ids.append(token)
            lps.append(float(lp[token]))
            if token == stop_id:
                break
            position = torch.tensor([[len(prompt) + t]])
            out = model(input_ids=torch.tensor([[token]]), position_ids=position, cache=cache, use_cache=True)
    return ids, lps


__all__ = ["reference_decode", "FAMILIES", "HYBRID", "VOCAB", "hybrid_config", "hybrid_model", "hybrid_model_dir"]
