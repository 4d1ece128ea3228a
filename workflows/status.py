"""What both run workflows share: the typed ``RunStatus`` they keep, its search attributes, and
the one mapping of an ending (completed / failed / cancelled) onto status and Temporal.

A failure becomes ``status.failure`` (``{code, message, stage, retryable, hint, details}``) and
the workflow fails with an ``ApplicationError`` whose ``type`` is the Kiln code; a cancel marks
the stage it interrupted in ``cancelled_stage``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from temporalio import workflow
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    ChildWorkflowError,
    is_cancelled_exception,
)

with workflow.unsafe.imports_passed_through():
    from kiln.core.run_status import TERMINAL_STATES, Failure, RunStatus
    from workflows import ui
    from workflows.names import (  # noqa: F401 - re-exported: the run workflows set these
        KILN_ENVIRONMENT,
        KILN_OUTPUT_ADAPTER,
        KILN_PHASE,
        KILN_RUN_KIND,
        KILN_STATUS,
    )


def failure_from(err: BaseException, stage: str) -> Failure:
    """The run's failure record from an activity/application failure raised in ``stage``."""
    cause: BaseException | None = err
    while isinstance(cause, (ActivityError, ChildWorkflowError)) and cause.cause is not None:
        cause = cause.cause
    if isinstance(cause, ApplicationError):
        details = cause.details[0] if cause.details and isinstance(cause.details[0], dict) else {}
        if not details.get("code"):
            # Not a KilnError (those always carry their dict): an unexpected Python exception whose
            # ``type`` is its class name. Its code is ``internal_error``; the name stays in the message.
            return Failure(code="internal_error", message=f"{cause.type or 'error'}: {cause.message}", stage=stage)
        return Failure(
            code=details["code"],
            message=details.get("message") or cause.message,
            stage=details.get("stage") or stage,
            retryable=bool(details.get("retryable", False)),
            hint=details.get("hint"),
            details=details.get("details"),
        )
    if isinstance(cause, CancelledError):
        return Failure(code="cancelled", message=str(cause), stage=stage)
    return Failure(code="internal_error", message=str(cause or err), stage=stage)


class StatusKeeper:
    """Base of the run workflows: keeps ``self._status`` and maps how the run ends."""

    _status: RunStatus

    def _enter(self, stage: str) -> None:
        self._status.enter(stage)
        workflow.upsert_search_attributes([KILN_PHASE.value_set(stage)])
        ui.show_progress(self._status)

    def _sync_state(self) -> None:
        workflow.upsert_search_attributes(
            [KILN_STATUS.value_set(self._status.state), KILN_PHASE.value_set(self._status.phase)]
        )
        if self._status.state in TERMINAL_STATES:
            ui.record_outcome(self._status)

    async def _release(self) -> None:
        """Give back what the run holds outside itself (a queue slot); never fails the run."""

    async def _keep_evidence(self, failure: Failure) -> None:
        """Before a run fails: store what it already collected (runs that collect override it)."""

    async def _guarded(self, body: Callable[[], Awaitable[None]]) -> RunStatus:
        """Run ``body``; map its ending onto status, search attributes and the workflow result."""
        self._status.run_id = workflow.info().workflow_id
        self._sync_state()
        try:
            await body()
        except asyncio.CancelledError:
            await self._cancelled()
            raise
        except (ActivityError, ApplicationError, ChildWorkflowError) as err:
            if is_cancelled_exception(err):  # an activity cancelled because the run was
                await self._cancelled()
                raise
            await self._release()
            failure = failure_from(err, self._status.stage())
            await self._keep_evidence(failure)
            self._status.fail(failure)
            self._sync_state()
            details: dict[str, Any] = failure.model_dump()
            raise ApplicationError(
                f"{failure.code}: {failure.message}", details, type=failure.code, non_retryable=True
            ) from None
        await self._release()
        self._sync_state()
        return self._status

    async def _cancelled(self) -> None:
        await self._release()
        self._status.cancel()
        self._sync_state()
