"""Run submission, status, listing and cancellation over Temporal: where the API meets workflows.

Run ids: a request with an ``idempotency_key`` maps to a deterministic UUID (uuid5 of the key), so
concurrent identical submissions converge on one workflow id; Temporal itself guarantees that only
one start wins (``id_conflict_policy=FAIL``, ``id_reuse_policy=REJECT_DUPLICATE``: the key stays
bound while the run is retained). The canonical request digest is stored in the workflow memo at
start, so every later submission with the key is compared against exactly what was started:
equal → the existing run (200), different → ``openenv_run_idempotency_conflict`` (409).
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.service import RPCError, RPCStatusCode

from kiln.core.contracts import RunRequest
from kiln.core.request_digest import request_digest
from kiln.core.errors import IdempotencyConflict, InvalidRequest, RunNotCancellable, RunNotFound, RunTerminated
from kiln.core.run_labels import start_details, start_summary
from kiln.core.run_status import DATASET_STAGES, RUN_STAGES, Failure, RunStatus
from kiln.core.run_view import (
    InFlightActivity,
    RunList,
    RunSummary,
    RunView,
    Termination,
    TrainingProgress,
    placeholder_failure,
)
from kiln.core.settings import Settings
from kiln.core.telemetry.live import read_progress
from workflows.names import (
    KILN_ENVIRONMENT,
    KILN_OUTPUT_ADAPTER,
    KILN_PHASE,
    KILN_RUN_KIND,
    TRAIN_DATASET_WORKFLOW,
    WORKFLOW_NAME,
)

RUN_WORKFLOW_TYPES = (WORKFLOW_NAME, TRAIN_DATASET_WORKFLOW)
# The visibility query of every run (of either kind).
RUNS_QUERY = "(" + " OR ".join(f"WorkflowType = '{name}'" for name in RUN_WORKFLOW_TYPES) + ")"

__all__ = ["RunService", "checked_run_id", "run_id_for", "IdempotencyConflict", "RunNotCancellable", "RUN_STATES"]

# A run no worker took has only its start, first workflow task and signals or cancel requests.
UNCLAIMED_HISTORY_MAX = 12
# Temporal's own bound on a workflow id; "/" never reaches a route's {run_id}, "." and ".." are no ids.
MAX_RUN_ID_CHARS = 1000


def checked_run_id(run_id: str) -> str:
    """``run_id`` when it can name a workflow; ``RunNotFound`` otherwise (empty, too long, control
    characters, a path step)."""
    if (
        not run_id
        or len(run_id) > MAX_RUN_ID_CHARS
        or run_id in (".", "..")
        or any(ord(ch) < 32 or ord(ch) == 127 or ch in "/\\" for ch in run_id)
    ):
        raise RunNotFound(f"no run with id {run_id!r}")
    return run_id


_KEY_NAMESPACE = uuid.UUID("6f1c1f1e-8d2a-4c55-9a57-4b9a3c1d2e10")
QUERY_TIMEOUT = timedelta(seconds=5)
TERMINAL_STATES = frozenset({"completed", "failed", "cancelled", "terminated"})

_STATE_OF = {
    WorkflowExecutionStatus.RUNNING: "running",
    WorkflowExecutionStatus.COMPLETED: "completed",
    WorkflowExecutionStatus.FAILED: "failed",
    WorkflowExecutionStatus.CANCELED: "cancelled",
    WorkflowExecutionStatus.TERMINATED: "terminated",
    WorkflowExecutionStatus.TIMED_OUT: "failed",
    WorkflowExecutionStatus.CONTINUED_AS_NEW: "running",
}
# The Temporal visibility filter of each run state.
RUN_STATES: dict[str, str] = {
    "running": "ExecutionStatus = 'Running'",
    "completed": "ExecutionStatus = 'Completed'",
    "failed": "(ExecutionStatus = 'Failed' OR ExecutionStatus = 'TimedOut')",
    "cancelled": "ExecutionStatus = 'Canceled'",
    "terminated": "ExecutionStatus = 'Terminated'",
}


def run_id_for(request: RunRequest) -> str:
    """uuid5 of the idempotency key (stable across retries), else a fresh uuid4."""
    return run_id_for_key(request.idempotency_key)


def run_id_for_key(key: str | None, scope: str = "") -> str:
    """uuid5 of ``scope + key`` (``scope`` keeps the key spaces of run kinds apart), else uuid4."""
    if key:
        return str(uuid.uuid5(_KEY_NAMESPACE, scope + key))
    return str(uuid.uuid4())


def _state(status: WorkflowExecutionStatus | None) -> str:
    return _STATE_OF.get(status, "running") if status is not None else "running"


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def _failure_record(details: dict[str, Any]) -> Failure:
    """The run's failure from its workflow failure's details (a ``Failure`` dump, or a bare
    KilnError envelope without a stage)."""
    known = {k: v for k, v in details.items() if k in Failure.model_fields}
    known.setdefault("code", "internal_error")
    known.setdefault("message", "")
    known.setdefault("stage", "orchestration")
    return Failure.model_validate(known)


def _stage_of(phase: str) -> str:
    """The stage a run's phase names; ``orchestration`` when it names none (unknown, terminal)."""
    return phase if phase in RUN_STAGES or phase in DATASET_STAGES else "orchestration"


