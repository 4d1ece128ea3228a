"""Per-row cache state, per-row attention and per-row experts for the sampler's tiled decode (torch).

The sampler (:mod:`kiln.core.policy.sampling`) decodes the rows of a call in the slots of a tile: one
forward of ``(tile, 1)`` tokens per step. The projections, norms and the head run on every slot
at once, but nothing may mix rows, so:

* :class:`RowCache` is the forward's ``cache``: each slot keeps its own row's transformers cache
  layers (copies of the row's batch-of-one prefill cache layers), grown by one token per step
  exactly as a batch-of-one cache grows. It dispatches on the kind of each layer: keys and values
  for attention layers, convolution and recurrent states for linear-attention (Gated DeltaNet),
  Mamba and short-convolution layers (qwen3_5, qwen3_next, granitemoehybrid, lfm2), whose own
  decode kernels run on the tile's stacked states.
* :func:`rows_forward` runs one decode forward with the attention function registered here
  (``kiln_rows``) in place of the model's own. For every live slot it runs the model's own
  implementation (``sdpa``, ``eager`` …) on that row's query and that row's keys and values,
  with no mask: a single query token attends to all of its row's past (the last
  ``sliding_window`` keys on a sliding-window layer). Idle slots get zeros, which nobody reads.
  A mixture-of-experts layer runs under the experts implementation registered here (also
  ``kiln_rows``): each row's token goes through the model's own experts implementation alone, so
  an expert's matrix product never has a row count that depends on the tile-mates.

Prefill forwards run with the model's own implementations untouched.
"""

from __future__ import annotations

