"""Exact training checkpoints: LoRA weights, optimizer state, RNG state, data cursor, history.

Folder layout (``step-000012/``): ``trainable.safetensors`` (every trainable tensor by parameter
name, bit-exact), ``logprobs.safetensors`` (the cached old/reference log-probs of the rows seen so
far: later epochs score against them), ``optimizer.pt``, ``rng.pt`` (torch CPU RNG state),
``state.json`` (schema,
step, total steps, training-data and config digests, the loss history so far). Resuming restores all
of them, so the continued run is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kiln.canonical import pretty_json
from kiln.errors import TrainingFailed

CHECKPOINT_SCHEMA = "kiln.train-checkpoint.v1"


def save_checkpoint(
    folder: Path,
    *,
    params: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    logprobs: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint folder; ``state`` must be JSON-able and contain ``step``."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu").contiguous().clone() for name, p in params}
    save_file(tensors, str(folder / "trainable.safetensors"), metadata={"format": "pt"})
    cached = {k: v.contiguous() for k, v in (logprobs or {}).items()}
    save_file(cached, str(folder / "logprobs.safetensors"), metadata={"format": "pt"})
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    (folder / "optimizer.pt").write_bytes(buffer.getvalue())
    buffer = io.BytesIO()
    torch.save({"cpu": torch.get_rng_state()}, buffer)
    (folder / "rng.pt").write_bytes(buffer.getvalue())
    (folder / "state.json").write_bytes(pretty_json({"schema": CHECKPOINT_SCHEMA, **state}))
    return folder


def read_checkpoint_state(folder: Path) -> dict[str, Any]:
    """The checkpoint's ``state.json`` (validated schema)."""
    path = Path(folder) / "state.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TrainingFailed(
            f"unreadable checkpoint {folder}: {exc}", code="resume_invalid"
        ) from exc
    if state.get("schema") != CHECKPOINT_SCHEMA:
        raise TrainingFailed(f"not a Kiln training checkpoint: {folder}", code="resume_invalid")
    return state


def restore_checkpoint(
    folder: Path,
    *,
    params: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
) -> dict[str, torch.Tensor]:
    """Load weights, optimizer and RNG state from ``folder`` into the live objects; returns the
    cached log-probs."""
    folder = Path(folder)
    tensors = load_file(str(folder / "trainable.safetensors"))
    names = {name for name, _ in params}
    if set(tensors) != names:
        raise TrainingFailed(
            "checkpoint parameters do not match the model's LoRA parameters", code="resume_invalid"
        )
    with torch.no_grad():
        for name, param in params:
            param.copy_(tensors[name].to(param.device, param.dtype))
    opt_state = torch.load(io.BytesIO((folder / "optimizer.pt").read_bytes()), weights_only=True)
    optimizer.load_state_dict(opt_state)
    rng = torch.load(io.BytesIO((folder / "rng.pt").read_bytes()), weights_only=True)
    torch.set_rng_state(rng["cpu"])
    cached = folder / "logprobs.safetensors"
    return load_file(str(cached)) if cached.is_file() else {}
