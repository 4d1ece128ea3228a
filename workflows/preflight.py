"""``PreflightWorkflow``: resolve the behaviour policy identity once, for a sealed training contract.

The API runs this short workflow on the control task queue; it runs the gpu worker's
``resolve_policy`` activity (the worker that holds the model computes the identity) on the gpu
task queue named in the input, and returns the identity. Deterministic: no I/O, no clock, no
randomness. An activity failure is re-raised with the same code (``type``) and details, so the API
reports e.g. ``adapter_not_found`` unchanged.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.gpu import GpuActivities
    from kiln.core.records import PolicyInput, PolicyResult
    from kiln.core.side_records import PreflightInput, PreflightResult
    from workflows.names import PREFLIGHT_WORKFLOW
    from workflows.options import ActivityCaller

# The gpu worker may be starting: a preflight waits at most this long for it to pick the task up.
POLICY_START_TIMEOUT = timedelta(minutes=2)


@workflow.defn(name=PREFLIGHT_WORKFLOW)
class PreflightWorkflow:
    @workflow.run
    async def run(self, inp: PreflightInput) -> PreflightResult:
        try:
            call = ActivityCaller(control_queue=workflow.info().task_queue, gpu_queue=inp.gpu_task_queue)
            policy: PolicyResult = await call(
                GpuActivities.resolve_policy,
                PolicyInput(adapter=inp.adapter),
                summary=f"resolve behavior policy ({inp.adapter or 'base'})",
                schedule_to_start_timeout=POLICY_START_TIMEOUT,
            )
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError):
                raise ApplicationError(cause.message, *cause.details, type=cause.type, non_retryable=True) from None
            raise ApplicationError(
                f"resolving the behaviour policy failed: {cause or err}",
                {"code": "openenv_training_preflight_failed", "retryable": True},
                type="openenv_training_preflight_failed",
                non_retryable=True,
            ) from None
        return PreflightResult(behavior_policy=policy.behavior_policy)
