"""Waiting for environment capacity in the workflow (timers, no gpu slot held) — issue 14.

The rule lives in ``kiln.core.openenv.capacity``; this module only reads an activity failure.
"""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError

from kiln.core.openenv.capacity import (
    CAPACITY_WAIT_CODE,
    capacity_exhausted,
    capacity_wait_decision,
)


def _cause(err: BaseException) -> ApplicationError | None:
    cause: BaseException | None = err
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    return cause if isinstance(cause, ApplicationError) else None


def capacity_wait_for(err: BaseException, waited_s: float, capacity_wait_s: float, retries: int) -> float | None:
    """Seconds to sleep before the next attempt of a group refused for capacity, else None."""
    cause = _cause(err)
    return capacity_wait_decision(cause.type if cause else None, waited_s, float(capacity_wait_s), retries)


def capacity_refusals(err: BaseException) -> int:
    """Refusals one attempt refused for capacity met (its ``environment_at_capacity`` details)."""
    cause = _cause(err)
    if cause is None or cause.type != CAPACITY_WAIT_CODE:
        return 0
    payload = cause.details[0] if cause.details and isinstance(cause.details[0], dict) else {}
    refusals = (payload.get("details") or {}).get("refusals")
    return refusals if isinstance(refusals, int) and not isinstance(refusals, bool) else 0


def capacity_failure(err: BaseException, group_index: int, group_size: int, waited_s: float) -> ApplicationError | None:
    """The final ``environment_capacity_exhausted`` once the wait is over (None: not a capacity failure)."""
    cause = _cause(err)
    if cause is None or cause.type != CAPACITY_WAIT_CODE:
        return None
    payload = cause.details[0] if cause.details and isinstance(cause.details[0], dict) else {}
    observed = payload.get("details") or {}
    error = capacity_exhausted(str(observed.get("url", "")), group_index, group_size, waited_s, observed)
    return ApplicationError(error.message, error.to_dict(), type=error.code, non_retryable=True)
