"""Run submission and status over Temporal: the one place the API talks to workflows.

Run ids: a request with an ``idempotency_key`` maps to a deterministic UUID (uuid5 of the key), so
concurrent identical submissions converge on one workflow; without a key the id is a fresh uuid4.
The canonical request digest is stored in the workflow memo and compared on retries.
"""

from __future__ import annotations

import uuid
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError

from kiln.contracts import RunRequest, request_digest
from kiln.errors import KilnError, RunNotFound
from kiln.settings import Settings
from workflows.options import WORKFLOW_NAME

_KEY_NAMESPACE = uuid.UUID("6f1c1f1e-8d2a-4c55-9a57-4b9a3c1d2e10")


class IdempotencyConflict(KilnError):
    code = "openenv_run_idempotency_conflict"
    http_status = 409


class RunNotCancellable(KilnError):
    code = "openenv_run_not_cancellable"
    http_status = 409


def run_id_for(request: RunRequest) -> str:
    if request.idempotency_key:
        return str(uuid.uuid5(_KEY_NAMESPACE, request.idempotency_key))
    return str(uuid.uuid4())


_STATE_OF = {
    WorkflowExecutionStatus.RUNNING: "running",
    WorkflowExecutionStatus.COMPLETED: "completed",
    WorkflowExecutionStatus.FAILED: "failed",
    WorkflowExecutionStatus.CANCELED: "cancelled",
    WorkflowExecutionStatus.TERMINATED: "failed",
    WorkflowExecutionStatus.TIMED_OUT: "failed",
    WorkflowExecutionStatus.CONTINUED_AS_NEW: "running",
}


class RunService:
    def __init__(self, client: Client, settings: Settings) -> None:
        self.client = client
        self.settings = settings

    async def submit(self, request: RunRequest) -> tuple[dict[str, Any], bool]:
        """Start the run; returns (status, created). Same key + same body → the existing run."""
        run_id = run_id_for(request)
        digest = request_digest(request)
        body = request.model_dump(mode="json", exclude_none=False)
        try:
            await self.client.start_workflow(
                WORKFLOW_NAME,
                body,
                id=run_id,
                task_queue=self.settings.control_task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                memo={"request_sha256": digest},
                static_summary=f"{request.kind} on {request.environment_urls[0]}",
            )
            created = True
        except WorkflowAlreadyStartedError:
            created = False
            existing = await self._memo_digest(run_id)
            if existing != digest:
                raise IdempotencyConflict(
                    f"idempotency_key {request.idempotency_key!r} was already used with a different request",
                    hint="reuse a key only to retry the identical request; choose a new key for new work",
                ) from None
        return await self.status(run_id), created

    async def _memo_digest(self, run_id: str) -> str | None:
        description = await self.client.get_workflow_handle(run_id).describe()
        memo = await description.memo()
        return memo.get("request_sha256")

    async def status(self, run_id: str) -> dict[str, Any]:
        handle = self.client.get_workflow_handle(run_id)
        try:
            description = await handle.describe()
        except RPCError:
            raise RunNotFound(f"no run with id {run_id}") from None
        if description.workflow_type != WORKFLOW_NAME:
            raise RunNotFound(f"no run with id {run_id}")
        try:
            status = dict(await handle.query("status"))
        except Exception:  # no worker to answer: fall back to what the server knows
            status = {"run_id": run_id, "phase": "unknown"}
        state = _STATE_OF.get(description.status, "running") if description.status else "running"
        status["state"] = state
        if state in ("completed", "failed", "cancelled"):
            status["phase"] = state
        status["run_id"] = run_id
        status["started_at"] = description.start_time.isoformat() if description.start_time else None
        status["closed_at"] = description.close_time.isoformat() if description.close_time else None
        status["temporal_ui"] = self.settings.run_ui_link(run_id)
        return status

    async def list_runs(self, limit: int = 50) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        async for execution in self.client.list_workflows(f"WorkflowType = '{WORKFLOW_NAME}'"):
            runs.append(
                {
                    "run_id": execution.id,
                    "state": _STATE_OF.get(execution.status, "running") if execution.status else "running",
                    "started_at": execution.start_time.isoformat() if execution.start_time else None,
                    "closed_at": execution.close_time.isoformat() if execution.close_time else None,
                }
            )
            if len(runs) >= limit:
                break
        runs.sort(key=lambda r: r["started_at"] or "", reverse=True)
        return runs

    async def cancel(self, run_id: str) -> dict[str, Any]:
        status = await self.status(run_id)
        if status["state"] != "running":
            raise RunNotCancellable(f"run {run_id} is already {status['state']}")
        await self.client.get_workflow_handle(run_id).cancel()
        status["cancel_requested"] = True
        return status
