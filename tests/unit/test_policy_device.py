"""KILN_DEVICE / KILN_DTYPE resolution (this machine has no CUDA device)."""

from __future__ import annotations

import pytest
import torch

from kiln.core.errors import DeviceUnavailable
from kiln.core.policy.device import resolve_placement
from kiln.core.settings import Settings

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only resolution")


def test_auto_is_cpu_float32_without_cuda() -> None:
    placement = resolve_placement("auto", "auto")
    assert (placement.device, placement.dtype, placement.torch_dtype) == ("cpu", "float32", torch.float32)
    assert resolve_placement("cpu", "bfloat16").dtype == "bfloat16"


@pytest.mark.parametrize("device, dtype, field", [
    ("cuda", "auto", "KILN_DEVICE"), ("cuda:1", "auto", "KILN_DEVICE"), ("tpu", "auto", "KILN_DEVICE"),
    ("cpu", "float16", "KILN_DTYPE"), ("cpu", "int8", "KILN_DTYPE"),
])
def test_unavailable_or_unknown_settings_name_the_variable(device: str, dtype: str, field: str) -> None:
    with pytest.raises(DeviceUnavailable) as info:
        resolve_placement(device, dtype)
    assert info.value.code == "device_unavailable" and info.value.details == {"field": field}
    assert field in info.value.message and info.value.hint


def test_settings_read_and_validate_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_DEVICE", "cuda:0")
    monkeypatch.setenv("KILN_DTYPE", "bfloat16")
    settings = Settings()
    assert (settings.device, settings.dtype) == ("cuda:0", "bfloat16")
    monkeypatch.setenv("KILN_DEVICE", "gpu")
    with pytest.raises(ValueError):
        Settings()
