"""Mixture-of-experts layers with LoRA on vLLM's CPU build, installed by Kiln's vLLM server.

With LoRA enabled, vLLM runs every unquantized MoE layer through its Triton experts
(``TritonExperts.apply``: the expert GEMMs and, through the punica wrapper's ``add_lora_w13`` /
``add_lora_w2``, the experts' LoRA products), whatever the platform. The CPU build has no Triton,
so the first forward dies (``module 'triton.language' has no attribute 'float32'``).

:func:`install` replaces that ``apply`` on the CPU build with :func:`experts_with_lora`, the same
computation in torch: each token's selected experts get ``W + B @ A`` of the token's own adapter
(vLLM folds the adapter's scale into ``B`` when it loads it), rows without an adapter (index
``-1``) get the base experts only, and the experts' outputs are summed with the router's weights.
Products are grouped: one per expert for the base weights, one per (adapter, expert) pair present
in the batch for the LoRA factors.

Only the gated SiLU experts without biases (``w13 = [gate; up]``, as qwen3_moe stores them) are
served; any other expert kind raises :class:`ExpertsUnsupported` naming it.

Imports only torch (this file runs in the engine's virtual environment, next to
``vllm_server.py``, and in Kiln's for its tests).
"""

from __future__ import annotations

from typing import Any

import torch


class ExpertsUnsupported(Exception):
    """An MoE layer whose experts :func:`experts_with_lora` does not compute."""


def _factor(stacked: torch.Tensor, slot: int, expert: int) -> torch.Tensor:
    """One (adapter, expert) LoRA factor; a factor shared by all experts has expert dim 1."""
    return stacked[slot, expert if stacked.shape[1] > 1 else 0]


def _lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """``x @ A.T @ B.T`` cut to ``width`` output features (vLLM's buffers are padded to the
    largest rank and may be wider than the layer)."""
    return (x @ a.transpose(0, 1)) @ b[:width].transpose(0, 1)


def experts_with_lora(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    w13_a: tuple[torch.Tensor, ...],
    w13_b: tuple[torch.Tensor, ...],
    w2_a: torch.Tensor,
    w2_b: torch.Tensor,
    *,
    weigh_outputs: bool = True,
) -> torch.Tensor:
    """The MoE layer's output ``(tokens, hidden)`` for gated SiLU experts with per-token LoRA.

    ``w13`` is ``(experts, 2 * inter, hidden)`` (gate rows then up rows), ``w2`` is
    ``(experts, hidden, inter)``; ``topk_ids``/``topk_weights`` are ``(tokens, k)``;
    ``token_slots`` is each token's adapter slot (``-1``: none). ``w13_a``/``w13_b`` hold one
    ``(slots, experts, rank, hidden)`` / ``(slots, experts, out, rank)`` pair per slice of the
    w13 output (gate and up, or one fused slice), in order; ``w2_a`` is
    ``(slots, experts, rank, inter)`` and ``w2_b`` ``(slots, experts, hidden, rank)``.
    ``weigh_outputs=False`` when the router's weights were already applied to the input."""
    tokens, k = topk_ids.shape
    inter = w2.shape[-1]
    dtype = hidden.dtype
    rows = torch.arange(tokens, device=hidden.device).repeat_interleave(k)
    experts = topk_ids.reshape(-1)
    slots = token_slots[:tokens].to(torch.long)[rows]
    x = hidden[rows]
    gate_up = torch.empty(rows.shape[0], 2 * inter, dtype=dtype, device=hidden.device)
    present = [int(e) for e in torch.unique(experts).tolist() if e >= 0]
    groups = {e: (experts == e).nonzero(as_tuple=True)[0] for e in present}
    for e, where in groups.items():
        gate_up[where] = x[where] @ w13[e].to(dtype).transpose(0, 1)
    pairs = _adapter_pairs(slots, experts)
    for slot, e, where in pairs:
        start = 0
        for a, b in zip(w13_a, w13_b):
            width = min(b.shape[-2], 2 * inter - start)
            delta = _lora_delta(x[where], _factor(a, slot, e).to(dtype), _factor(b, slot, e).to(dtype), width)
            gate_up[where, start : start + width] += delta
            start += width
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = torch.zeros(rows.shape[0], w2.shape[1], dtype=dtype, device=hidden.device)
    for e, where in groups.items():
        down[where] = act[where] @ w2[e].to(dtype).transpose(0, 1)
    for slot, e, where in pairs:
        a, b = _factor(w2_a, slot, e).to(dtype), _factor(w2_b, slot, e).to(dtype)
        down[where] += _lora_delta(act[where], a, b, w2.shape[1])
    if weigh_outputs:
        down = down * topk_weights.reshape(-1, 1).to(dtype)
    return down.view(tokens, k, -1).sum(dim=1)


