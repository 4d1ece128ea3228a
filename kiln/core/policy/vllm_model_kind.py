"""What Kiln's vLLM server makes of a model folder before it builds vLLM's engine: the facts of
its ``config.json`` (:func:`model_facts`), the engine arguments its kind asks for
(:func:`model_settings`), the models refused (:class:`Unsupported`: an MoE model on the CPU build
that :mod:`vllm_moe_lora_cpu` does not serve) and the format of its adapters (:func:`adapter_is_3d`).

Stdlib only: imported by ``vllm_server.py`` in the engine's virtual environment and by Kiln's tests.
"""

from __future__ import annotations

import json
import os


def model_facts(model_dir: str) -> dict:
    """What the server needs to know of the model folder's ``config.json``: its architectures,
    whether it is a vision-language checkpoint (a ``vision_config``: served as text only, no vision
    tower built) and whether it is a mixture of experts."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    experts = max(int(text.get(k) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    kinds = {str(kind) for kind in text.get("layer_types") or []}
    return {
        "architectures": [str(a) for a in config.get("architectures") or []],
        "text_only": isinstance(config.get("vision_config"), dict),
        "moe": experts > 0,
        # layers that keep a recurrent state (Gated DeltaNet, Mamba) beside attention layers
        "hybrid": bool(kinds - {"full_attention", "sliding_attention"}),
    }


def adapter_is_3d(adapter_dir: str) -> bool:
    """Whether a PEFT adapter adapts 3-D expert parameters (``target_parameters``: one fused
    ``gate_up_proj`` / ``down_proj`` per layer), which vLLM loads into its per-expert MoE LoRA
    layers only when told (``is_3d_lora_weight``, with ``enable_mixed_moe_lora_format``)."""
    try:
        with open(os.path.join(adapter_dir, "adapter_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(config.get("target_parameters")) if isinstance(config, dict) else False


class Unsupported(Exception):
    """A model this server refuses before it builds vLLM's engine (reported as ``model_unsupported``)."""


# Why an MoE model is refused on vLLM's CPU build without :mod:`vllm_moe_lora_cpu`. Measured with
# vLLM 0.32: with LoRA enabled, every MoE layer runs vLLM's Triton experts (expert GEMMs and LoRA
# products), which the CPU build cannot run (the first forward dies: ``module 'triton.language' has
# no attribute 'float32'``), and Kiln's adapters adapt the experts (peft's ``target_parameters`` on
# experts stored as 3-D tensors).
MOE_ON_CPU = (
    "vLLM's CPU build has no LoRA kernel for mixture-of-experts layers (vLLM's needs Triton) "
    "and Kiln's adapters adapt the experts"
)
# The MoE architectures whose experts :mod:`vllm_moe_lora_cpu` computes on the CPU build (gated
# SiLU experts without biases, measured against the trainer); any other is refused.
MOE_SERVED_ON_CPU = ("Qwen3MoeForCausalLM",)


def moe_refusal(architectures: list[str]) -> str:
    """Why an MoE architecture outside :data:`MOE_SERVED_ON_CPU` is refused on the CPU build."""
    named = ", ".join(architectures) or "this architecture"
    return (
        f"Kiln's CPU LoRA path for mixture-of-experts layers serves {', '.join(MOE_SERVED_ON_CPU)} only, "
        f"not {named} (vLLM's own MoE LoRA kernel needs Triton)"
    )


def model_settings(facts: dict, on_cpu: bool, moe_lora: str = "stock") -> dict:
    """Engine arguments the model's kind asks for: a vision-language checkpoint is served as its
    language model only (vLLM's ``language_model_only``: no vision tower in memory, text prompts
    only). An MoE model on vLLM's CPU build is served only through :mod:`vllm_moe_lora_cpu`'s torch
    experts (``moe_lora`` ``"torch"``: the server installed them) and only for the architectures
    in :data:`MOE_SERVED_ON_CPU`; else it is refused. An MoE model's adapters are loaded in vLLM's
    mixed MoE LoRA format (:func:`adapter_is_3d`). A hybrid model on the CPU build is served in
    bfloat16 (the build's Gated DeltaNet kernel takes nothing else: "CPU GDN attention requires BF16") and without prefix caching (vLLM caches a recurrent layer's state for
    prefixes only with chunked prefill, which the CPU build cannot run: ``vllm_server.prefill_settings``)."""
    if facts["moe"] and on_cpu:
        if moe_lora != "torch":
            raise Unsupported(MOE_ON_CPU)
        if not set(facts["architectures"]) & set(MOE_SERVED_ON_CPU):
            raise Unsupported(moe_refusal(facts["architectures"]))
    out: dict = {"language_model_only": True} if facts["text_only"] else {}
    if facts["moe"]:  # Kiln's adapters hold the experts as peft's 3-D parameters (adapter_is_3d)
        out["enable_mixed_moe_lora_format"] = True
    if facts.get("hybrid") and on_cpu:
        out.update(enable_prefix_caching=False, dtype="bfloat16")
    return out
