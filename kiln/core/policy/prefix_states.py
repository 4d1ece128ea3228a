"""Multi-turn state reuse for hybrid models: a row's cache kept at prefill chunk boundaries (torch).

A multi-turn episode's next prompt is the previous one with the action and the observation turn
appended, so its prefix was already prefilled. A model with linear-attention, Mamba or convolution
layers (qwen3_5, qwen3_next, granitemoehybrid, lfm2) is therefore prefilled in **canonical chunks**:
forwards of ``chunk`` tokens at the fixed positions ``[0, chunk)``, ``[chunk, 2·chunk)`` …, each
continuing transformers' own cache of the previous ones, the last one partial. The cache at the
last chunk boundary before a prompt's end is kept in :class:`PrefixStates` (its layers: keys and
values, convolution and recurrent states; one per prompt, so memory stays one context per entry);
the next turn's prefill starts from the longest kept boundary that its prompt extends (also a
group's other candidates, sharing the prompt's start), so a turn prefills only what was appended
(plus less than one chunk), not the whole context.

Bytes never depend on what is kept: a prompt's cache and logits are the same sequence of chunk
forwards whether its first chunks come from a kept state or are computed again (a worker that
restarted, an evicted entry), because the chunk boundaries depend only on the positions. The
chunk size is part of the hf engine's identity for these models. Dense models keep their one-shot
prefill (:func:`kiln.core.policy.sampling._prefill`); their identities and bytes are unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from kiln.core.policy.faults import model_forward
from kiln.core.policy.row_attention import _own_copy

PREFILL_CHUNK = 64  # tokens per canonical prefill chunk of a hybrid model
KEPT_STATES = 32  # row states kept per engine (least recently used dropped)


def is_hybrid(model: Any) -> bool:
    """The model has layers whose cache is a convolution / recurrent state (not only keys and values)."""
    from transformers.cache_utils import (
        DYNAMIC_LAYER_TYPE_MAPPING,
        LinearAttentionCacheLayerMixin,
        get_layer_types_and_kwargs,
    )

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kinds, _ = get_layer_types_and_kwargs(base.config.get_text_config(decoder=True))
    return any(
        isinstance(cls, type) and issubclass(cls, LinearAttentionCacheLayerMixin)
        for cls in (DYNAMIC_LAYER_TYPE_MAPPING.get(kind) for kind in kinds)
    )


class PrefixStates:
    """Kept row caches keyed by the exact token prefix they cover (an LRU of ``capacity`` entries),
    and the prefill figures: tokens forwarded and tokens taken from a kept state."""

    def __init__(self, capacity: int = KEPT_STATES) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._kept: OrderedDict[tuple[int, ...], list[Any]] = OrderedDict()
        self.figures = {"prefill_tokens": 0, "prefill_tokens_reused": 0}

    def longest(self, prompt: tuple[int, ...], chunk: int) -> tuple[int, list[Any]] | None:
        """The longest kept boundary ``b`` (a multiple of ``chunk``, below ``len(prompt)``) whose
        prefix ``prompt`` extends, and its layers."""
        for end in range(((len(prompt) - 1) // chunk) * chunk, 0, -chunk):
            layers = self._kept.get(prompt[:end])
            if layers is not None:
                self._kept.move_to_end(prompt[:end])
                return end, layers
        return None

    def keep(self, prefix: tuple[int, ...], layers: list[Any]) -> None:
        self._kept[prefix] = layers
        self._kept.move_to_end(prefix)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def clear(self) -> None:
        self._kept.clear()


def chunked_prefill(
    model: Any, prompt: tuple[int, ...], device: Any, chunk: int, states: PrefixStates | None, cache_kw: str = "cache"
) -> tuple[Any, torch.Tensor]:
    """Prefill ``prompt`` (batch of one) in canonical chunks, from the longest kept boundary:
    ``(cache, last_logits)``; the cache at the last boundary before the prompt's end is kept."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    start = 0
    hit = states.longest(prompt, chunk) if states is not None else None
    if hit is not None:
        start, layers = hit
        cache.layers = [_own_copy(layer) for layer in layers]
    out = None
    position = start
    last = ((len(prompt) - 1) // chunk) * chunk  # the last boundary before the prompt's end
    while position < len(prompt):
        end = min(len(prompt), (position // chunk + 1) * chunk)
        ids = torch.tensor([prompt[position:end]], dtype=torch.long, device=device)
        positions = torch.arange(position, end, dtype=torch.long, device=device).unsqueeze(0)
        with model_forward(model):
            out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        if states is not None and end == last and last > start:  # one state per prompt: its last boundary
            states.keep(prompt[:end], [_own_copy(layer) for layer in cache.layers])
        position = end
    assert out is not None
    if states is not None:
        states.figures["prefill_tokens"] += len(prompt) - start
        states.figures["prefill_tokens_reused"] += start
    return cache, out.logits[:, -1, :]


__all__ = ["KEPT_STATES", "PREFILL_CHUNK", "PrefixStates", "chunked_prefill", "is_hybrid"]
