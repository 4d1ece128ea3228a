"""Continuation across the iterations of an online run: the optimizer state handed from one
training to the next.

A training asked to ``keep_state`` writes, after its last step, a continuation state
(:mod:`kiln.core.train.checkpoints` format, ``kind: "final_state"``) packed as a deterministic tar,
``final_state.tar``, whose SHA-256 is the state's identity (the stored object's digest). The next
iteration starts its LoRA weights from that training's adapter (``base_adapter``) and its optimizer
from the state (``init_state``): AdamW's ``exp_avg``/``exp_avg_sq`` and per-parameter ``step``
(so bias correction continues), Muon's momentum buffers. The learning-rate schedule restarts in
every training (warm-up and cosine span each iteration's own steps). Weights, RNG and cached
log-probs are not taken from the state.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.core.canonical import sha256_bytes
from kiln.core.errors import TrainingFailed
from kiln.core.train.checkpoints import (
    FINAL_STATE_KIND,
    pack_folder,
    parameter_layout,
    read_checkpoint_state,
    save_checkpoint,
    unpack_folder,
)

FINAL_STATE_FILE = "final_state.tar"


@dataclass(frozen=True)
class InitState:
    """An unpacked continuation state and its digest."""

    folder: Path
    sha256: str
    state: dict[str, Any]

    def continued_from(self, adapter_sha256: str | None) -> dict[str, Any]:
        """The receipt's ``continued_from`` block."""
        return {
            "adapter_sha256": adapter_sha256,
            "optimizer_state_sha256": self.sha256,
            "optimizer_steps_before": int(self.state.get("optimizer_steps_total") or 0),
        }


FIRST_MOMENT_KEYS = ("exp_avg", "momentum_buffer")


def reset_first_moments(optimizer: torch.optim.Optimizer) -> int:
    """Zero every parameter's first moment (AdamW ``exp_avg``, Muon ``momentum_buffer``) in place,
    keeping the second moment and the step counters; returns how many tensors were zeroed."""
    zeroed = 0
    for state in optimizer.state.values():
        for key in FIRST_MOMENT_KEYS:
            value = state.get(key)
            if isinstance(value, torch.Tensor):
                value.zero_()
                zeroed += 1
    return zeroed


def read_init_state(archive: Path, work_dir: Path) -> InitState:
    """Unpack the ``init_state`` tar into ``work_dir/init_state`` (``resume_invalid`` when it
    is not a readable state)."""
    try:
        data = Path(archive).read_bytes()
    except OSError as exc:
        raise TrainingFailed(f"cannot read init_state {archive}: {exc}", code="resume_invalid") from exc
    folder = work_dir / "init_state"
    if folder.exists():
        shutil.rmtree(folder)
    unpack_folder(data, folder)
    return InitState(folder=folder, sha256=sha256_bytes(data), state=read_checkpoint_state(folder))


def write_final_state(
    output_dir: Path,
    *,
    params: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    identity: dict[str, Any],
    steps: int,
    adapter_sha256: str,
    optimizer_name: str,
    steps_before: int,
) -> tuple[Path, str]:
    """Write ``output_dir/final_state.tar``; returns its path and ``sha256:`` digest."""
    folder = output_dir / "final_state"
    if folder.exists():
        shutil.rmtree(folder)
    save_checkpoint(
        folder,
        params=params,
        optimizer=optimizer,
        state={
            **identity,
            "kind": FINAL_STATE_KIND,
            "step": steps,
            "adapter_sha256": adapter_sha256,
            "optimizer": optimizer_name,
            "optimizer_steps_total": steps_before + steps,
            "parameters": parameter_layout(params),
        },
    )
    data = pack_folder(folder)
    shutil.rmtree(folder)
    path = output_dir / FINAL_STATE_FILE
    path.write_bytes(data)
    return path, sha256_bytes(data)
