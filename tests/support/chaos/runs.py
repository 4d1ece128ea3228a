"""Driving runs through Temporal: start, poll ``status``, decode pending activities' heartbeat
details, wait for results, and :class:`RunOutcome` (a completed run's digests to compare)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from tests.support.chaos.assertions import _text_diff, read_uri, verify_published
from tests.support.chaos.stack import ChaosStack


async def connect(stack: ChaosStack) -> Any:
    from temporalio.client import Client
    from temporalio.contrib.pydantic import pydantic_data_converter

    return await Client.connect(stack.temporal_address, data_converter=pydantic_data_converter)


async def start_run(
    client: Any, stack: ChaosStack, request: dict[str, Any], run_id: str | None = None, *, workflow: str | None = None
) -> Any:
    """Start ``request`` as a run of ``workflow`` (the OpenEnv run workflow by default)."""
    from workflows.names import WORKFLOW_NAME

    run_id = run_id or f"chaos-{uuid.uuid4().hex[:12]}"
    return await client.start_workflow(workflow or WORKFLOW_NAME, request, id=run_id, task_queue=stack.control_queue)


async def query_status(handle: Any) -> dict[str, Any] | None:
    """The run's ``status`` query, or None while Temporal (or the workflow's worker) does not answer."""
    try:
        return await asyncio.wait_for(handle.query("status"), timeout=5)
    except Exception:  # noqa: BLE001 - server restarting, worker busy: "not now"
        return None


async def wait_status(
    handle: Any, predicate: Callable[[dict[str, Any]], bool], *, timeout_s: float, what: str,
    interval_s: float = 0.05,
) -> dict[str, Any]:
    """Poll ``status`` until ``predicate`` holds; fail naming ``what`` and the last status seen."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        status = await query_status(handle)
        if status is not None:
            last = status
            if predicate(status):
                return status
            if status.get("state") in ("completed", "failed", "cancelled") and not predicate(status):
                raise AssertionError(f"run ended ({status.get('state')}) before {what}: {_brief(status)}")
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last status: {_brief(last)}")


