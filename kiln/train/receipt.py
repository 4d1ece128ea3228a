"""The train receipt ``kiln.train-receipt.v1`` (Kiln's own, R5.8-inspired) and its file."""

from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path
from typing import Any

from kiln.canonical import pretty_json

RECEIPT_SCHEMA = "kiln.train-receipt.v1"
RECEIPT_FILE = "train_receipt.json"


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"initial": None, "final": None, "mean": None}
    return {"initial": values[0], "final": values[-1], "mean": math.fsum(values) / len(values)}


def build_receipt(
    *,
    adapter_name: str | None,
    base_model_sha256: str,
    base_adapter_sha256: str | None,
    training_data_sha256: str,
    effective_config: dict[str, Any],
    grpo: dict[str, Any],
    selection: dict[str, Any],
    history: list[dict[str, Any]],
    echo: dict[str, Any],
    token_counts: dict[str, int],
    evaluation: dict[str, Any],
    adapter_sha256: str,
    lora_delta_norm: float,
    lora_delta_norms: dict[str, float],
    behavior_policy: dict[str, Any] | None,
    runtime: dict[str, Any],
    phase_timings: dict[str, float],
    resumed_from_step: int | None,
) -> dict[str, Any]:
    """Assemble the receipt dict (JSON-able; NaN-free by construction of its inputs)."""
    return {
        "schema": RECEIPT_SCHEMA,
        "status": "success",
        "failure_reason": None,
        "adapter_name": adapter_name,
        "produced_at": _dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z"),
        "base_model_sha256": base_model_sha256,
        "base_adapter_sha256": base_adapter_sha256,
        "training_data_sha256": training_data_sha256,
        "behavior_policy": behavior_policy,
        "config": effective_config,
        "grpo": grpo,
        "selection": selection,
        "steps": history,
        "policy_loss": _summary([h["policy_loss"] for h in history]),
        "loss": _summary([h["loss"] for h in history]),
        "echo": echo,
        "token_counts": token_counts,
        "evaluation": evaluation,
        "adapter_sha256": adapter_sha256,
        "lora_delta_norm": lora_delta_norm,
        "lora_delta_norms": lora_delta_norms,
        "runtime": runtime,
        "phase_timings": phase_timings,
        "resumed_from_step": resumed_from_step,
    }


def write_receipt(output_dir: Path, receipt: dict[str, Any]) -> Path:
    """Write ``output_dir/train_receipt.json`` (canonical pretty JSON)."""
    path = Path(output_dir) / RECEIPT_FILE
    path.write_bytes(pretty_json(receipt))
    return path
