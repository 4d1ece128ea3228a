"""The one options table of every activity a workflow calls, and the one way to call one.

Per activity: the task queue (control or gpu), timeouts, retry policy, whether it heartbeats and
how a cancel reaches it. Workflows call ``ActivityCaller(...)(Activities.method, arg, summary=…)``
with the method itself (never a name string); the result type comes from its annotation.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityCancellationType

from workflows.names import WORKFLOW_NAME  # noqa: F401  (kept importable here for callers)

MAX_PARALLEL_GROUPS = 4

CONTROL_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
)
GROUP_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=5,
)
# Joining the run queue is idempotent (a run already queued gets its place back), so it may be
# tried for as long as a burst of submissions keeps the queue workflow busy, bounded by ENQUEUE_TIMEOUT.
ENQUEUE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=0,
    non_retryable_error_types=["openenv_run_capacity_full"],
)
# Publication must outlive an S3 restart: unlimited attempts, bounded by PUBLISH_TIMEOUT.
PUBLISH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=0,
    non_retryable_error_types=[
        "retained_budget_exceeded",
        "artifact_publication_failed",
        "openenv_artifact_integrity_failed",
    ],
)
TRAIN_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=2),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
)

ADMISSION_TIMEOUT = timedelta(seconds=30)
ENQUEUE_TIMEOUT = timedelta(minutes=10)
DISCOVERY_TIMEOUT = timedelta(minutes=3)
POLICY_TIMEOUT = timedelta(minutes=5)
GROUP_TIMEOUT = timedelta(hours=2)
GROUP_HEARTBEAT = timedelta(seconds=30)
TRAIN_TIMEOUT = timedelta(hours=12)
PUBLISH_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class ActivityOptions:
    queue: Literal["control", "gpu"]
    retry: RetryPolicy
    start_to_close: timedelta | None = None
    schedule_to_close: timedelta | None = None
    heartbeat: bool = False
    cancellation: ActivityCancellationType = ActivityCancellationType.TRY_CANCEL


_CONTROL = ActivityOptions("control", CONTROL_RETRY, start_to_close=ADMISSION_TIMEOUT)
# Discovery and revalidation heartbeat while their requests run: a killed control worker is
# noticed after the heartbeat timeout, not DISCOVERY_TIMEOUT.
_INSPECT = ActivityOptions("control", CONTROL_RETRY, start_to_close=DISCOVERY_TIMEOUT, heartbeat=True)
_STORE = ActivityOptions("control", PUBLISH_RETRY, schedule_to_close=PUBLISH_TIMEOUT)
_GPU_PASS = ActivityOptions("gpu", TRAIN_RETRY, start_to_close=TRAIN_TIMEOUT)

OPTIONS: dict[str, ActivityOptions] = {
    "admit_run": _CONTROL,
    "enqueue_run": ActivityOptions(
        "control", ENQUEUE_RETRY, start_to_close=ADMISSION_TIMEOUT, schedule_to_close=ENQUEUE_TIMEOUT
    ),
    "discover_environments": _INSPECT,
    "revalidate_environments": _INSPECT,
    "resolve_policy": ActivityOptions("gpu", CONTROL_RETRY, start_to_close=POLICY_TIMEOUT),
    "collect_group": ActivityOptions("gpu", GROUP_RETRY, start_to_close=GROUP_TIMEOUT, heartbeat=True),
    "train_adapter": ActivityOptions("gpu", TRAIN_RETRY, start_to_close=TRAIN_TIMEOUT, heartbeat=True),
    "post_evaluate": _GPU_PASS,
    "world_model_gain": _GPU_PASS,
    "index_groups": _STORE,
    "store_iteration": _STORE,
    "store_side_bundle": _STORE,
    "evaluate_run": _STORE,
    "split_dataset": _STORE,
    "publish_training": _STORE,
    # A cancel before the manifest is written stops publication (nothing visible); a cancel that
    # arrives after the commit point lets the run finish completed.
    "publish_run": ActivityOptions(
        "control",
        PUBLISH_RETRY,
        schedule_to_close=PUBLISH_TIMEOUT,
        heartbeat=True,
        cancellation=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
    ),
}


class ActivityCaller:
    """Calls activities of one run with the table's options on that run's queues."""

    def __init__(self, *, control_queue: str, gpu_queue: str = "", heartbeat: timedelta = GROUP_HEARTBEAT) -> None:
        self.queues = {"control": control_queue, "gpu": gpu_queue}
        self.heartbeat = heartbeat

    async def __call__(self, method: Any, arg: Any, *, summary: str, **extra: Any) -> Any:
        opts = OPTIONS[method.__name__]
        return await workflow.execute_activity_method(
            method,
            arg,
            task_queue=self.queues[opts.queue],
            start_to_close_timeout=opts.start_to_close,
            schedule_to_close_timeout=opts.schedule_to_close,
            heartbeat_timeout=self.heartbeat if opts.heartbeat else None,
            retry_policy=opts.retry,
            cancellation_type=opts.cancellation,
            summary=summary,
            **extra,
        )
