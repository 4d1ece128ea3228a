"""The CLI keeps its promises (issue 41): under ``--json`` every Click parse error prints one JSON
error envelope on stdout (code ``cli_usage_error``, exit status 2); no message rewrites the user's
own value, none carries pydantic's ``Value error,`` prefix."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kiln.cli.app import app
from kiln.cli.help import plain_command

pytestmark = pytest.mark.timeout(60)

ENV = ["--environment", "http://127.0.0.1:9", "--no-follow"]
TRAIN = ["openenv", "train", *ENV, "--output-adapter", "a"]
CASES = {
    "bad choice": (["openenv", "rollout", *ENV, "--thinking", "maybe"], "--thinking", "'maybe' is not one of"),
    "bad type": (["openenv", "rollout", *ENV, "--groups", "abc"], "--groups", "valid integer"),
    "train choice": ([*TRAIN, "--optimizer", "sgd"], "--optimizer", "'sgd' is not one of 'muon', 'adamw'"),
    "unknown option": (["openenv", "rollout", *ENV, "--bogus"], "--bogus", "No such option: --bogus"),
    "runs state": (["openenv", "runs", "--state", "bogus"], "--state", "'bogus' is not one of 'running'"),
    "missing argument": (["openenv", "status"], "run_id", "Missing argument 'RUN_ID'"),
    "unknown command": (["openenv", "nosuch"], None, "No such command 'nosuch'"),
    "missing value": (["openenv", "rollout", *ENV, "--json", "--groups"], "--groups", "requires an argument"),
}


def _run(args: list[str]):
    return CliRunner().invoke(plain_command(app), args)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_parse_error_class_prints_one_envelope_under_json(name: str) -> None:
    args, parameter, words = CASES[name]
    result = _run(args if "--json" in args else [*args, "--json"])
    assert result.exit_code == 2
    envelope = json.loads(result.stdout)  # exactly one JSON document, nothing else on stdout
    error = envelope["error"]
    assert error["code"] == "cli_usage_error" and error["exit_code"] == 2 and error["retryable"] is False
    assert words in error["message"] and "Value error" not in error["message"]
    assert (error.get("details") or {}).get("parameter") == parameter
    assert "Error:" in result.stderr and "Value error" not in result.stderr


def test_without_json_stdout_stays_empty() -> None:
    result = _run(["openenv", "rollout", *ENV, "--thinking", "maybe"])
    assert result.exit_code == 2 and result.stdout == ""
    assert "'maybe' is not one of 'auto', 'on', 'off'." in result.stderr and "Value error" not in result.stderr


def test_messages_never_rewrite_the_users_value() -> None:
    value = "observation.metadata.execution_time"
    result = _run(["openenv", "rollout", *ENV, "--replay-ignore", value, "--json"])
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "openenv_invalid_request"
    assert error["message"] == (
        f"invalid flags: --replay-ignore: '{value}' must start with result.observation. (a step observation "
        "field) or final_state. (a final state field)"
    )


def test_advice_keeps_plain_words_and_names_the_right_flag() -> None:
    result = _run([*TRAIN, "--eval-groups", "5", "--gate", "--json"])
    message = json.loads(result.stdout)["error"]["message"]
    assert "needs --eval-groups >= 20 (paired seed groups)" in message
    result = _run(["openenv", "rollout", *ENV, "--groups", "10000", "--group-size", "4", "--json"])
    assert json.loads(result.stdout)["error"]["message"] == (
        "invalid flags: --groups × --group-size must be <= 16384 rollouts")
