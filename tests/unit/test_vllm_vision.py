"""kiln/core/policy/vllm_vision.py: a torchvision whose compiled extension cannot load still imports
in the engine's processes (its operators' schemas defined, kernels that raise), and vLLM's
model-inspection subprocess runs the same install first.

Run in a fresh interpreter (the operators are defined process-wide): a stand-in torchvision
package that does what torchvision 0.28 does at import (load ``_C``, then register a fake for
``torchvision::nms`` and ``torchvision::qnms``), with a ``_C.so`` that is not a library.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

POLICY = Path(__file__).resolve().parents[2] / "kiln" / "core" / "policy"

STAND_IN = '''
import torch
try:
    torch.ops.load_library(__file__.replace("__init__.py", "_C.so"))
    HAS_OPS = True
except OSError:
    HAS_OPS = False

@torch.library.register_fake("torchvision::nms")
def _nms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)

@torch.library.register_fake("torchvision::qnms")
def _qnms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)
'''

PROBE = '''
import json, sys
sys.path.insert(0, sys.argv[1])
import vllm_vision
out = {"absent": vllm_vision.install(sys.argv[3])}
try:
    import torchvision
    out["import_before"] = "ok"
except Exception as exc:
    out["import_before"] = str(exc)
out["found"] = vllm_vision.install(sys.argv[2])
out["again"] = vllm_vision.install(sys.argv[2])
import torch, torchvision
out["has_ops"] = torchvision.HAS_OPS
try:
    torch.ops.torchvision.nms(torch.zeros(1, 4), torch.ones(1), 0.5)
except RuntimeError as exc:
    out["nms"] = str(exc)
out["inspection"] = vllm_vision.inspection_command(sys.argv[1])
print(json.dumps(out))
'''


@pytest.mark.timeout(120)
def test_a_torchvision_without_its_extension_imports_and_its_operators_raise_a_clear_error(tmp_path: Path) -> None:
    prefix = tmp_path / "venv"
    package = prefix / "kiln-torchvision" / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    (package / "_C.so").write_bytes(b"not a shared library")
    (tmp_path / "empty").mkdir()
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(POLICY), str(prefix), str(tmp_path / "empty")],
        capture_output=True, text=True, timeout=100,
    )
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout.strip().splitlines()[-1])
    assert out["absent"] == "absent" and out["import_before"] == "No module named 'torchvision'"
    assert (out["found"], out["again"], out["has_ops"]) == ("text-only", "text-only", False)
    assert out["nms"] == (
        "torchvision's compiled operator torchvision::nms is not available in Kiln's vllm engine: its "
        "torchvision build does not load against the engine's torch, so it serves models as text only "
        "(install the build matching the engine's torch with scripts/setup_vllm.sh)"
    )
    command = out["inspection"]
    assert command[:2] == [sys.executable, "-c"]
    assert command[2].startswith(f"import sys; sys.path.insert(0, {str(POLICY)!r}); import vllm_vision; ")
    assert command[2].endswith("from vllm.model_executor.models.registry import _run; _run()")