def _adapter_pairs(slots: torch.Tensor, experts: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """The (adapter slot, expert, row positions) groups present, rows without an adapter left out."""
    named = (slots >= 0) & (experts >= 0)
    if not bool(named.any()):
        return []
    keys = torch.stack([slots[named], experts[named]], dim=1)
    out = []
    for slot, e in torch.unique(keys, dim=0).tolist():
        where = (named & (slots == slot) & (experts == e)).nonzero(as_tuple=True)[0]
        out.append((int(slot), int(e), where))
    return out


def _check_layer(experts: Any, activation: Any, expert_map: Any) -> None:
    """Refuse an expert kind :func:`experts_with_lora` does not compute, naming it."""
    kind = str(getattr(activation, "value", activation))
    if kind != "silu":
        raise ExpertsUnsupported(f"Kiln's CPU MoE LoRA path computes gated SiLU experts, not {kind!r}")
    if getattr(experts, "w1_bias", None) is not None or getattr(experts, "w2_bias", None) is not None:
        raise ExpertsUnsupported("Kiln's CPU MoE LoRA path computes experts without biases")
    if getattr(experts.quant_config, "quant_dtype", None) is not None:
        raise ExpertsUnsupported("Kiln's CPU MoE LoRA path computes unquantized experts only")
    if expert_map is not None:
        raise ExpertsUnsupported("Kiln's CPU MoE LoRA path does not run expert parallelism")


def apply(  # vLLM's FusedMoEExpertsModular.apply signature, as vLLM calls it
    self: Any,
    output: torch.Tensor,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Any,
    global_num_experts: int,
    expert_map: torch.Tensor | None,
    a1q_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    workspace13: torch.Tensor,
    workspace2: torch.Tensor,
    expert_tokens_meta: Any,
    apply_router_weight_on_input: bool,
) -> None:
    """``TritonExperts.apply`` on the CPU build: :func:`experts_with_lora` into ``output``, with
    the layer's LoRA buffers and each token's adapter slot (no LoRA context: base experts only)."""
    _check_layer(self, activation, expert_map)
    tokens = hidden_states.shape[0]
    ctx = getattr(self, "_lora_context", None)
    if ctx is None:
        slots = torch.full((tokens,), -1, dtype=torch.long, device=hidden_states.device)
        empty = torch.zeros(0, 1, 1, 1, dtype=hidden_states.dtype)
        w13_a: tuple[torch.Tensor, ...] = ()
        w13_b: tuple[torch.Tensor, ...] = ()
        w2_a, w2_b = empty, empty
    else:
        mapping = ctx.local_token_lora_mapping
        slots = ctx.punica_wrapper.token_lora_indices if mapping is None else mapping
        w13_a, w13_b = tuple(ctx.w13_lora_a_stacked), tuple(ctx.w13_lora_b_stacked)
        w2_a, w2_b = ctx.w2_lora_a_stacked[0], ctx.w2_lora_b_stacked[0]
    x = hidden_states
    if ctx is not None and ctx.original_hidden_states is not None and ctx.original_hidden_states.shape[0] == tokens:
        x = ctx.original_hidden_states
    output.copy_(
        experts_with_lora(
            x,
            w1,
            w2,
            topk_weights,
            topk_ids,
            slots,
            w13_a,
            w13_b,
            w2_a,
            w2_b,
            weigh_outputs=not apply_router_weight_on_input,
        )
    )


def install() -> bool:
    """Put :func:`apply` in place of ``TritonExperts.apply`` on vLLM's CPU build. Returns whether
    it was installed: only on a CPU platform where vLLM's Triton experts exist and their ``apply``
    takes exactly :func:`apply`'s parameters; elsewhere vLLM's own kernels run."""
    import inspect

    try:
        from vllm.model_executor.layers.fused_moe.experts import triton_moe
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    stock = triton_moe.TritonExperts.apply
    if stock is not apply and list(inspect.signature(stock).parameters) != list(inspect.signature(apply).parameters):
        return False
    triton_moe.TritonExperts.apply = apply
    return True


__all__ = ["ExpertsUnsupported", "apply", "experts_with_lora", "install"]
