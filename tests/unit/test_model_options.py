"""Field descriptions live once, on the request models: the CLI reads them (with bounds and
choices) as it reads defaults, and the API's OpenAPI document (``/docs``) shows the same text."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.app import create_app
from kiln.cli.model_options import bounds, choices, default, describe
from kiln.core.contracts import RunRequest
from kiln.core.training_config import (
    DynamicSamplingConfig,
    EchoConfig,
    EnvironmentEvalConfig,
    GateConfig,
    PostEvalConfig,
    TrainingConfig,
)
from kiln.core.settings import Settings

REQUEST_MODELS = (
    RunRequest, TrainingConfig, EchoConfig, DynamicSamplingConfig, GateConfig, EnvironmentEvalConfig, PostEvalConfig,
)


@pytest.mark.timeout(30)
def test_every_request_field_has_a_description() -> None:
    missing = [f"{m.__name__}.{n}" for m in REQUEST_MODELS for n, f in m.model_fields.items() if not f.description]
    assert missing == []


@pytest.mark.timeout(30)
def test_describe_appends_the_bounds_the_model_enforces() -> None:
    assert describe(RunRequest, "groups") == "Seed groups to collect (1-16384)."
    assert describe(RunRequest, "group_size") == "Candidates per seed group (at least 2 for training; 1-256)."
    assert describe(TrainingConfig, "clip_epsilon").endswith("(1 ± epsilon; >= 0, < 1).")
    assert describe(TrainingConfig, "learning_rate", with_bounds=False) == (
        "Learning rate (default: AdamW 3e-4, Muon 2e-3)."
    )
    assert bounds(EchoConfig, "lambda_") == ">= 0"
    assert bounds(TrainingConfig, "optimizer") is None
    assert choices(TrainingConfig, "optimizer") == ("muon", "adamw")
    assert choices(RunRequest, "thinking") == ("auto",)
    assert choices(RunRequest, "groups") == ()
    assert default(TrainingConfig, "lora_rank") == 16
    assert isinstance(default(TrainingConfig, "echo"), EchoConfig)
    with pytest.raises(KeyError, match="no field 'nope'"):
        describe(RunRequest, "nope")


@pytest.mark.timeout(60)
def test_openapi_shows_the_same_descriptions(tmp_path: Path) -> None:
    schemas = create_app(Settings(home=tmp_path)).openapi()["components"]["schemas"]
    for model in REQUEST_MODELS:
        properties = schemas[model.__name__]["properties"]
        for name, field in model.model_fields.items():
            key = field.alias or name
            assert properties[key]["description"] == field.description, (model.__name__, key)
