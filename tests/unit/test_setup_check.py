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


def _quiet(command: str, verbose: bool) -> subprocess.CompletedProcess:
    """``quiet COMMAND`` from scripts/lib/quiet.sh, then its status on stdout."""
    env = {"PATH": "/usr/bin:/bin", "KILN_VERBOSE": "1" if verbose else "0"}
    return subprocess.run(["bash", "-c", f'. scripts/lib/quiet.sh; quiet {command}; echo "status $?"'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
def test_setup_prints_only_its_own_lines_unless_verbose() -> None:
    banner = "bash -c 'echo Obtaining file:///kiln; echo running egg_info >&2'"
    hidden = _quiet(banner, verbose=False)
    assert (hidden.stdout, hidden.stderr) == ("status 0\n", "")
    shown = _quiet(banner, verbose=True)
    assert (shown.stdout, shown.stderr) == ("Obtaining file:///kiln\nstatus 0\n", "running egg_info\n")
    failed = _quiet("bash -c 'echo no matching distribution; exit 3'", verbose=False)
    assert failed.stdout == "status 3\n"  # the failure is not swallowed: setup.sh (set -e) stops
    assert failed.stderr.splitlines() == ["no matching distribution",
                                          "setup: 'bash -c echo no matching distribution; exit 3' failed (exit 3)"]
    setup = (ROOT / "scripts" / "setup.sh").read_text().splitlines()
    installs = [line for line in setup if "pip install" in line]
    assert len(installs) == 4 and all(line.startswith("quiet ") for line in installs), installs
