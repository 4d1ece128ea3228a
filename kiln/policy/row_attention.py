"""Per-row keys and values, and per-row attention, for the sampler's tiled decode (torch).

The sampler (:mod:`kiln.policy.sampling`) decodes the rows of a call in the slots of a tile: one
forward of ``(tile, 1)`` tokens per step. The projections, norms and the head run on every slot
at once, but attention must not mix rows, so it stays per row:

* :class:`RowCache` is the forward's ``cache``: each slot keeps its own row's contiguous keys and
  values per layer, grown by one token per step exactly as a batch-of-one cache grows.
* :func:`rows_forward` runs one decode forward with the attention function registered here
  (``kiln_rows``) in place of the model's own. For every live slot it runs the model's own
  implementation (``sdpa``, ``eager`` …) on that row's query and that row's keys and values,
  with no mask: a single query token attends to all of its row's past (the last
  ``sliding_window`` keys on a sliding-window layer). Idle slots get zeros, which nobody reads.

Prefill forwards run with the model's own implementation untouched.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

IMPLEMENTATION = "kiln_rows"

Attention = Callable[..., tuple[torch.Tensor, Any]]


@dataclass
class RowKV:
    """What :meth:`RowCache.update` hands the attention function for one layer: per slot, that
    row's keys and values ``(1, kv_heads, length, head_dim)``, or None for an idle slot."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    inner: Attention


class RowCache:
    """Each slot's keys and values per layer (``None`` for an idle slot)."""

    def __init__(self, model: Any, tile: int) -> None:
        self.slots: list[list[list[torch.Tensor]] | None] = [None] * tile
        self.base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.original = self.base.config._attn_implementation
        self.inner = _implementation(self.base, self.original)

    def place(self, slot: int, prefilled: Any) -> None:
        """Give ``slot`` a row whose batch-of-one transformers cache is ``prefilled``."""
        self.slots[slot] = [[layer.keys, layer.values] for layer in prefilled.layers]

    def free(self, slot: int) -> None:
        self.slots[slot] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[RowKV, RowKV]:
        """Append each live slot's new key and value; the layer's per-row view for attention."""
        keys: list[torch.Tensor | None] = []
        values: list[torch.Tensor | None] = []
        for i, layers in enumerate(self.slots):
            if layers is None:
                keys.append(None)
                values.append(None)
                continue
            kv = layers[layer_idx]
            kv[0] = torch.cat([kv[0], key_states[i : i + 1]], dim=-2)
            kv[1] = torch.cat([kv[1], value_states[i : i + 1]], dim=-2)
            keys.append(kv[0])
            values.append(kv[1])
        rows = RowKV(keys, values, self.inner)
        return rows, rows


def rows_forward(model: Any, cache: RowCache, cache_kwarg: str, input_ids: torch.Tensor,
                 position_ids: torch.Tensor) -> Any:
    """One decode forward of the tile with per-row attention; the model's output."""
    _register()
    config = cache.base.config
    config._attn_implementation = IMPLEMENTATION  # the config's own setter (sub-configs follow)
    try:
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **{cache_kwarg: cache})
    finally:
        config._attn_implementation = cache.original


def _rows_attention(module: torch.nn.Module, query: torch.Tensor, key: RowKV, value: RowKV,
                    attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    window = kwargs.get("sliding_window")
    parts: list[torch.Tensor | None] = []
    for i, (k, v) in enumerate(zip(key.keys, key.values)):
        if k is None or v is None:
            parts.append(None)
            continue
        if window is not None and k.shape[-2] > window:
            k, v = k[:, :, -window:].contiguous(), v[:, :, -window:].contiguous()
        parts.append(key.inner(module, query[i : i + 1].clone(), k, v, None, **kwargs)[0])
    live = next((p for p in parts if p is not None), None)
    if live is None:
        raise RuntimeError("a tiled decode step with no live row")
    zeros = torch.zeros_like(live)
    return torch.cat([p if p is not None else zeros for p in parts]), None


def _implementation(model: Any, name: str) -> Attention:
    """The attention function the model runs under ``name`` (its modeling module's eager one for
    ``eager``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name != "eager" and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    fn = getattr(importlib.import_module(type(model).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(model).__name__}: no attention function named {name!r} to run per row")
    return fn


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(IMPLEMENTATION, _rows_attention)
        _registered = True


__all__ = ["IMPLEMENTATION", "RowCache", "RowKV", "rows_forward"]
