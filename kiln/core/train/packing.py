"""Sequence packing of training rows (``training_config.packing``): several rows share one sequence.

:func:`packed_microbatches` bins the rows of one optimizer step, first-fit by decreasing length,
into sequences of the step's longest row, and groups the bins into micro-batches of at most
``max_tokens_per_microbatch`` tokens (bins × bin length). :func:`packed_logprobs` runs the backbone
once over a micro-batch's bins with ``position_ids`` restarting at 0 for every row and an explicit
4-D block-diagonal causal mask (boolean for sdpa, additive for eager; a sliding-window layer gets
its window inside each row), so a token attends only to the earlier tokens of its own row, as in
the padded batch. The output head runs over the rows' real positions only, and the log-probs are
scattered back into the padded ``(B, T-1)`` layout of :func:`kiln.core.train.batches.collate`, so
every loss term reads the same tensors as unpacked (zeros at padding). A bin's unused tail is a
dummy row of its own, never attended to by a real one.

Layers that carry a recurrent state along the sequence (Gated DeltaNet, Mamba, short convolutions)
would leak it from one row into the next, and attention kernels that take no 4-D mask (flash) cannot
keep rows apart this way: :func:`require_packable` refuses those models.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.core.errors import TrainingFailed
from kiln.core.train.batches import Row
from kiln.core.train.losses import backbone, sequence_logprobs

# Layer types whose tokens interact only through (masked) attention; anything else carries state.
_PACKABLE_LAYERS = frozenset({"full_attention", "sliding_attention", "attention"})
_PACKABLE_ATTENTION = frozenset({"sdpa", "eager"})  # those that take an explicit 4-D mask


def _text_config(model: Any) -> Any:
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = lm.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def require_packable(model: Any) -> None:
    """Refuse packing (``packing_unsupported``) for a model whose layers cannot keep rows apart."""
    text = _text_config(model)
    kinds = sorted(set(getattr(text, "layer_types", None) or ["full_attention"]) - _PACKABLE_LAYERS)
    attention = getattr(text, "_attn_implementation", None) or "eager"
    reason = None
    if kinds:
        reason = f"its {', '.join(kinds)} layers carry a state along the sequence from one row into the next"
    elif attention not in _PACKABLE_ATTENTION:
        reason = f"its attention implementation {attention!r} builds no per-row mask"
    if reason is not None:
        raise TrainingFailed(
            f"training_config.packing cannot be used with {getattr(text, 'model_type', 'this model')}: {reason}",
            code="packing_unsupported",
            hint="set training_config.packing to false for this model (docs/training.md, 'Sequence packing')",
        )


def pack_bins(rows: list[Row], capacity: int) -> list[list[Row]]:
    """First-fit decreasing: bins of total length ≤ ``capacity`` (a longer row gets its own bin);
    ties keep the rows' order, so the packing is deterministic."""
    bins: list[list[Row]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: -r.length):
        for index, left in enumerate(room):
            if row.length <= left:
                bins[index].append(row)
                room[index] -= row.length
                break
        else:
            bins.append([row])
            room.append(capacity - row.length)
    return bins


def packed_microbatches(rows: list[Row], max_tokens: int) -> list[list[list[Row]]]:
    """The step's rows in bins of the longest row's length, grouped into micro-batches of at most
    ``max_tokens`` tokens (at least one bin each)."""
    if not rows:
        return []
    capacity = max(r.length for r in rows)
    bins = pack_bins(rows, capacity)
    per = max(1, max_tokens // capacity)
    return [bins[start : start + per] for start in range(0, len(bins), per)]


def _layout(bins: list[list[Row]], device: torch.device) -> dict[str, torch.Tensor]:
    """Packed ids, position ids and row ids ``(n_bins, capacity)``, and for every row's shifted
    position its flat source index in the packed hidden states and its ``(row, column)`` in the
    padded layout."""
    capacity = max(sum(r.length for r in b) for b in bins)
    ids = torch.zeros((len(bins), capacity), dtype=torch.long)
    positions = torch.zeros((len(bins), capacity), dtype=torch.long)
    segments = torch.full((len(bins), capacity), -1, dtype=torch.long)  # -1: the bin's tail
    source, row_index, column, labels = [], [], [], []
    index = 0
    for b, rows in enumerate(bins):
        offset = 0
        for row in rows:
            n = row.length
            ids[b, offset : offset + n] = row.ids
            positions[b, offset : offset + n] = torch.arange(n)
            segments[b, offset : offset + n] = index
            source.append(torch.arange(n - 1) + b * capacity + offset)
            row_index.append(torch.full((n - 1,), index, dtype=torch.long))
            column.append(torch.arange(n - 1))
            labels.append(row.ids[1:])
            offset += n
            index += 1
        positions[b, offset:] = torch.arange(capacity - offset)  # the tail: a dummy sequence of its own
    out = {
        "ids": ids,
        "positions": positions,
        "segments": segments,
        "source": torch.cat(source),
        "row": torch.cat(row_index),
    }
    out.update(column=torch.cat(column), labels=torch.cat(labels))
    return {k: v.to(device) for k, v in out.items()}


def block_masks(model: Any, segments: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Any:
    """The 4-D ``(n_bins, 1, P, P)`` mask of packed bins: query ``q`` sees key ``k`` when both are
    in the same row and ``k ≤ q`` (and, in a sliding-window layer, ``q − k < window``, by position
    in the row, as transformers' own masks). One mask, or one per layer type when the model mixes
    sliding and full attention (the mapping those models accept)."""
    text = _text_config(model)
    size = segments.shape[1]
    order = torch.arange(size, device=segments.device)
    full = (segments[:, :, None] == segments[:, None, :]) & (order[:, None] >= order[None, :])
    window = getattr(text, "sliding_window", None)
    slide = full & ((positions[:, :, None] - positions[:, None, :]) < window) if window else full
    eager = (getattr(text, "_attn_implementation", None) or "eager") == "eager"

    def form(allowed: torch.Tensor) -> torch.Tensor:
        allowed = allowed.unsqueeze(1)
        if not eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    layer_types = getattr(text, "layer_types", None)
    if layer_types and "sliding_attention" in layer_types:
        return {"full_attention": form(full), "sliding_attention": form(slide)}
    if not layer_types and window and getattr(text, "use_sliding_window", True):
        return form(slide)  # one sliding window for every layer (mistral)
    return form(full)


def packed_logprobs(
    model: Any, bins: list[list[Row]], width: int, temperature: float, device: torch.device, with_entropy: bool
) -> Any:
    """Log-probs ``(B, width − 1)`` of the bins' rows (in bin order) from one packed forward, and with
    ``with_entropy`` also the per-position entropies: what the padded batch gives, zeros at padding."""
    layout = _layout(bins, device)
    dtype = model.get_input_embeddings().weight.dtype
    mask = block_masks(model, layout["segments"], layout["positions"], dtype)
    hidden = backbone(model)(
        input_ids=layout["ids"], attention_mask=mask, position_ids=layout["positions"], use_cache=False
    ).last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, layout["source"]).unsqueeze(0)
    out = sequence_logprobs(
        model,
        None,
        None,
        layout["labels"].unsqueeze(0),
        temperature=temperature,
        hidden=picked,
        with_entropy=with_entropy,
    )
    n_rows = sum(len(b) for b in bins)
    where = (layout["row"], layout["column"])

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros((n_rows, width - 1)).index_put(where, values[0])

    return (scatter(out[0]), scatter(out[1])) if with_entropy else scatter(out)
