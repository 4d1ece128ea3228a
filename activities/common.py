"""What every activity shares: KilnError → ApplicationError, and blocking work that commits."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from typing import Any, Callable, TypeVar

from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from kiln.core.errors import KilnError
from kiln.core.records import ActivityResult
from kiln.core.telemetry.prometheus import count_error

F = TypeVar("F", bound=Callable[..., Any])

# Expected waits (``KilnError.expected``: an environment at capacity) are logged here, one INFO
# line each; the workers show this logger at INFO (workers/__main__.py).
EXPECTED_LOG = logging.getLogger("kiln.expected")


def to_application_error(error: KilnError) -> ApplicationError:
    """The Temporal failure for a KilnError: ``type`` is the stable code; details carry the dict.
    An expected wait is benign (the SDK then logs it at DEBUG, never as a failure with a traceback)."""
    return ApplicationError(
        error.message,
        error.to_dict(),
        type=error.code,
        non_retryable=not error.retryable,
        category=ApplicationErrorCategory.BENIGN if error.expected else ApplicationErrorCategory.UNSPECIFIED,
    )


def _surface(err: KilnError) -> ApplicationError:
    if err.expected:
        EXPECTED_LOG.info("%s: %s", err.code, err.message)
    count_error(err.code)
    return to_application_error(err)


def with_attempt(result: Any) -> Any:
    """Stamp an ``ActivityResult`` with the attempt that produced it (the workflow records a
    retry in the run's status from it)."""
    from temporalio import activity

    if isinstance(result, ActivityResult):
        result.attempt = activity.info().attempt
    return result


def kiln_errors(fn: F) -> F:
    """The wrapper every activity has: KilnErrors surface with their code (unknown errors stay
    retryable), and the result carries the attempt that produced it."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return with_attempt(await fn(*args, **kwargs))
            except KilnError as err:
                raise _surface(err) from None

        return async_wrapper  # type: ignore[return-value]  # functools.wraps keeps fn's signature

    @functools.wraps(fn)
    def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return with_attempt(fn(*args, **kwargs))
        except KilnError as err:
            raise _surface(err) from None

    return sync_wrapper  # type: ignore[return-value]  # functools.wraps keeps fn's signature


class CommitGate:
    """Decides, once, whether a blocking publication may commit or was abandoned by a cancel.

    The worker thread calls :meth:`may_commit` right before its commit point (the manifest put);
    the activity calls :meth:`abandon` when cancelled. Whichever comes first wins, under one lock,
    so a cancelled activity never reports "cancelled" while its thread goes on to commit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "open"

    def may_commit(self) -> bool:
        return self._decide("committing")

    def abandon(self) -> bool:
        return self._decide("abandoned")

    def _decide(self, state: str) -> bool:
        """Take decision ``state`` unless the other one was taken first (taking it again holds)."""
        with self._lock:
            if self._state not in ("open", state):
                return False
            self._state = state
            return True


async def run_committing_with_heartbeats(
    fn: Callable[..., Any], *args: Any, every_s: float = 1.0, **kwargs: Any
) -> Any:
    """Run blocking ``fn(*args, may_commit=gate.may_commit, **kwargs)`` in a thread, heartbeating.

    On cancellation before the commit point the activity ends cancelled at once (the thread will
    refuse to commit); after it, the commit is awaited and its result returned.
    """
    from temporalio import activity

    from kiln.core.errors import RunCancelled

    gate = CommitGate()
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args, may_commit=gate.may_commit, **kwargs))
    while not task.done():
        try:
            await asyncio.wait({task}, timeout=every_s)
        except asyncio.CancelledError:
            if gate.abandon():
                raise
            while not task.done():  # already committing: finish it, keep heartbeating
                await asyncio.wait({task}, timeout=every_s)
                activity.heartbeat()
            break
        if not task.done():
            activity.heartbeat()
    try:
        return task.result()
    except RunCancelled:
        raise asyncio.CancelledError() from None


async def heartbeating(awaitable: Any, every_s: float = 1.0) -> Any:
    """Await ``awaitable`` while heartbeating every ``every_s``: a killed worker is noticed after
    the heartbeat timeout (not the whole start-to-close), and a cancel reaches the work at once."""
    from temporalio import activity

    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            activity.heartbeat()
    finally:
        if not task.done():
            task.cancel()


def activity_methods(owner: object) -> list[Any]:
    """The bound ``@activity.defn`` methods of ``owner`` (its class's and inherited ones, each
    once): what a worker of its role registers."""
    names = dict.fromkeys(name for klass in reversed(type(owner).__mro__) for name in vars(klass))
    return [
        getattr(owner, name)
        for name in names
        if hasattr(getattr(type(owner), name, None), "__temporal_activity_definition")
    ]
