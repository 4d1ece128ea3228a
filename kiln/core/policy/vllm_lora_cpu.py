"""Grouped LoRA products for vLLM's CPU build, installed by Kiln's vLLM server.

vLLM's CPU LoRA path (``vllm.lora.ops.torch_ops``) computes a token's LoRA product by gathering a
copy of its adapter's weight matrix for that token. The LM head's LoRA does so at every decode step,
even when no request in the batch names an adapter (index ``-1``): with a large vocabulary that
gathers ``tokens x vocab x rank`` floats per step, and enabling LoRA slowed decode about 2.3x on a
2-core CPU whether or not any request named an adapter.

:func:`install` replaces the three per-token products (``bgmv_shrink``, ``bgmv_expand``,
``bgmv_expand_slice``; the prefill ``sgmv_*`` forms call them) with one matrix product per adapter
present in the batch: rows are grouped by adapter index, each group is multiplied by its adapter's
weights once, and rows without an adapter contribute nothing (the meaning vLLM's GPU kernels give
``-1``). The results are the same products, summed in a different order.

Imports only torch (this file runs in the engine's virtual environment, next to
``vllm_server.py``, and in Kiln's for its tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _by_adapter(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """``out[b] = inputs[b] @ weights[indices[b]].T`` in ``dtype``, one product per adapter present.

    ``weights`` is ``(slots, out, in)`` or ``(slots, 1, out, in)``. Rows whose index is negative are
    zero. Returns ``None`` when no row names an adapter. A single row or a single index is broadcast,
    as the per-token form broadcasts it."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    indices = indices.reshape(-1)
    rows = max(inputs.shape[0], indices.shape[0])
    if indices.shape[0] != rows:
        indices = indices.expand(rows)
    if inputs.shape[0] != rows:
        inputs = inputs.expand(rows, inputs.shape[1])
    present = [int(i) for i in torch.unique(indices).tolist() if i >= 0]
    if not present:
        return None
    x = inputs.to(dtype)
    if len(present) == 1 and bool((indices == present[0]).all()):
        return x @ weights[present[0]].to(dtype).transpose(0, 1)
    out = torch.zeros(rows, weights.shape[1], dtype=dtype, device=inputs.device)
    for slot in present:
        where = (indices == slot).nonzero(as_tuple=True)[0]
        out[where] = x[where] @ weights[slot].to(dtype).transpose(0, 1)
    return out


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """``output[:, :rank] = scaling * inputs @ A[index].T`` per row (zero for rows without an adapter).

    ``lora_b_weights`` holds the A matrices: the parameter keeps the name vLLM's form gives it, so
    callers passing it by keyword reach the same argument."""
    rank = lora_b_weights.shape[-2]
    product = _by_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if product is None:
        output_tensor[:, :rank] = 0
        return
    output_tensor[:, :rank] = scaling * product


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """``output[:, :n] (+)= inputs @ B[index].T`` per row, ``n`` the narrower of the two widths."""
    product = _by_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    width = min(lora_b_weights.shape[-2], output_tensor.shape[1])
    if product is None:
        if not add_inputs:
            output_tensor[:, :width] = 0
        return
    limit = 1 if product.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    if add_inputs:
        output_tensor[:, :width] += product[:limit, :width]
    else:
        output_tensor[:, :width] = product[:limit, :width]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """``output[:, offset:offset+size] (+)= inputs @ B[index].T`` per row."""
    product = _by_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if product is None:
        if not add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] = 0
        return
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += product
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = product


_GROUPED: dict[str, Callable[..., Any]] = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
}


def install() -> bool:
    """Put the grouped products in place of vLLM's per-token ones (CPU LoRA path only).

    Returns whether they were installed: only when vLLM's CPU LoRA modules exist and each product
    there takes exactly the parameters of its grouped form. On another vLLM layout nothing changes
    and vLLM's own products run."""
    import inspect

    try:
        from vllm.lora.ops import torch_ops
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    modules = (lora_ops, torch_ops, punica_cpu)
    for name, grouped in _GROUPED.items():
        for module in modules:
            stock = getattr(module, name, None)
            if stock is None or (
                stock is not grouped
                and list(inspect.signature(stock).parameters) != list(inspect.signature(grouped).parameters)
            ):
                return False
    for name, grouped in _GROUPED.items():
        for module in modules:
            setattr(module, name, grouped)
    return True


__all__ = ["bgmv_expand", "bgmv_expand_slice", "bgmv_shrink", "install"]
