"""``--thinking auto|on|off`` and ``--model`` become the request fields the API validates."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from kiln.cli import app as cli
from kiln.contracts import parse_run_request

BASE = ["openenv", "rollout", "--environment", "http://127.0.0.1:9", "--no-follow"]


def _submitted(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> dict[str, Any]:
    """The request the command would submit (the REST call is the boundary captured here)."""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(cli, "_submit_and_follow", lambda request, follow, as_json, *_rest: seen.append(request))
    result = CliRunner().invoke(cli.app, BASE + args)
    assert result.exit_code == 0, result.output
    assert len(seen) == 1
    return seen[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("flag", "value"), [([], "auto"), (["--thinking", "auto"], "auto"),
                                             (["--thinking", "on"], True), (["--thinking", "off"], False)])
def test_thinking_flag_maps_to_the_request_field(monkeypatch: pytest.MonkeyPatch, flag: list[str], value: Any) -> None:
    request = _submitted(monkeypatch, flag)
    assert request["thinking"] == value
    assert "model" not in request  # no --model: the workers' default model, request unchanged
    assert parse_run_request(request).thinking == value


@pytest.mark.timeout(30)
def test_model_flag_names_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    request = _submitted(monkeypatch, ["--model", "qwen3-4b"])
    assert request["model"] == "qwen3-4b"
    assert parse_run_request(request).model == "qwen3-4b"


@pytest.mark.timeout(30)
def test_thinking_flag_rejects_other_values() -> None:
    result = CliRunner().invoke(cli.app, BASE + ["--thinking", "maybe"])
    assert result.exit_code == 2
    assert "maybe" in result.output
