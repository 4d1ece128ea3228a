"""Opening an OpenEnv session and resetting it, retrying fresh sessions on ``CAPACITY_REACHED``.

Owns: the bounded capacity wait of one session open (backoff ``min(250 ms × refusals, 2 s)``,
cancellation checked every 100 ms), the count of refusals met, and ``EnvironmentCapacityExhausted``
once the wait is spent. Waves of sessions are planned above this (``kiln.core.rollout.sessions``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from kiln.core.errors import EnvironmentCapacityExhausted, EnvironmentUnavailable, RunCancelled
from kiln.core.openenv.replies import CAPACITY_REACHED, StepResult
from kiln.core.openenv.session import DEFAULT_MAX_FRAME_BYTES, EnvSession
from kiln.core.openenv.urls import EnvironmentUrl, coerce_url


def capacity_backoff_s(retries: int, remaining_s: float) -> float:
    """``min(250 ms × retries, 2 s, remaining)``."""
    return max(0.0, min(0.25 * retries, 2.0, remaining_s))


async def _sleep_with_cancel(
    seconds: float, should_cancel: Callable[[], bool] | None, tick: Callable[[], None] | None = None
) -> None:
    deadline = time.monotonic() + seconds
    while True:
        if should_cancel is not None and should_cancel():
            raise RunCancelled("cancelled while waiting for environment capacity")
        if tick is not None:
            tick()
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(left, 0.1))


async def open_session_and_reset(
    url: EnvironmentUrl,
    payload: dict,
    *,
    capacity_wait_s: float,
    bearer_token: str | None = None,
    request_timeout_s: float = 60.0,
    should_cancel: Callable[[], bool] | None = None,
    connect_timeout_s: float = 10.0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    on_wait: Callable[[int], None] | None = None,
    on_open: Callable[[EnvSession], None] | None = None,
    on_refused: Callable[[dict | None], None] | None = None,
) -> tuple[EnvSession, StepResult, int]:
    """Connect and reset, retrying fresh sessions on ``CAPACITY_REACHED``.

    Returns ``(session, reset_result, refusals)`` (the ``CAPACITY_REACHED`` refusals met). Raises
    ``EnvironmentCapacityExhausted`` once ``capacity_wait_s`` has elapsed, ``RunCancelled`` when
    ``should_cancel()`` turns true, or the session's own errors. ``on_wait(retries)`` is called
    after every refusal (callers heartbeat there: a long wait for capacity is not a hang).
    ``on_open(session)`` runs the moment a socket opens (callers register it for cleanup, so a
    cancel at any later point still closes it); ``on_refused(error)`` after each refusal with the
    ``CAPACITY_REACHED`` data (None when the socket closed before any frame).
    ``capacity_wait_s=0`` makes exactly one attempt.
    """
    start = time.monotonic()
    retries = 0
    while True:
        if should_cancel is not None and should_cancel():
            raise RunCancelled("cancelled before opening an environment session")
        session = await EnvSession.open(
            url,
            bearer_token=bearer_token,
            request_timeout_s=request_timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_frame_bytes=max_frame_bytes,
        )
        if on_open is not None:
            on_open(session)
        try:
            result = await session.reset(payload)
        except EnvironmentUnavailable as err:
            await session.close()
            # A server at capacity sends CAPACITY_REACHED and closes (1000) right after the
            # handshake; the frame can be lost in that race. A session closed before it ever
            # answered its first reset is therefore retried like a refusal (same bounded wait).
            if (err.details or {}).get("reason") != "closed":
                raise
            result = None
        except BaseException:
            await session.close()
            raise
        if result is not None and result.code != CAPACITY_REACHED:
            return session, result, retries
        await session.close()
        retries += 1
        if on_refused is not None:
            on_refused(result.error if result is not None else None)
        if on_wait is not None:
            on_wait(retries)
        elapsed = time.monotonic() - start
        if elapsed >= capacity_wait_s:
            error = result.error if result is not None else None
            active = error.get("active_sessions") if error else None
            maximum = error.get("max_sessions") if error else None
            raise EnvironmentCapacityExhausted(
                f"{coerce_url(url).websocket_url}: still at capacity after {elapsed:.1f}s and {retries} retries",
                details={
                    "protocol_code": CAPACITY_REACHED,
                    "refusals": retries,
                    "active_sessions": active if isinstance(active, int) else None,
                    "max_sessions": maximum if isinstance(maximum, int) else None,
                },
            )
        await _sleep_with_cancel(
            capacity_backoff_s(retries, capacity_wait_s - elapsed),
            should_cancel,
            on_wait and (lambda n=retries: on_wait(n)),
        )
