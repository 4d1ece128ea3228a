"""Tiny random models of every model family, each with its family's real layer pattern.

:data:`TINY` gives per case the transformers config class, the model class and the config values:
hidden sizes of 32-64, two to four layers, and the layer kinds the family really mixes (Qwen3.5:
three Gated DeltaNet layers and one full-attention layer; granite: Mamba2 and attention layers with
experts and a shared MLP; lfm2: short-convolution and attention layers; gpt-oss: sliding and full
attention with experts; phi3: fused qkv and gate/up projections). ``qwen3_5`` is the hub's
vision-language layout; ``qwen3_5_text`` the text-only ``Qwen3_5ForCausalLM``.

:func:`build_family_folder` writes one as a model folder (weights, and optionally the tokenizer and
chat template of a template family from :mod:`tests.support.models`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_DENSE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, **_ATTN}
_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
_HYBRID4 = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

# case -> (family, config class, model class, config values)
TINY: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(_DENSE)),
    "qwen3_5": ("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", {
        "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, **_ATTN, **_LINEAR,
                        "layer_types": _HYBRID4},
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64}}),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, **_ATTN, **_LINEAR,
        "layer_types": _HYBRID4}),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, **_ATTN, **_LINEAR,
        "layer_types": _HYBRID4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32}),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **_DENSE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "gpt_oss": ("gpt_oss", "GptOssConfig", "GptOssForCausalLM", {
        **_DENSE, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(_DENSE)),
    "gemma3": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_DENSE, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    "mistral": ("mistral", "MistralConfig", "MistralForCausalLM", dict(_DENSE)),
    "smollm3": ("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", dict(_DENSE)),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}),
    "olmo2": ("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}),
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "layer_types": ["mamba", "mamba", "mamba", "attention"],
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
        "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 16}),
    "lfm2": ("lfm2", "Lfm2Config", "Lfm2ForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "block_auto_adjust_ff_dim": False}),
}


def tiny_config(case: str, vocab_size: int = 256, **ids: Any) -> Any:
    """The config of ``case`` with ``vocab_size`` (and eos/pad ids) set where the family keeps them."""
    import transformers

    _, config_name, _, values = TINY[case]
    values = {**values}
    if "text_config" in values:
        values["text_config"] = {**values["text_config"], "vocab_size": vocab_size, **ids}
    else:
        values.update(vocab_size=vocab_size, initializer_range=0.2, **ids)
    return getattr(transformers, config_name)(**values)


def build_family_folder(case: str, out_dir: Path, *, template: str | None = None, seed: int = 5) -> Path:
    """Write the tiny ``case`` model (float32) into ``out_dir``; with ``template`` (a template family of
    :mod:`tests.support.models`: ``qwen3``, ``llama3``, ``gemma``) its tokenizer and chat template too."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, ids = 256, {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    if template is not None:
        from tests.support.models import family_tokenizer

        tok, found = family_tokenizer(template)
        ids = {"bos_token_id": None, **found}
        tok.save_pretrained(str(out_dir))
        vocab = len(tok)
    config = tiny_config(case, vocab, **ids)
    model_class = getattr(transformers, TINY[case][2])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class._from_config(config, attn_implementation="eager")
    model.to(torch.float32).save_pretrained(str(out_dir))
    return out_dir
