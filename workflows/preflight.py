"""``PreflightWorkflow``: resolve the behaviour policy identity once, for a sealed training contract.

The API runs this short workflow on the control task queue; it runs the gpu worker's
``resolve_policy`` activity (the worker that holds the model computes the identity) on the gpu
task queue named in the input, and returns the identity. Deterministic: no I/O, no clock, no
randomness. An activity failure is re-raised with the same code (``type``) and details, so the API
reports e.g. ``adapter_not_found`` unchanged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from kiln.records import PolicyInput, PolicyResult

PREFLIGHT_WORKFLOW_NAME = "PreflightWorkflow"
POLICY_START_TIMEOUT = timedelta(minutes=2)
POLICY_RUN_TIMEOUT = timedelta(minutes=5)
POLICY_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
)


class PreflightInput(BaseModel):
    """Which behaviour adapter to resolve (None = base model) and where the gpu workers listen."""

    model_config = ConfigDict(extra="forbid")

    adapter: str | None = None
    gpu_task_queue: str


class PreflightResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    behavior_policy: dict[str, Any]


@workflow.defn(name=PREFLIGHT_WORKFLOW_NAME)
class PreflightWorkflow:
    @workflow.run
    async def run(self, inp: PreflightInput) -> PreflightResult:
        try:
            policy: PolicyResult = await workflow.execute_activity(
                "resolve_policy",
                PolicyInput(adapter=inp.adapter),
                result_type=PolicyResult,
                task_queue=inp.gpu_task_queue,
                schedule_to_start_timeout=POLICY_START_TIMEOUT,
                start_to_close_timeout=POLICY_RUN_TIMEOUT,
                retry_policy=POLICY_RETRY,
                summary=f"resolve behaviour policy ({inp.adapter or 'base'})",
            )
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError):
                raise ApplicationError(
                    cause.message, *cause.details, type=cause.type, non_retryable=True
                ) from None
            raise ApplicationError(
                f"resolving the behaviour policy failed: {cause or err}",
                {"code": "openenv_training_preflight_failed", "retryable": True},
                type="openenv_training_preflight_failed",
                non_retryable=True,
            ) from None
        return PreflightResult(behavior_policy=policy.behavior_policy)
