"""Device and dtype resolution for the policy runtime and the trainer (one rule for both).

``KILN_DEVICE`` is ``auto | cpu | cuda | cuda:N`` and ``KILN_DTYPE`` is ``auto | bfloat16 | float16
| float32``. ``auto`` device = ``cuda`` when ``torch.cuda.is_available()``, else ``cpu``. ``auto``
dtype = ``bfloat16`` on a CUDA device that supports it (else ``float16``), ``float32`` on CPU. The
resolved pair (for example ``("cuda:0", "bfloat16")``) is what receipts, identities and status
report. A CUDA device that is not there raises :class:`kiln.core.errors.DeviceUnavailable`
(``device_unavailable``); ``bfloat16`` on CPU is allowed (slow), ``float16`` on CPU is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kiln.core.errors import DeviceUnavailable

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """A resolved device (``cpu`` or ``cuda:N``) and dtype name."""

    device: str
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def resolve_device(setting: str = "auto") -> str:
    """``cpu`` or ``cuda:N`` for a ``KILN_DEVICE`` value; DeviceUnavailable when CUDA is absent."""
    value = (setting or "auto").strip().lower()
    if not re.match(DEVICE_PATTERN, value):
        raise DeviceUnavailable(
            f"KILN_DEVICE={setting!r} is not a device",
            hint="use auto, cpu, cuda or cuda:N",
            details={"field": "KILN_DEVICE"},
        )
    if value == "auto":
        value = "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"KILN_DEVICE={setting} but this machine has no usable CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})",
            hint="set KILN_DEVICE=cpu (or auto), or install a CUDA build of torch on a GPU machine",
            details={"field": "KILN_DEVICE"},
        )
    index = int(value.split(":", 1)[1]) if ":" in value else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise DeviceUnavailable(
            f"KILN_DEVICE={setting} but only {torch.cuda.device_count()} CUDA device(s) exist",
            hint="use cuda:0 … cuda:N-1",
            details={"field": "KILN_DEVICE"},
        )
    return f"cuda:{index}"


def resolve_dtype(setting: str, device: str) -> str:
    """The dtype name for a ``KILN_DTYPE`` value on a resolved ``device``."""
    value = (setting or "auto").strip().lower()
    if value not in DTYPE_CHOICES:
        raise DeviceUnavailable(
            f"KILN_DTYPE={setting!r} is not a dtype",
            hint="use auto, bfloat16, float16 or float32",
            details={"field": "KILN_DTYPE"},
        )
    on_cuda = device.startswith("cuda")
    if value == "auto":
        if not on_cuda:
            return "float32"
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if value == "float16" and not on_cuda:
        raise DeviceUnavailable(
            "KILN_DTYPE=float16 needs a CUDA device",
            hint="use float32 (or bfloat16) on CPU",
            details={"field": "KILN_DTYPE"},
        )
    return value


def resolve_placement(device: str = "auto", dtype: str = "auto") -> Placement:
    """Resolve both settings at once (device first: the dtype default depends on it)."""
    resolved = resolve_device(device)
    return Placement(device=resolved, dtype=resolve_dtype(dtype, resolved))


def dtype_name(model) -> str:
    """The floating dtype of a model's first floating parameter (``float32``, ``bfloat16`` …)."""
    for param in model.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return "float32"


__all__ = ["Placement", "dtype_name", "resolve_device", "resolve_dtype", "resolve_placement"]