import copy
import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

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
    """The tile's cache: each slot holds its row's own transformers cache layers (``None``: idle).

    A row's layers are private copies of its batch-of-one prefill cache's layers (the prefill may
    be shared by several rows), so each row grows exactly as a batch-of-one cache grows, through
    the layer classes' own methods. The model calls this object as it calls a transformers
    ``Cache``; what each call does depends on the kind of the layer it names:

    * an attention layer (a ``CacheLayerMixin``: ``DynamicLayer``, ``DynamicSlidingWindowLayer`` …)
      takes each live row's new keys and values through its own ``update`` and hands the
      attention function the row's keys and values (:class:`RowKV`);
    * a linear-attention, Mamba or short-convolution layer (a ``LinearAttentionCacheLayerMixin``)
      keeps each row's convolution and recurrent states. The model's own decode kernels run on
      the tile at once: ``get_conv_state`` / ``get_recurrent_state`` stack the live rows' states
      into one ``(tile, …)`` tensor (zeros for idle slots), the kernels update it in place or hand
      a new one to ``update_*_state``, and :meth:`commit` writes every row's part back into the
      row's own layer after the forward.

    A layer kind that is neither raises :class:`UnsupportedCacheLayer` naming it.
    """

    def __init__(self, model: Any, tile: int) -> None:
        self.slots: list[list[Any] | None] = [None] * tile
        self.base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.original = self.base.config._attn_implementation
        self.inner = _implementation(self.base, self.original)
        self._stacked: dict[tuple[int, str, int], torch.Tensor] = {}  # this forward's tile states

    def place(self, slot: int, prefilled: Any) -> None:
        """Give ``slot`` a row whose batch-of-one transformers cache is ``prefilled``."""
        self.slots[slot] = [_own_copy(layer) for layer in prefilled.layers]

    def free(self, slot: int) -> None:
        self.slots[slot] = None

    def _live(self) -> list[tuple[int, list[Any]]]:
        return [(i, layers) for i, layers in enumerate(self.slots) if layers is not None]

    # ----------------------------------------------------------------- attention (key/value) layers
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[RowKV, RowKV]:
        """Append each live row's new key and value to its own layer; the per-row view for attention."""
        keys: list[torch.Tensor | None] = [None] * len(self.slots)
        values: list[torch.Tensor | None] = [None] * len(self.slots)
        for i, layers in self._live():
            layer = layers[layer_idx]
            if not isinstance(layer, CacheLayerMixin):
                raise UnsupportedCacheLayer(type(layer).__name__, "keys and values")
            keys[i], values[i] = layer.update(key_states[i : i + 1], value_states[i : i + 1], *args, **kwargs)
        rows = RowKV(keys, values, self.inner)
        return rows, rows

    # ------------------------------------------------- linear-attention / Mamba / convolution layers
    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._stack(layer_idx, "conv_states", state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._stack(layer_idx, "recurrent_states", state_idx)

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Each live row's layer takes its part through its own ``update_conv_state``."""
        self._stacked.pop((layer_idx, "conv_states", state_idx), None)
        return self._per_row(conv_states, layer_idx, "update_conv_state", state_idx, kwargs)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Each live row's layer takes its part through its own ``update_recurrent_state``."""
        self._stacked.pop((layer_idx, "recurrent_states", state_idx), None)
        self._per_row(recurrent_states, layer_idx, "update_recurrent_state", state_idx, kwargs)
        return recurrent_states

    def commit(self) -> None:
        """After a forward: write each row's part of the stacked states (which the model's kernels
        updated in place) back into the row's own layer."""
        for (layer_idx, kind, state_idx), stacked in self._stacked.items():
            for i, layers in self._live():
                getattr(layers[layer_idx], kind)[state_idx].copy_(stacked[i : i + 1])
        self._stacked.clear()

    def _linear(self, layers: list[Any], layer_idx: int) -> Any:
        layer = layers[layer_idx]
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise UnsupportedCacheLayer(type(layer).__name__, "convolution and recurrent states")
        return layer

    def _stack(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None:
        key = (layer_idx, kind, state_idx)
        if key not in self._stacked:
            live = self._live()
            parts = {i: self._linear(layers, layer_idx) for i, layers in live}
            if not all(layer.has_previous_state[state_idx] for layer in parts.values()):
                return None
            states = {i: getattr(layer, kind)[state_idx] for i, layer in parts.items()}
            if any(s is None for s in states.values()):
                return None
            first = next(iter(states.values()))
            zeros = torch.zeros_like(first)
            self._stacked[key] = torch.cat([states.get(i, zeros) for i in range(len(self.slots))])
        return self._stacked[key]

    def _per_row(
        self, states: torch.Tensor, layer_idx: int, method: str, state_idx: int, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        out: list[torch.Tensor | None] = [None] * len(self.slots)
        for i, layers in self._live():
            out[i] = getattr(self._linear(layers, layer_idx), method)(states[i : i + 1], state_idx, **kwargs)
        first = next(o for o in out if o is not None)
        zeros = torch.zeros_like(first)
        return torch.cat([o if o is not None else zeros for o in out])


# The transformers cache layer classes whose per-row state the tile keeps (everything the model
# calls on them goes through RowCache's methods above).
_ROW_LAYERS = (
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "LinearAttentionLayer",
    "LinearAttentionAndFullAttentionLayer",
    "LinearAttentionAndSlidingWindowAttentionLayer",
    "DummyLayer",
)


def unsupported_layer_kinds(config: Any) -> list[str]:
    """The cache layer kinds of ``config`` (its ``layer_types``, as transformers' ``DynamicCache``
    dispatches them) whose per-row state the tiled decode cannot keep, e.g. ``indexed_attention``
    (DeepSeek-V3.2's indexer keys) or key/value layers shared between layers; empty when the hf
    engine can serve the model. Pure config reading: a preflight can refuse with it."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    kinds, _ = get_layer_types_and_kwargs(text)
    out: list[str] = []
    if getattr(text, "kv_sharing_modes", None) and any(m == "reuse" for m in text.kv_sharing_modes):
        out.append("shared key/value layers")
    for kind in kinds:
        cls = DYNAMIC_LAYER_TYPE_MAPPING.get(kind)
        if (cls is None or cls.__name__ not in _ROW_LAYERS) and kind not in out:
            out.append(kind)
    return out


def batch_invariant(config: Any) -> bool:
    """Whether the hf engine's rows of a model of ``config`` are batch-invariant: a row's ids and
    log-probs bit-identical whichever rows share its tile (at a fixed tile size, on one machine
    and configuration). True for every model the tile serves (dense, sliding-window, hybrid
    linear-attention / Mamba / convolution layers, mixtures of experts run token by token)."""
    return not unsupported_layer_kinds(config)


class UnsupportedCacheLayer(RuntimeError):
    """A cache layer kind the tiled decode does not know how to keep per row."""

    def __init__(self, kind: str, wanted: str) -> None:
        super().__init__(f"the tiled decode cannot keep {wanted} per row in a {kind} cache layer")
        self.kind = kind


def _own_copy(layer: Any) -> Any:
    """A row-private copy of one prefilled cache layer: the shallow copy shares the prefill's key
    and value tensors (the layer's ``update`` concatenates, never writes them in place); the
    linear-attention states (written in place by the model's kernels) and their flags are copied."""
    own = copy.copy(layer)
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for name in ("conv_states", "recurrent_states"):
            setattr(own, name, {k: (t.clone() if t is not None else None) for k, t in getattr(layer, name).items()})
        for name in (
            "is_conv_states_initialized",
            "is_recurrent_states_initialized",
            "has_previous_state",
            "conv_kernel_size",
        ):
            setattr(own, name, dict(getattr(layer, name)))
    return own


def rows_forward(
    model: Any, cache: RowCache, cache_kwarg: str, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> Any:
    """One decode forward of the tile with per-row attention and per-row experts; the model's output."""
    _register()
    config = cache.base.config
    experts = getattr(config, "_experts_implementation", None)
    config._attn_implementation = IMPLEMENTATION  # the config's own setters (sub-configs follow)
    if experts is not None:
        config._experts_implementation = IMPLEMENTATION
    _inner_experts.name = experts
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **{cache_kwarg: cache})
        cache.commit()
        return out
    finally:
        config._attn_implementation = cache.original
        if experts is not None:
            config._experts_implementation = experts


class _InnerExperts(threading.local):
    """The experts implementation the model ran under before the tile's decode forward (per
    thread: the forward runs in the thread that called :func:`rows_forward`)."""

    name: str | None = None


_inner_experts = _InnerExperts()


def _rows_experts(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A mixture-of-experts layer token by token: each token (one per row in a decode step) goes
    through the model's own experts implementation alone, exactly as in a batch-of-one decode,
    so the rows an expert serves never share (and never round together in) one matrix product."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    own = getattr(type(module).forward, "__wrapped__", None)
    if own is None:
        raise RuntimeError(f"{type(module).__name__}: no experts forward of its own to run per row")
    name = _inner_experts.name
    if name is None:  # only rows_forward selects this implementation, and it sets the name first
        raise RuntimeError(f"{type(module).__name__}: experts per row outside the tile's decode forward")
    inner = ALL_EXPERTS_FUNCTIONS.get_interface(name, own)
    parts = [
        inner(module, hidden_states[i : i + 1], top_k_index[i : i + 1], top_k_weights[i : i + 1])
        for i in range(hidden_states.shape[0])
    ]
    return torch.cat(parts)


def _rows_attention(
    module: torch.nn.Module, query: torch.Tensor, key: RowKV, value: RowKV, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
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
        from transformers.integrations.moe import ExpertsInterface

        AttentionInterface.register(IMPLEMENTATION, _rows_attention)
        ExpertsInterface.register(IMPLEMENTATION, _rows_experts)
        _registered = True


__all__ = [
    "IMPLEMENTATION",
    "RowCache",
    "RowKV",
    "UnsupportedCacheLayer",
    "batch_invariant",
    "rows_forward",
    "unsupported_layer_kinds",
]
