"""``OpenEnvRunWorkflow``: admission → queue → discovery → collection → revalidation → training →
evaluation → post_evaluation → publication.

One workflow per run; the workflow id is the run id. History carries only small typed records
(``kiln.core.records``); every stage's work happens in an activity, every rule (seed schedule,
evaluation plan, bundle specs, promotion) in ``kiln.core.run_plan``. The workflow only sequences them
and keeps the ``RunStatus`` its ``status`` query returns to the API, the CLI and the Web UI.

Its input is the submission as given (a JSON object): the admission activity validates it — the
one validation — so a bad request started with ``temporal workflow start`` still ends with
``openenv_invalid_request`` naming the field, before any environment is contacted.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.control import ControlActivities
    from kiln.core.contracts import RunRequest
    from kiln.core.openenv.urls import normalize_url
    from kiln.core.records import (
        AdmissionInput,
        AdmissionResult,
        DiscoveryInput,
        DiscoveryResult,
        RunCarry,
        TrainedPolicy,
    )
    from kiln.core.side_records import SlotReply, SlotRequest
    from kiln.core.run_status import (
        Admission,
        EnvironmentStatus,
        Progress,
        RunStatus,
    )
    from workflows.collection import RunContext, resolve_policy, run_policy_input
    from workflows.names import WORKFLOW_NAME
    from workflows.options import ActivityCaller
    from workflows.stages import RunStages
    from workflows.status import KILN_ENVIRONMENT, KILN_OUTPUT_ADAPTER, KILN_RUN_KIND


# KilnEnvironment holds the normalised URL (``http://localhost:8990``), not the one typed.
NORMALISED_ENVIRONMENT_PATCH = "kiln-environment-attribute-normalised-v1"


def _gpu_caller(admission: AdmissionResult, on_retry: Callable[[str, int], None]) -> ActivityCaller:
    """The run's activity caller once admitted: its control queue and its model's gpu queue."""
    return ActivityCaller(
        control_queue=workflow.info().task_queue,
        gpu_queue=admission.gpu_task_queue,
        heartbeat=timedelta(seconds=admission.heartbeat_timeout_s),
        on_retry=on_retry,
    )


@workflow.defn(name=WORKFLOW_NAME)
class OpenEnvRunWorkflow(RunStages):
    def __init__(self) -> None:
        self._status = RunStatus()
        self._refills = {}
        self._granted = False
        self._queue_id: str | None = None
        self._position: int | None = None

    @workflow.query(description="The run's status: phase, progress, returns, training, manifest, failure.")
    def status(self) -> RunStatus:
        return self._status

    @workflow.signal(description="The run queue granted this run a slot: admission may proceed.")
    def slot_granted(self) -> None:
        self._granted = True

    @workflow.signal(description="The run's 1-based position in the FIFO run queue while it waits.")
    def queue_position(self, position: int) -> None:
        # A position only ever drops, and the queue's signal may overtake its reply to enqueue_run:
        # keep the lowest one seen.
        self._position = position if self._position is None else min(self._position, position)
        if self._status.admission is not None and not self._granted:
            self._status.admission.queue_position = self._position

    @workflow.run
    async def run(self, submission: dict[str, Any], carry: RunCarry | None = None) -> RunStatus:
        """``carry`` is only given by the run itself when it continues as new (online RL)."""
        return await self._guarded(lambda: self._execute(submission, carry))

    def _retried(self, activity: str, attempt: int) -> None:
        """An activity's result came from attempt ``attempt`` > 1: an interruption in status."""
        self._status.record_retry(activity, attempt)

    async def _release(self) -> None:
        """Give the run's queue slot back (also when it never got one); never fails the run."""
        if self._queue_id is None:
            return
        queue_id, self._queue_id = self._queue_id, None
        try:
            await workflow.get_external_workflow_handle(queue_id).signal("release_slot", self._status.run_id)
        except Exception:  # noqa: BLE001 - the queue is gone: nothing holds the slot any more
            workflow.logger.warning("could not release the queue slot of %s", self._status.run_id)

    async def _admit(self, submission: dict[str, Any]) -> tuple[AdmissionResult, ActivityCaller]:
        """Validate before any environment is contacted; then wait for a FIFO slot."""
        info = workflow.info()
        call = ActivityCaller(control_queue=info.task_queue, on_retry=self._retried)
        admission: AdmissionResult = await call(
            ControlActivities.admit_run,
            AdmissionInput(run_id=self._status.run_id, submission=submission),
            summary="validate the run request",
        )
        request = admission.request
        status = self._status
        status.kind = request.kind
        status.request_sha256 = admission.request_sha256
        status.reset_plan_sha256 = admission.reset_plan_sha256
        status.warnings.extend(admission.warnings)
        status.progress = Progress.planned(request.groups, request.group_size)
        environment = request.environment_urls[0]
        if workflow.patched(NORMALISED_ENVIRONMENT_PATCH):  # admitted above: the URL parses
            environment = normalize_url(environment).base_url
        attrs = [KILN_RUN_KIND.value_set(request.kind), KILN_ENVIRONMENT.value_set(environment)]
        if request.output_adapter:
            attrs.append(KILN_OUTPUT_ADAPTER.value_set(request.output_adapter))
        workflow.upsert_search_attributes(attrs)

        self._enter("queue")
        self._queue_id = admission.queue_workflow_id
        slot: SlotReply = await call(
            ControlActivities.enqueue_run, SlotRequest(run_id=status.run_id), summary="join the FIFO run queue"
        )
        position = min(slot.position, self._position or slot.position) if slot.position else None  # 0: active
        status.admission = Admission(
            sequence=slot.sequence, queue_position=position, submitted_at=info.start_time.isoformat()
        )
        await workflow.wait_condition(lambda: self._granted)
        admitted = workflow.now()
        status.admission.queue_position = None
        status.admission.admitted_at = admitted.isoformat()
        status.admission.queue_wait_ms = int((admitted - info.start_time).total_seconds() * 1000)
        return admission, _gpu_caller(admission, self._retried)

    async def _execute(self, submission: dict[str, Any], carry: RunCarry | None) -> None:
        if carry is not None:  # continued as new: admitted, discovered, part-way through
            self._granted = True
            self._queue_id = carry.admission.queue_workflow_id
            self._status = carry.status
            ctx = RunContext(
                self._status.run_id,
                carry.admission.request,
                carry.admission,
                carry.discovery,
                _gpu_caller(carry.admission, self._retried),
                self._status,
            )
            await self._iterate(ctx, carry)
            return
        admission, call = await self._admit(submission)
        request = admission.request
        discovery = await self._discover(request, call)
        ctx = RunContext(self._status.run_id, request, admission, discovery, call, self._status)

        self._enter("collection")
        contract = request.training_contract
        start = await resolve_policy(
            ctx,
            run_policy_input(
                request,
                adapter=request.behavior_adapter(),
                expected=contract.behavior_policy if contract else None,
            ),
        )
        self._status.behavior_policy = start.behavior_policy
        ctx.thinking = start.thinking
        if request.kind == "rollout":
            groups = await self._collect(ctx, start, 1)
            self._collected = (ctx, groups, start, 1)
            await self._revalidate(ctx)
            await self._evaluate_and_publish(ctx, start, start, groups, None)
            return
        self._status.iterations_total = request.iterations
        await self._iterate(
            ctx,
            RunCarry(
                admission=admission,
                discovery=discovery,
                status=self._status,
                start=start,
                current=TrainedPolicy(policy=start),
                next_iteration=1,
            ),
        )

    async def _discover(self, request: RunRequest, call: ActivityCaller) -> DiscoveryResult:
        self._enter("discovery")
        discovery: DiscoveryResult = await call(
            ControlActivities.discover_environments,
            DiscoveryInput(
                run_id=self._status.run_id,
                environment_urls=request.environment_urls,
                credential_ids=request.credential_ids,
            ),
            summary=f"discover {len(request.environment_urls)} environment(s)",
        )
        self._status.environments = [
            EnvironmentStatus.model_validate(env.model_dump(exclude={"inspection"})) for env in discovery.environments
        ]
        return discovery
