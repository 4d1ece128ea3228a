"""Training preflight: seal the training contract a run will execute from.

The effective configuration is the requested ``TrainingConfig`` with every default filled in; the
behaviour-policy identity is resolved by a gpu worker (the one holding the model) through the
``PreflightWorkflow`` on the control task queue. The receipt reserves no capacity.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError, TimeoutError as TemporalTimeoutError

from kiln.core.errors import PreflightFailed
from kiln.api_models import PreflightReceipt
from kiln.core.request_fields import check_adapter_name, check_model_name, normalize_adapter
from kiln.core.training_config import TrainingConfig, TrainingContract
from kiln.core.errors import error_from_dict
from kiln.core.served_models import model_task_queue, require_served
from kiln.core.settings import Settings
from kiln.core.side_records import PreflightInput, PreflightResult
from workflows.names import PREFLIGHT_WORKFLOW

PREFLIGHT_TIMEOUT = timedelta(minutes=6)


class PreflightRequest(BaseModel):
    """``POST /v1/openenv/training/preflight`` body (unknown fields rejected)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    adapter: str | None = Field(default="base", description="Behaviour adapter; base/none/null = base model.")
    model: str | None = Field(
        default=None, description="Served model the run will name (default: the workers' default)."
    )
    output_adapter: str = Field(description="Name of the adapter the run will train.")
    training_config: TrainingConfig | None = Field(
        default=None, description="GRPO + ECHO configuration; defaults are filled in."
    )
    auto_load: bool = True

    @field_validator("adapter")
    @classmethod
    def _adapter(cls, value: str | None) -> str:
        normalized = normalize_adapter(value)
        return "base" if normalized is None else check_adapter_name(normalized, "adapter")

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        return check_model_name(value)

    @field_validator("output_adapter")
    @classmethod
    def _output(cls, value: str) -> str:
        return check_adapter_name(value.strip(), "output_adapter")

    @model_validator(mode="after")
    def _distinct(self) -> "PreflightRequest":
        if self.output_adapter == self.adapter:
            raise ValueError("output_adapter must differ from the behaviour adapter")
        return self


async def resolve_behavior_policy(
    client: Client, settings: Settings, adapter: str | None, model: str | None = None
) -> dict[str, Any]:
    """Run ``PreflightWorkflow`` on ``model``'s gpu queue and return its behaviour-policy identity."""
    require_served(model, settings.models_dir, default=settings.default_model_path.name, engine=settings.engine)
    gpu_task_queue = model_task_queue(settings.gpu_task_queue, model)
    try:
        result: PreflightResult = await client.execute_workflow(
            PREFLIGHT_WORKFLOW,
            PreflightInput(adapter=adapter, gpu_task_queue=gpu_task_queue),
            id=f"kiln-preflight-{uuid.uuid4()}",
            task_queue=settings.control_task_queue,
            execution_timeout=PREFLIGHT_TIMEOUT,
            result_type=PreflightResult,
        )
    except WorkflowFailureError as err:
        cause = err.cause
        if isinstance(cause, ApplicationError) and cause.details and isinstance(cause.details[0], dict):
            raise error_from_dict(cause.details[0]) from None
        if isinstance(cause, TemporalTimeoutError):
            raise PreflightFailed(
                "no gpu worker resolved the behaviour policy in time",
                hint="start a gpu worker (`python -m workers gpu`) on " + gpu_task_queue,
            ) from None
        raise PreflightFailed(f"training preflight failed: {cause or err}") from None
    return result.behavior_policy


async def preflight(client: Client, settings: Settings, request: PreflightRequest) -> PreflightReceipt:
    """The preflight receipt: ``{schema, contract, effective_config, behavior_policy, ...}``."""
    base_adapter = normalize_adapter(request.adapter)
    behavior_policy = await resolve_behavior_policy(client, settings, base_adapter, request.model)
    contract = TrainingContract(
        effective_config=request.training_config or TrainingConfig(),
        behavior_policy=behavior_policy,
        output_adapter=request.output_adapter,
        base_adapter=base_adapter,
    )
    sealed = contract.model_dump(mode="json", by_alias=True)
    return PreflightReceipt(
        contract=sealed,
        effective_config=sealed["effective_config"],
        behavior_policy=behavior_policy,
        auto_load=request.auto_load,
        checked_unix_ms=int(time.time() * 1000),
        capacity_reserved=False,
    )
