"""Exact training checkpoints and continuation states: one folder format, one tar packing.

Folder layout (``step-000012/``): ``trainable.safetensors`` (every trainable tensor by parameter
name, bit-exact), ``logprobs.safetensors`` (the cached old/reference log-probs of the rows seen so
far: later epochs score against them), ``optimizer.pt``, ``rng.pt`` (torch CPU RNG state),
``state.json`` (schema, step, total steps, training-data and config digests, the loss history so
far). Resuming restores all of them, so the continued run is bit-identical to an uninterrupted one.

A *continuation state* (``kind: "final_state"``) is the same folder written after a training's
last step, for the next iteration of an online run: its ``state.json`` also names the adapter the
state belongs to (``adapter_sha256``), the optimizer, the cumulative optimizer steps and the
ordered ``parameters`` (name, shape). :func:`restore_optimizer_state` loads only its optimizer
state into a new optimizer over the same LoRA parameters (the weights come from that adapter).

Folders travel as deterministic tars (:func:`pack_folder`: sorted names, zeroed metadata), so equal
states have equal digests.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kiln.core.canonical import pretty_json
from kiln.core.errors import TrainingFailed

CHECKPOINT_SCHEMA = "kiln.train-checkpoint.v1"
FINAL_STATE_KIND = "final_state"


def pack_folder(folder: Path) -> bytes:
    """A deterministic tar of a checkpoint folder (sorted names, zeroed metadata)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            info = tarfile.TarInfo(str(path.relative_to(folder)))
            data = path.read_bytes()
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def unpack_folder(data: bytes, folder: Path) -> Path:
    """Extract a :func:`pack_folder` tar into ``folder`` (``resume_invalid`` when unreadable)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            tar.extractall(folder, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise TrainingFailed(f"unreadable training state archive: {exc}", code="resume_invalid") from exc
    return folder


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
        raise TrainingFailed(f"unreadable checkpoint {folder}: {exc}", code="resume_invalid") from exc
    if not isinstance(state, dict) or state.get("schema") != CHECKPOINT_SCHEMA:
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
        raise TrainingFailed("checkpoint parameters do not match the model's LoRA parameters", code="resume_invalid")
    with torch.no_grad():
        for name, param in params:
            param.copy_(tensors[name].to(param.device, param.dtype))
    opt_state = torch.load(io.BytesIO((folder / "optimizer.pt").read_bytes()), weights_only=True)
    optimizer.load_state_dict(opt_state)
    rng = torch.load(io.BytesIO((folder / "rng.pt").read_bytes()), weights_only=True)
    torch.set_rng_state(rng["cpu"])
    cached = folder / "logprobs.safetensors"
    return load_file(str(cached)) if cached.is_file() else {}


def parameter_layout(params: list[tuple[str, torch.nn.Parameter]]) -> list[list[Any]]:
    """``[[name, shape], …]`` in optimizer order: what a continuation state must match."""
    return [[name, list(p.shape)] for name, p in params]


def _invalid(message: str, hint: str | None = None) -> TrainingFailed:
    return TrainingFailed(
        message,
        code="resume_invalid",
        retryable=False,
        hint=hint
        or "continue from the state written with the base adapter's "
        "own training (TrainResult.final_state of that iteration)",
    )


def _check_optimizer_tensors(opt_state: Any, params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Every per-parameter state tensor (``exp_avg``, ``momentum_buffer``, …) has its parameter's
    shape, and the state indexes exactly the live parameters."""
    groups = opt_state.get("param_groups") if isinstance(opt_state, dict) else None
    indices = [i for g in groups or [] for i in g.get("params", [])]
    if indices != list(range(len(params))):
        raise _invalid(
            f"the continuation state's optimizer covers {len(indices)} parameters, the model has {len(params)}"
        )
    for index, values in (opt_state.get("state") or {}).items():
        name, param = params[int(index)]
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                raise _invalid(
                    f"the continuation state's optimizer {key} of {name} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(param.shape)}"
                )


def restore_optimizer_state(
    folder: Path,
    *,
    params: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    optimizer_name: str,
    adapter_sha256: str | None,
) -> dict[str, Any]:
    """Load a continuation state's optimizer state into ``optimizer`` (over ``params``, whose
    weights the caller already loaded from the adapter ``adapter_sha256``); returns its
    ``state.json``. Refuses (``resume_invalid``) a state of another adapter, optimizer or
    parameter layout. Weights, RNG and cached log-probs are not touched."""
    state = read_checkpoint_state(folder)
    if state.get("kind") != FINAL_STATE_KIND:
        raise _invalid(
            "init_state is not a continuation state (kind 'final_state'); a heartbeat "
            "checkpoint resumes its own attempt only"
        )
    if state.get("adapter_sha256") != adapter_sha256:
        raise _invalid(
            f"init_state belongs to adapter {state.get('adapter_sha256')}, but training "
            f"starts from base adapter {adapter_sha256}"
        )
    if state.get("optimizer") != optimizer_name:
        raise _invalid(
            f"init_state holds {state.get('optimizer')!r} optimizer state, the training "
            f"config asks for {optimizer_name!r}",
            hint="keep training_config.optimizer the same across iterations",
        )
    if state.get("parameters") != parameter_layout(params):
        raise _invalid("init_state's LoRA parameter names/shapes differ from the model's")
    try:
        opt_state = torch.load(io.BytesIO((Path(folder) / "optimizer.pt").read_bytes()), weights_only=True)
    except Exception as exc:  # any unreadable pickle is the same refusal
        raise _invalid(f"unreadable optimizer state in init_state: {exc}") from exc
    _check_optimizer_tensors(opt_state, params)
    try:
        optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError) as exc:
        raise _invalid(f"init_state's optimizer state does not fit this optimizer: {exc}") from exc
    return state
