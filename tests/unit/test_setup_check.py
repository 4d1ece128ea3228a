"""scripts/setup.sh's torch check: the version is asserted, never the build (CPU and CUDA pass)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_torch.py"


def _check(version: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--version", version],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "version, kind",
    [("2.13.0+cpu", "cpu"), ("2.13.0+cu128", "cuda (cu128)"), ("2.13.0", "cpu")],
)
def test_cpu_and_cuda_builds_of_the_pinned_version_pass(version: str, kind: str) -> None:
    result = _check(version)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"torch {version} ({kind}) ok"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", ["2.12.1+cu121", "2.13.1", "2.14.0+cpu"])
def test_other_versions_fail_naming_the_required_one(version: str) -> None:
    result = _check(version)
    assert result.returncode == 1
    assert result.stderr.strip() == f"torch {version} is installed but Kiln needs torch 2.13.0 (CPU or CUDA build)"


def test_setup_runs_the_check_and_installs_with_constraints() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "python scripts/check_torch.py" in setup
    assert "torch.version.cuda" not in setup
    assert '-c constraints.txt "torch==2.13.0"' in setup
    pins = dict(
        line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert pins["torch"] == "2.13.0"  # no +cpu: the same pin must accept the CUDA build
    assert pins["transformers"] == "5.24.0" and pins["dashscope"] == "2.0.2"