def _termination_failure(termination: Termination) -> Failure:
    """The ``run_terminated`` record of a terminated run (what a client raises for it)."""
    error = RunTerminated(
        f"the run was terminated through Temporal by {termination.identity}: {termination.reason}",
        hint="terminating skips what Kiln's cancel does; stop a run with `kiln openenv cancel RUN_ID`",
    )
    return Failure(
        code=error.code,
        message=error.message,
        stage=termination.stage,
        hint=error.hint,
        details={"terminated_by": termination.identity, "reason": termination.reason},
    )


def _view_of(payload: dict[str, Any], source: str) -> RunView:
    """The run's view from what its workflow answered. A status written by another version of the
    workflow (a field this API does not know) keeps every field it does know, with a warning,
    rather than failing the request."""
    try:
        return RunView.model_validate({**payload, "status_source": source})
    except ValidationError:
        known = {k: v for k, v in payload.items() if k in RunStatus.model_fields or k == "schema"}
        try:
            view = RunView.model_validate({**known, "status_source": source})
        except ValidationError:
            view = RunView(run_id=str(payload.get("run_id") or ""), phase="unknown", status_source="history")
        view.warnings.append("this API could not read every field of the run's status (another Kiln version)")
        return view


_PENDING_STATES = {1: "scheduled", 2: "started", 3: "cancel_requested", 4: "paused", 5: "pause_requested"}


