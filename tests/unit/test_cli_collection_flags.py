"""``--reset-determinism strict|warn`` and ``--replay-ignore FIELD`` (repeatable) on ``kiln openenv
rollout`` and ``train`` become the request fields the API validates; choices and defaults come
from the model."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from kiln.cli import app as cli
from kiln.cli import run_cmds
from kiln.cli import run_flags
from kiln.core.contracts import RunRequest, parse_run_request
from kiln.core.errors import InvalidRequest

ROLLOUT = ["openenv", "rollout", "--environment", "http://127.0.0.1:9", "--no-follow"]
TRAIN = ["openenv", "train", "--environment", "http://127.0.0.1:9", "--output-adapter", "a", "--no-follow"]
CLOCK = "result.observation.metadata.execution_time"

pytestmark = pytest.mark.timeout(30)


def _submitted(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> dict[str, Any]:
    """The request the command would submit (the REST call is the boundary captured here)."""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(run_cmds, "submit_and_follow", lambda request, *_rest: seen.append(request))
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("command", [ROLLOUT, TRAIN], ids=["rollout", "train"])
def test_reset_determinism_and_replay_ignore_reach_the_request(monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    plain = _submitted(monkeypatch, command)
    assert "reset_determinism" not in plain and "replay_ignore" not in plain  # defaults: request unchanged
    assert parse_run_request(plain).reset_determinism == "strict" and parse_run_request(plain).replay_ignore == []
    asked = _submitted(monkeypatch, command + ["--reset-determinism", "warn", "--replay-ignore", CLOCK,
                                              "--replay-ignore", "final_state.clock"])
    assert asked["reset_determinism"] == "warn"
    parsed = parse_run_request(asked)
    assert parsed.reset_determinism == "warn"
    assert parsed.replay_ignore == ["final_state.clock", CLOCK]  # sorted, unique
    assert parsed.episode_settings(False).replay_ignore == ["final_state.clock", CLOCK]


def test_reset_determinism_choices_are_the_models() -> None:
    result = CliRunner().invoke(cli.app, ROLLOUT + ["--reset-determinism", "loose"])
    assert result.exit_code == 2 and "loose" in result.output
    assert [c.value for c in run_flags.ResetDeterminism] == ["strict", "warn"]
    assert run_flags.ResetDeterminism(RunRequest.model_fields["reset_determinism"].default).value == "strict"


def test_a_replay_ignore_path_outside_steps_and_state_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_run_request({"environment_urls": ["http://127.0.0.1:9"], "replay_ignore": ["metadata.execution_time"]})
    assert info.value.code == "openenv_invalid_request"
    assert "replay_ignore" in info.value.message and "result.observation." in info.value.message


@pytest.mark.parametrize("command", [ROLLOUT, TRAIN], ids=["rollout", "train"])
def test_context_policy_reaches_the_request(monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    plain = _submitted(monkeypatch, command)
    assert "context_policy" not in plain and parse_run_request(plain).context_policy == "end"
    asked = _submitted(monkeypatch, command + ["--context-policy", "end_penalised"])
    assert asked["context_policy"] == "end_penalised"
    assert parse_run_request(asked).episode_settings(False).context_policy == "end_penalised"
    assert [c.value for c in run_flags.ContextPolicy] == ["end", "end_penalised"]
    refused = CliRunner().invoke(cli.app, command + ["--context-policy", "window"])
    assert refused.exit_code == 2 and "window" in refused.output
