"""``--json`` means only JSON on stdout, for failures too (error envelope + exit code)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.cli.app import app

pytestmark = pytest.mark.timeout(60)


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_verify_failure_prints_an_error_envelope_on_stdout(tmp_path: Path) -> None:
    result = _run("openenv", "verify", "--summary", str(tmp_path / "missing.rollout-summary.json"), "--json")
    assert result.exit_code == 2
    envelope = json.loads(result.stdout)
    assert envelope["error"]["code"] == "openenv_verification_failed" and envelope["error"]["exit_code"] == 2
    assert "error" in result.stderr  # the human line goes to stderr


def test_inspect_failure_json_and_plain(tmp_path: Path) -> None:
    url = "http://127.0.0.1:9"  # discard port: nothing listens
    result = _run("openenv", "inspect", "--environment", url, "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["code"] == "environment_unavailable"
    plain = _run("openenv", "inspect", "--environment", url)
    assert plain.exit_code == 2 and plain.stdout == "" and "environment_unavailable" in plain.stderr