async def wait_until_async(check: Callable[[], Any], *, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll a sync or async ``check`` until it returns a truthy value (returned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


def _brief(status: dict[str, Any] | None) -> str:
    if status is None:
        return "None"
    keys = ("state", "phase", "progress", "failure", "interruptions", "admission", "cancelled_stage")
    return json.dumps({k: status.get(k) for k in keys}, default=str)


async def pending_activities(client: Any, handle: Any) -> list[dict[str, Any]]:
    """The run's pending activities with decoded heartbeat details ([] while unreachable)."""
    from temporalio.api.enums.v1 import PendingActivityState

    try:
        described = await asyncio.wait_for(handle.describe(), timeout=5)
    except Exception:  # noqa: BLE001
        return []
    out = []
    for pending in described.raw_description.pending_activities:
        details: list[Any] = []
        if pending.HasField("heartbeat_details") and pending.heartbeat_details.payloads:
            details = await client.data_converter.decode(pending.heartbeat_details.payloads)
        out.append(
            {
                "type": pending.activity_type.name,
                "state": PendingActivityState.Name(pending.state).removeprefix("PENDING_ACTIVITY_STATE_"),
                "attempt": pending.attempt,
                "details": details,
                "worker": pending.last_worker_identity,
            }
        )
    return out


async def wait_activity(
    client: Any, handle: Any, predicate: Callable[[dict[str, Any]], bool], *, timeout_s: float, what: str,
) -> dict[str, Any]:
    """Poll the run's pending activities until one satisfies ``predicate`` (returned).

    Fails at once when the run has closed first (the fault would have landed too late).
    """
    from temporalio.client import WorkflowExecutionStatus

    deadline = time.monotonic() + timeout_s
    while True:
        for act in await pending_activities(client, handle):
            if predicate(act):
                return act
        try:
            described = await asyncio.wait_for(handle.describe(), timeout=5)
            if described.status != WorkflowExecutionStatus.RUNNING:
                raise AssertionError(f"run {handle.id} closed ({described.status.name}) before {what}")
        except AssertionError:
            raise
        except Exception:  # noqa: BLE001 - server unreachable right now
            pass
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def last_details(act: dict[str, Any]) -> dict[str, Any]:
    """The latest heartbeat details of a pending activity (``{}`` when none)."""
    details = act.get("details") or []
    return details[-1] if details and isinstance(details[-1], dict) else {}


async def result_within(handle: Any, timeout_s: float) -> tuple[str, Any]:
    """``("completed", result)``, ``("failed", error)`` or ``("cancelled", error)`` within a bound."""
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import CancelledError

    try:
        return "completed", await asyncio.wait_for(handle.result(), timeout=timeout_s)
    except WorkflowFailureError as err:
        if isinstance(err.cause, CancelledError):
            return "cancelled", err
        return "failed", err


async def drive(
    client: Any, stack: ChaosStack, request: dict[str, Any], *, timeout_s: float = 120.0, workflow: str | None = None
) -> "RunOutcome":
    """Run ``request`` undisturbed to completion and collect what a comparison needs."""
    started = time.monotonic()
    handle = await start_run(client, stack, request, workflow=workflow)
    state, value = await result_within(handle, timeout_s)
    assert state == "completed", f"reference run {handle.id} ended {state}: {value}"
    return RunOutcome.of(stack, handle.id, value, time.monotonic() - started)


@dataclass
class RunOutcome:
    """A completed run's final status and the digests a disturbed run must reproduce."""

    run_id: str
    status: dict[str, Any]
    digests: dict[str, str]  # artifact name -> sha256, train_receipt.json excluded (timestamps)
    adapter_sha256: str | None  # train_receipt.json's adapter_sha256 (None for rollout runs)
    manifest: dict[str, Any]
    seconds: float

    @classmethod
    def of(cls, stack: ChaosStack, run_id: str, status: dict[str, Any], seconds: float) -> "RunOutcome":
        store = stack.store()
        manifest = verify_published(store, run_id, status)
        # train_receipt.json (timings) and metrics.jsonl (wall-clock figures) are not byte-reproducible.
        digests = {a["name"]: a["sha256"] for a in status["artifacts"]
                   if a["name"] not in ("train_receipt.json", "metrics.jsonl")}
        adapter = None
        receipt = next((a for a in status["artifacts"] if a["name"] == "train_receipt.json"), None)
        if receipt is not None:
            adapter = json.loads(read_uri(store, receipt["uri"]))["adapter_sha256"]
        return cls(run_id, status, digests, adapter, manifest, seconds)

    def _diff(self, other: "RunOutcome", stack: "ChaosStack", name: str) -> str:
        store = stack.store()
        return _text_diff(name, read_uri(store, _uri_of(self, name)), read_uri(store, _uri_of(other, name)))

    def receipt(self, stack: ChaosStack) -> dict[str, Any]:
        entry = next(a for a in self.status["artifacts"] if a["name"] == "train_receipt.json")
        return json.loads(read_uri(stack.store(), entry["uri"]))

    def assert_same_artifacts(self, other: "RunOutcome", stack: "ChaosStack | None" = None) -> None:
        """Every artifact byte-identical (by digest) and the same trained adapter.

        With ``stack``, a differing text artifact's first differing lines are shown.
        """
        assert set(other.digests) == set(self.digests), (sorted(other.digests), sorted(self.digests))
        differing = [name for name, digest in self.digests.items() if other.digests[name] != digest]
        if differing and stack is not None:
            raise AssertionError(
                f"artifacts differ from the reference run's: {differing}\n"
                + "\n".join(self._diff(other, stack, name) for name in differing)
            )
        assert not differing, f"artifacts differ from the reference run's: {differing}"
        assert other.adapter_sha256 == self.adapter_sha256
        for key in ("adapter_sha256", "stats", "behavior_policy", "reset_plan_sha256", "promoted"):
            assert other.manifest.get(key) == self.manifest.get(key), f"manifest {key} differs"


def _uri_of(outcome: RunOutcome, name: str) -> str:
    return next(a["uri"] for a in outcome.status["artifacts"] if a["name"] == name)