class RunService:
    """Thin, stateless operations on run workflows (the client is shared, the settings fixed)."""

    def __init__(self, client: Client, settings: Settings, store: Any = None) -> None:
        self.client = client
        self.settings = settings
        self.store = store  # S3: the live progress the gpu worker writes (kiln.core.telemetry.live)

    # ------------------------------------------------------------------ submit
    async def submit(self, request: RunRequest) -> tuple[RunView, bool]:
        """Start the run; returns ``(status, created)``. Same key + same body → existing run."""
        body = request.model_dump(mode="json", exclude_none=False)
        return await self.start_once(
            WORKFLOW_NAME,
            body,
            run_id=run_id_for(request),
            digest=request_digest(request),
            idempotency_key=request.idempotency_key,
            summary=start_summary(request.kind, request.environment_urls[0], request.output_adapter),
            details=start_details(body),
        )

    async def start_once(
        self,
        workflow: str,
        arg: Any,
        *,
        run_id: str,
        digest: str,
        idempotency_key: str | None,
        summary: str,
        details: str | None = None,
    ) -> tuple[RunView, bool]:
        """Start ``workflow`` as run ``run_id`` exactly once per idempotency key.

        Returns ``(status, created)``; a retry with the identical request (same ``digest``) gets
        the existing run, a different request with the same key ``openenv_run_idempotency_conflict``.
        """
        try:
            await self.client.start_workflow(
                workflow,
                arg,
                id=run_id,
                task_queue=self.settings.control_task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                memo={"request_sha256": digest, "idempotency_key": idempotency_key},
                static_summary=summary,
                static_details=details,
            )
            created = True
        except WorkflowAlreadyStartedError:
            created = False
            if idempotency_key is None or await self._memo_digest(run_id) != digest:
                raise IdempotencyConflict(
                    f"idempotency_key {idempotency_key!r} was already used with a different request",
                    hint="reuse a key only to retry the identical request; choose a new key for new work",
                ) from None
        return await self.status(run_id), created

    async def _memo_digest(self, run_id: str) -> str | None:
        description = await self.client.get_workflow_handle(run_id).describe()
        memo = await description.memo()
        return memo.get("request_sha256")

    # ------------------------------------------------------------------ status
    async def describe(self, run_id: str) -> Any:
        """The Temporal description of run ``run_id`` (any workflow id: Kiln's UUIDs or one a user
        gave ``temporal workflow start --workflow-id``); ``RunNotFound`` when it is not a run."""
        checked_run_id(run_id)
        try:
            description = await self.client.get_workflow_handle(run_id).describe()
        except RPCError as err:
            if err.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT):
                raise RunNotFound(f"no run with id {run_id}") from None
            raise
        if description.workflow_type not in RUN_WORKFLOW_TYPES:
            raise RunNotFound(f"no run with id {run_id}")
        return description

    async def unclaimed(self, description: Any) -> str | None:
        """Why a running run has not started: no worker took its first workflow task and none polls
        its task queue (a run started on the wrong queue). None when a worker has it or may."""
        if _state(description.status) != "running" or description.history_length > UNCLAIMED_HISTORY_MAX:
            return None  # a history this long has workflow tasks a worker took
        async for event in self.client.get_workflow_handle(description.id).fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                return None
        queue = description.task_queue
        answer = await self.client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=self.client.namespace,
                task_queue=TaskQueue(name=queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            )
        )
        return None if answer.pollers else f"no worker polls task queue {queue} for this run"

    async def status(self, run_id: str) -> RunView:
        """The workflow's ``status`` query, completed with what Temporal knows about the run."""
        description = await self.describe(run_id)
        state = _state(description.status)
        unclaimed = await self.unclaimed(description)
        if unclaimed is not None:  # nothing would answer the query: say why, without waiting for it
            view = RunView(run_id=run_id, phase="unknown", status_source="history", unclaimed=unclaimed)
        else:
            view = await self._workflow_status(run_id, state)
        view.state = state  # type: ignore[assignment]  # one of RunState's literals (_STATE_OF)
        if state == "terminated":  # the workflow recorded no ending: Temporal's history says who and why
            view.termination = await self._termination(run_id, _stage_of(view.phase))
            view.failure = _termination_failure(view.termination)
        if state in TERMINAL_STATES:
            view.phase = state
        view.run_id = run_id
        if view.request_sha256 is None:
            view.request_sha256 = (await description.memo()).get("request_sha256")
        view.started_at = _iso(description.start_time)
        view.closed_at = _iso(description.close_time)
        view.temporal_ui = self.settings.run_ui_link(run_id)
        if state == "running":
            view.in_flight = await self._in_flight(description)
            training = next((a for a in view.in_flight if a.activity == "train_adapter"), None)
            if training is not None and training.details:
                view.training_progress = TrainingProgress.model_validate(training.details)
            await self._merge_live(run_id, view)
        return view

    async def _termination(self, run_id: str, stage: str) -> Termination:
        """Who terminated run ``run_id`` and why, from the last event of its history (read newest
        first: one event); ``stage`` is where the run was."""
        from temporalio.api.common.v1 import WorkflowExecution
        from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest

        who, why = "an unknown identity", "no reason given"
        try:
            page = await self.client.workflow_service.get_workflow_execution_history_reverse(
                GetWorkflowExecutionHistoryReverseRequest(
                    namespace=self.client.namespace,
                    execution=WorkflowExecution(workflow_id=run_id),
                    maximum_page_size=1,
                )
            )
            for event in page.history.events:
                if event.HasField("workflow_execution_terminated_event_attributes"):
                    attributes = event.workflow_execution_terminated_event_attributes
                    who, why = attributes.identity or who, attributes.reason or why
        except RPCError:
            pass
        return Termination(identity=who, reason=why, stage=stage)

    async def _merge_live(self, run_id: str, view: RunView) -> None:
        """The latest training step the gpu worker wrote to S3 (fresher than heartbeats)."""
        if self.store is None:
            return
        try:
            live = await asyncio.to_thread(read_progress, self.store, run_id)
        except Exception:  # noqa: BLE001 - live figures are best effort, never fatal
            return
        if not live:
            return
        view.live_training = live
        current = view.training_progress or TrainingProgress()
        if view.phase == "training" and int(current.step or 0) <= int(live.get("step") or 0):
            merged = {**current.model_dump(exclude_none=True), **{k: v for k, v in live.items() if k != "kind"}}
            view.training_progress = TrainingProgress.model_validate(merged)

    async def _in_flight(self, description: Any) -> list[InFlightActivity]:
        """Pending activities with their latest heartbeat details (training step, group turn)."""
        out: list[InFlightActivity] = []
        for pending in description.raw_description.pending_activities:
            details: Any = None
            if pending.heartbeat_details.payloads:
                try:
                    decoded = await self.client.data_converter.decode(pending.heartbeat_details.payloads)
                    details = decoded[-1] if decoded else None
                except Exception:  # noqa: BLE001 - progress is best effort, never fatal
                    details = None
            out.append(
                InFlightActivity(
                    activity=pending.activity_type.name,
                    attempt=pending.attempt,
                    state=_PENDING_STATES.get(pending.state, "unknown"),
                    details=details if isinstance(details, dict) else None,
                    last_failure=pending.last_failure.message or None if pending.HasField("last_failure") else None,
                )
            )
        return out

    async def _workflow_status(self, run_id: str, state: str) -> RunView:
        """Completed runs: the workflow result (no worker needed). Others: the live query, or
        what the closed history says when no worker answers within ``QUERY_TIMEOUT``
        (``status_source="history"``: phase ``unknown`` while the run still runs)."""
        handle = self.client.get_workflow_handle(run_id)
        if state == "completed":
            result = await handle.result()
            if isinstance(result, dict):
                return _view_of(result, "result")
        try:
            answered = await handle.query("status", rpc_timeout=QUERY_TIMEOUT)
        except Exception:  # noqa: BLE001 - no worker to answer: fall back to history
            answered = None
        if isinstance(answered, dict):
            return _view_of(answered, "query")
        view = RunView(run_id=run_id, phase="unknown", status_source="history")
        if state == "failed":
            try:
                await handle.result()
            except WorkflowFailureError as err:
                cause = err.cause
                if isinstance(cause, ApplicationError) and cause.details and isinstance(cause.details[0], dict):
                    view.failure = _failure_record(cause.details[0])
                else:
                    view.failure = placeholder_failure("internal_error", str(cause or err))
            except Exception:  # noqa: BLE001 - the failure record is best effort: the state stands without it
                pass
        return view

    # ------------------------------------------------------------------ list
    async def list_runs(self, state: str | None = None, limit: int = 200) -> RunList:
        """Runs newest first, optionally only those in ``state`` (running|completed|failed|cancelled|terminated)."""
        query = RUNS_QUERY
        if state is not None:
            if state not in RUN_STATES:
                raise InvalidRequest(f"unknown run state {state!r}: use one of {', '.join(RUN_STATES)}")
            query += f" AND {RUN_STATES[state]}"
        runs: list[RunSummary] = []
        async for execution in self.client.list_workflows(query, limit=limit):
            attrs = execution.typed_search_attributes
            run_state = _state(execution.status)
            memo = await execution.memo()
            runs.append(
                RunSummary(
                    run_id=execution.id,
                    state=run_state,  # type: ignore[arg-type]  # one of RunState's literals (_STATE_OF)
                    phase=run_state if run_state in TERMINAL_STATES else attrs.get(KILN_PHASE),
                    kind=attrs.get(KILN_RUN_KIND),
                    environment=attrs.get(KILN_ENVIRONMENT),
                    output_adapter=attrs.get(KILN_OUTPUT_ADAPTER),
                    mean_return=memo.get("mean_return"),  # the outcome memo, set at the end
                    promoted=memo.get("promoted"),
                    evaluated=memo.get("evaluated"),
                    failure_code="run_terminated" if run_state == "terminated" else memo.get("failure_code"),
                    started_at=_iso(execution.start_time),
                    closed_at=_iso(execution.close_time),
                )
            )
        runs.sort(key=lambda r: r.started_at or "", reverse=True)
        return RunList(runs=runs)

    # ------------------------------------------------------------------ cancel
    async def cancel(self, run_id: str) -> RunView:
        """Request cancellation of a running run; terminal runs → ``openenv_run_not_cancellable``."""
        description = await self.describe(run_id)
        state = _state(description.status)
        if state != "running":
            raise RunNotCancellable(
                f"run {run_id} is already {state}",
                hint="only a running run can be cancelled",
                details={"state": state},
            )
        try:
            await self.client.get_workflow_handle(run_id).cancel()
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            raise RunNotCancellable(f"run {run_id} ended before it could be cancelled") from None
        view = await self.status(run_id)
        view.cancel_requested = True
        return view
