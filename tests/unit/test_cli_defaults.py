"""Each default lives once, in the model: every CLI option that sets a request field defaults to
exactly that field's model default (so the CLI can never drift from the API and the workflow)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from typer.models import OptionInfo

from kiln.cli import app as cli
from kiln.cli import run_cmds
from kiln.cli import control_cmds
from kiln.core.contracts import RunRequest
from kiln.core.training_config import EchoConfig, EnvironmentEvalConfig, GateConfig, TrainingConfig

# CLI parameters whose name differs from the model field they set.
RENAMED = {
    "echo_lambda": (EchoConfig, "lambda_"),
    "eval_group_size": (EnvironmentEvalConfig, "group_size"),
    "eval_seed_start": (EnvironmentEvalConfig, "seed_start"),
    "min_mean_improvement": (GateConfig, "min_mean_improvement"),
    "min_mean_return": (GateConfig, "min_mean_return"),
}
# CLI-only switches, or options whose value is a file/flag rather than the field's value.
CLI_ONLY = {"eval_groups", "gate", "follow_run", "as_json", "force", "output", "replay_output",
            "summary_output", "environment", "reset_options", "environment_reset_options",
            "credential_id", "input_path", "training_config", "contract_output", "post_eval_suite",
            "post_eval_min_accuracy", "preflight"}


def _field(name: str) -> tuple[Any, str] | None:
    if name in RENAMED:
        return RENAMED[name]
    for model in (RunRequest, TrainingConfig):
        if name in model.model_fields:
            return model, name
    return None


def _model_default(model: Any, field: str) -> Any:
    return model.model_fields[field].get_default(call_default_factory=True)


COMMANDS = [run_cmds.train_cmd, run_cmds.rollout_cmd, run_cmds.train_grpo_cmd, control_cmds.preflight_cmd]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", COMMANDS, ids=[c.__name__ for c in COMMANDS])
def test_every_cli_default_is_the_model_default(command: Any) -> None:
    checked = 0
    for name, parameter in inspect.signature(command).parameters.items():
        option = parameter.default
        if not isinstance(option, OptionInfo) or option.default is ...:
            continue
        if name in CLI_ONLY:
            continue
        target = _field(name)
        assert target is not None, f"{command.__name__} --{name} sets no known model field"
        model, field = target
        assert option.default == _model_default(model, field), (command.__name__, name)
        checked += 1
    assert checked >= 1


@pytest.mark.timeout(30)
def test_known_defaults_reach_the_cli() -> None:
    """The concrete values, so a changed model default is a visible, reviewed change."""
    options = inspect.signature(run_cmds.train_cmd).parameters
    assert options["learning_rate"].default.default is None  # null ⇒ AdamW 3e-4, Muon 2e-3
    assert options["optimizer"].default.default == "adamw"
    assert options["is_level"].default.default == "cispo"
    assert options["kl_coeff"].default.default == 0.0
    assert options["group_size"].default.default == 4
    assert options["groups"].default.default == 8
    assert options["echo_lambda"].default.default == 0.05
    grpo = inspect.signature(run_cmds.train_grpo_cmd).parameters
    assert grpo["learning_rate"].default.default == TrainingConfig().learning_rate
