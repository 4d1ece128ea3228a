"""Kiln's own example servers pass ``openenv validate`` (RFC 008), run as a user runs it.

The examples are modules inside Kiln, not ``openenv.yaml`` packages, so they are validated in the
running-server mode: ``openenv validate --url URL --json`` (the installed ``openenv`` CLI, in a
subprocess) against each example served as ``kiln example-env`` serves it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from examples.envs import EXAMPLE_ENVS
from tests.support.servers import serve_example_env

CRITERIA = [
    "openapi_version_available",
    "health_endpoint",
    "metadata_endpoint",
    "schema_endpoint",
    "mcp_endpoint",
    "mode_endpoint_consistency",
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", sorted(EXAMPLE_ENVS))
def test_example_server_passes_openenv_validate(name: str) -> None:
    with serve_example_env(name) as url:
        done = subprocess.run(
            [sys.executable, "-m", "openenv.cli", "validate", "--url", url, "--json", "--timeout", "10"],
            capture_output=True, text=True, timeout=60, check=False,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] is True
    assert report["mode"] == "simulation"
    assert [c["id"] for c in report["criteria"]] == CRITERIA
    assert [c["passed"] for c in report["criteria"]] == [True] * len(CRITERIA)
