"""``--thinking auto|on|off`` and ``--model`` become the request fields the API validates."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from kiln.cli import app as cli
from kiln.cli import run_cmds
from kiln.core.contracts import parse_run_request

BASE = ["openenv", "rollout", "--environment", "http://127.0.0.1:9", "--no-follow"]


def _submitted(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> dict[str, Any]:
    """The request the command would submit (the REST call is the boundary captured here)."""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(run_cmds, "submit_and_follow", lambda request, follow, as_json, *_rest: seen.append(request))
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


TRAIN = ["openenv", "train", "--environment", "http://127.0.0.1:9", "--output-adapter", "agent", "--no-follow"]


def _refused(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> str:
    """Run ``args``; assert nothing was submitted and exit code 2; the output (stdout + stderr)."""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(run_cmds, "submit_and_follow", lambda request, *_rest: seen.append(request))
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 2, result.output
    assert seen == []
    return " ".join(result.output.split())


@pytest.mark.timeout(30)
def test_a_wrong_choice_is_refused_locally_naming_the_flag_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _refused(monkeypatch, TRAIN + ["--optimizer", "sgd"])
    assert "'--optimizer'" in text and "'sgd' is not one of 'muon', 'adamw'" in text
    assert "training_config" not in text
    text = _refused(monkeypatch, TRAIN + ["--report-to", "mlflow"])
    assert "'--report-to'" in text and "'none', 'tensorboard', 'trackio', 'wandb'" in text


@pytest.mark.timeout(30)
def test_model_errors_name_the_flags_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _refused(monkeypatch, TRAIN + ["--group-size", "1"])
    assert "openenv_invalid_request" in text
    assert "--group-size must be >= 2 for training" in text and "body:" not in text
    text = _refused(monkeypatch, TRAIN + ["--groups", "0", "--lora-rank", "0"])
    assert "--groups: Input should be greater than or equal to 1" in text
    assert "--lora-rank: Input should be greater than or equal to 1" in text
    text = _refused(monkeypatch, BASE + ["--groups", "2", "--group-size", "9000"])
    assert "--group-size: Input should be less than or equal to 256" in text


@pytest.mark.timeout(30)
def test_choice_values_reach_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(run_cmds, "submit_and_follow", lambda request, *_rest: seen.append(request))
    result = CliRunner().invoke(cli.app, TRAIN + ["--optimizer", "adamw", "--is-level", "cispo", "--report-to", "tensorboard"])
    assert result.exit_code == 0, result.output
    request = parse_run_request(seen[0])
    assert (request.training_config.optimizer, request.training_config.is_level, request.report_to) == (
        "adamw", "cispo", "tensorboard")
