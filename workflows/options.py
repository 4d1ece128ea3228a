"""The one options table of every activity a workflow calls, and the one way to call one.

Per activity: the task queue (control or gpu), timeouts, retry policy, whether it heartbeats and
how a cancel reaches it. The table is keyed by the activity method itself, and workflows call
``ActivityCaller(...)(Activities.method, arg, summary=…)`` with that method (never a name string):
the call's argument and result are the method's own types, checked by mypy.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Awaitable, Callable, Literal, TypeVar, overload

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from activities.control import ControlActivities
    from activities.gpu import GpuActivities
from workflows.names import TRAIN_QUEUE_PATCH, train_task_queue
from workflows.names import WORKFLOW_NAME  # noqa: F401  (kept importable here for callers)

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

# Start-to-close: how long one attempt may run. Schedule-to-close: how long all attempts together
# may take; every entry leaves room for at least its retry policy's attempts (see
# ``retry_budget_ok``), so a dead worker's attempt is always retried, never the last word.
ADMISSION_TIMEOUT = timedelta(seconds=15)
ADMISSION_BUDGET = timedelta(minutes=1)
ENQUEUE_TIMEOUT = timedelta(minutes=10)
DISCOVERY_TIMEOUT = timedelta(minutes=3)
DISCOVERY_BUDGET = timedelta(minutes=12)
POLICY_TIMEOUT = timedelta(minutes=5)
POLICY_BUDGET = timedelta(minutes=20)
GROUP_TIMEOUT = timedelta(hours=2)
GROUP_BUDGET = timedelta(hours=11)
GROUP_HEARTBEAT = timedelta(seconds=30)
TRAIN_TIMEOUT = timedelta(hours=12)
TRAIN_BUDGET = timedelta(hours=37)
EVAL_PASS_TIMEOUT = timedelta(hours=2)
EVAL_PASS_BUDGET = timedelta(hours=7)
STORE_TIMEOUT = timedelta(minutes=10)
PUBLISH_TIMEOUT = timedelta(minutes=45)


@dataclass(frozen=True)
class ActivityOptions:
    """One activity's options. With ``heartbeat`` the run's heartbeat timeout applies (the
    ``KILN_HEARTBEAT_TIMEOUT_S`` setting, 30 s by default): a killed worker is noticed after it."""

    queue: Literal["control", "gpu", "train"]  # train: the trainers' queue beside the run's gpu queue
    retry: RetryPolicy
    start_to_close: timedelta
    schedule_to_close: timedelta
    heartbeat: bool = False
    cancellation: ActivityCancellationType = ActivityCancellationType.TRY_CANCEL

    def recovery_bound(self, heartbeat: timedelta = GROUP_HEARTBEAT) -> timedelta:
        """The longest a killed worker's attempt of this activity stays unnoticed, plus the wait
        before the next attempt is scheduled: the heartbeat timeout for an activity that
        heartbeats, else its start-to-close; then the retry policy's first interval."""
        noticed = heartbeat if self.heartbeat else self.start_to_close
        return noticed + (self.retry.initial_interval or timedelta(seconds=1))

    def retry_budget_ok(self) -> bool:
        """Schedule-to-close leaves room for more than one whole attempt, and for every attempt
        (with its backoff) when the policy bounds them."""
        attempts = self.retry.maximum_attempts
        if attempts <= 0:
            return self.schedule_to_close >= 3 * self.start_to_close
        backoff = timedelta(0)
        interval = self.retry.initial_interval or timedelta(seconds=1)
        cap = self.retry.maximum_interval or 100 * interval
        for _ in range(attempts - 1):
            backoff += interval
            interval = min(cap, interval * self.retry.backoff_coefficient)
        return self.schedule_to_close > self.start_to_close * attempts + backoff


_CONTROL = ActivityOptions("control", CONTROL_RETRY, ADMISSION_TIMEOUT, ADMISSION_BUDGET)
# Discovery and revalidation heartbeat while their requests run: a killed control worker is
# noticed after the heartbeat timeout, not DISCOVERY_TIMEOUT.
_INSPECT = ActivityOptions("control", CONTROL_RETRY, DISCOVERY_TIMEOUT, DISCOVERY_BUDGET, heartbeat=True)
# Storage steps are short, but they heartbeat while their S3 writes run, and retry (S3 restarts
# included) until PUBLISH_TIMEOUT.
_STORE = ActivityOptions("control", PUBLISH_RETRY, STORE_TIMEOUT, PUBLISH_TIMEOUT, heartbeat=True)
# Evaluation passes on the gpu worker run the model for a while: they heartbeat.
_GPU_PASS = ActivityOptions("gpu", TRAIN_RETRY, EVAL_PASS_TIMEOUT, EVAL_PASS_BUDGET, heartbeat=True)

