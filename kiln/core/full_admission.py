"""Admission of a full fine-tuning run (``training_config.adapter: full``), pure (no torch).

Refused with ``full_training_unsupported`` before anything runs:

- on the vllm engine, which serves LoRA adapters only (the hf engine serves full weights);
- when the full weights the run's plan retains exceed ``KILN_RETAINED_BUDGET_BYTES`` on their own.
  Publication charges every stored entry: each iteration's full weights
  (``iterations/<k>/adapter/…``) and, in an online run, the final adapter (``adapter/…``) once more,
  so the weights count ``iterations + 1`` times (once for a single-iteration run). One copy's bytes
  are estimated from the base model's safetensors headers: every tensor's element count × the
  training dtype's width (``KILN_DTYPE``; ``auto`` is float32 with ``KILN_DEVICE=cpu``, else counts
  2 bytes, the narrowest it picks) plus the
  headers and ``config.json``. A model folder the control worker cannot see is not estimated
  (publication still enforces the budget).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from kiln.core.errors import FullTrainingUnsupported

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def training_dtype(dtype: str, device: str) -> str:
    """The dtype a training on ``device`` runs in for the ``KILN_DTYPE`` setting ``dtype``: ``auto``
    is float32 on ``cpu`` (:mod:`kiln.core.policy.device`); on ``auto``/CUDA devices it stays
    ``auto`` (counted at 2 bytes, the narrowest it picks)."""
    return "float32" if dtype == "auto" and device == "cpu" else dtype


def full_weight_bytes(model_dir: Path, dtype: str) -> int | None:
    """Estimated bytes of one full-weights copy of ``model_dir`` trained in ``dtype`` (None: no
    safetensors files to read)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    width = DTYPE_BYTES.get(dtype, 4)
    total = 0
    for path in files:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header: dict[str, Any] = json.loads(handle.read(length))
        total += 8 + length
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(int(n) for n in entry["shape"]) * width
    config = Path(model_dir) / "config.json"
    return total + (config.stat().st_size if config.is_file() else 0)


def retained_copies(iterations: int) -> int:
    """How many times publication charges the full weights (see the module docstring)."""
    return iterations + 1 if iterations > 1 else 1


def require_full_fits(request: Any, *, engine: str, model_dir: Path | None, dtype: str, budget_bytes: int) -> None:
    """Nothing for a LoRA run; ``full_training_unsupported`` for a full run the deployment
    cannot serve or whose plan's full weights exceed the retained budget."""
    if request.kind != "train" or request.effective_training_config().adapter != "full":
        return
    if engine != "hf":
        raise FullTrainingUnsupported(
            f"training_config.adapter full is not served by the {engine} engine: it loads LoRA adapters only",
            hint="run full training on workers with KILN_ENGINE=hf, or train adapter lora",
            details={"field": "training_config.adapter", "engine": engine},
        )
    if model_dir is None or not Path(model_dir).is_dir():
        return
    one = full_weight_bytes(Path(model_dir), dtype)
    if one is None:
        return
    copies = retained_copies(request.iterations)
    if one * copies > budget_bytes:
        raise FullTrainingUnsupported(
            f"training_config.adapter full retains {copies} copies of the full weights of about {one} bytes "
            f"each ({one * copies} bytes), over the retained-byte budget of {budget_bytes} bytes",
            hint="raise KILN_RETAINED_BUDGET_BYTES, run fewer iterations, or train adapter lora",
            details={
                "field": "training_config.adapter",
                "weights_bytes": one,
                "copies": copies,
                "budget_bytes": budget_bytes,
            },
        )