OPTIONS: dict[Callable[..., Any], ActivityOptions] = {
    ControlActivities.admit_run: _CONTROL,
    ControlActivities.enqueue_run: ActivityOptions("control", ENQUEUE_RETRY, ADMISSION_TIMEOUT, ENQUEUE_TIMEOUT),
    ControlActivities.discover_environments: _INSPECT,
    ControlActivities.revalidate_environments: _INSPECT,
    GpuActivities.resolve_policy: ActivityOptions("gpu", CONTROL_RETRY, POLICY_TIMEOUT, POLICY_BUDGET, heartbeat=True),
    GpuActivities.collect_group: ActivityOptions("gpu", GROUP_RETRY, GROUP_TIMEOUT, GROUP_BUDGET, heartbeat=True),
    GpuActivities.train_adapter: ActivityOptions("train", TRAIN_RETRY, TRAIN_TIMEOUT, TRAIN_BUDGET, heartbeat=True),
    GpuActivities.post_evaluate: _GPU_PASS,
    GpuActivities.world_model_gain: _GPU_PASS,
    ControlActivities.index_groups: _STORE,
    ControlActivities.store_iteration: _STORE,
    ControlActivities.store_side_bundle: _STORE,
    ControlActivities.evaluate_run: _STORE,
    ControlActivities.split_dataset: _STORE,
    ControlActivities.publish_training: _STORE,
    # A cancel before the manifest is written stops publication (nothing visible); a cancel that
    # arrives after the commit point lets the run finish completed.
    ControlActivities.publish_run: ActivityOptions(
        "control",
        PUBLISH_RETRY,
        STORE_TIMEOUT,
        PUBLISH_TIMEOUT,
        heartbeat=True,
        cancellation=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
    ),
}


ArgT = TypeVar("ArgT")
ResultT = TypeVar("ResultT")


class ActivityCaller:
    """Calls activities of one run with the table's options on that run's queues."""

    def __init__(
        self,
        *,
        control_queue: str,
        gpu_queue: str = "",
        heartbeat: timedelta = GROUP_HEARTBEAT,
        on_retry: Callable[[str, int], None] | None = None,
    ) -> None:
        """``on_retry(activity, attempt)`` hears of every result an attempt > 1 produced."""
        self.queues = {"control": control_queue, "gpu": gpu_queue}
        self.heartbeat = heartbeat
        self.on_retry = on_retry

    def queue_of(self, kind: str) -> str:
        """The task queue of an activity kind: training goes to the trainers' queue beside the gpu
        queue (``train_task_queue``) in runs that reach it after the patch, to the gpu queue in
        runs recorded before it (their histories replay unchanged)."""
        if kind != "train":
            return self.queues[kind]
        gpu = self.queues["gpu"]
        return train_task_queue(gpu) if workflow.patched(TRAIN_QUEUE_PATCH) else gpu

    @overload
    async def __call__(
        self, method: Callable[[Any, ArgT], Awaitable[ResultT]], arg: ArgT, *, summary: str, **extra: Any
    ) -> ResultT: ...

    @overload
    async def __call__(
        self, method: Callable[[Any, ArgT], ResultT], arg: ArgT, *, summary: str, **extra: Any
    ) -> ResultT: ...

    async def __call__(self, method: Callable[[Any, Any], Any], arg: Any, *, summary: str, **extra: Any) -> Any:
        """Run ``method`` (an async or a threaded activity) with its table options; its result."""
        opts = OPTIONS[method]
        result = await workflow.execute_activity_method(
            method,
            arg,
            task_queue=self.queue_of(opts.queue),
            start_to_close_timeout=opts.start_to_close,
            schedule_to_close_timeout=opts.schedule_to_close,
            heartbeat_timeout=self.heartbeat if opts.heartbeat else None,
            retry_policy=opts.retry,
            cancellation_type=opts.cancellation,
            summary=summary,
            **extra,
        )
        attempt = getattr(result, "attempt", 1)
        if self.on_retry is not None and attempt > 1:
            self.on_retry(method.__name__, attempt)
        return result
