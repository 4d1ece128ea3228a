"""Opening a group's sessions in waves that fit what the environment grants (issue 12/14).

Owns: one wave's session opening — every candidate tried once, refusals deferred to a later wave
(never held waiting), and only when nothing was granted one candidate waits for capacity (on the
activity path only ``attempt_capacity_wait_s``, then ``EnvironmentAtCapacity`` so the workflow waits
with no gpu slot held) — the ``CapacityBook`` bookkeeping of every grant, refusal and release,
and registration of each socket the moment it opens (the caller closes all of them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kiln.errors import EnvironmentCapacityExhausted
from kiln.openenv.capacity import (
    CAPACITY,
    EnvironmentAtCapacity,
    capacity_exhausted,
    wave_size,
)
from kiln.openenv.session import EnvSession, open_session_and_reset
from kiln.openenv.urls import EnvironmentUrl

Opened = tuple[int, EnvSession, Any, int]  # (candidate, session, reset result, capacity retries)


class SessionPlanner:
    """Opens one group's sessions wave by wave against one environment."""

    def __init__(
        self,
        url: EnvironmentUrl,
        reset_payload: dict[str, Any],
        *,
        bearer_token: str | None,
        group_index: int,
        group_size: int,
        capacity_wait_s: float,
        attempt_capacity_wait_s: float | None,
        should_cancel: Callable[[], bool],
        heartbeat: Callable[[dict[str, Any]], None],
    ) -> None:
        self.url = url
        self.reset_payload = reset_payload
        self.bearer_token = bearer_token
        self.group_index = group_index
        self.group_size = group_size
        self.capacity_wait_s = capacity_wait_s
        self.attempt_capacity_wait_s = attempt_capacity_wait_s
        self.should_cancel = should_cancel
        self.heartbeat = heartbeat
        self.key = url.websocket_url

    def wave_size(self, concurrency: int) -> int:
        return wave_size(concurrency, self.group_size, CAPACITY.limit(self.key))

    def observed(self) -> dict[str, Any]:
        return CAPACITY.snapshot(self.key)

    async def open_wave(self, candidates: list[int], registry: list[EnvSession]) -> list[Opened]:
        """The candidates granted a session (sorted), at least one; sockets go into ``registry``."""
        attempts = await asyncio.gather(
            *(self._open_once(index, registry) for index in candidates), return_exceptions=True
        )
        failures = [
            a for a in attempts if isinstance(a, BaseException) and not isinstance(a, EnvironmentCapacityExhausted)
        ]
        if failures:
            raise failures[0]
        granted = [a for a in attempts if not isinstance(a, BaseException)]
        if not granted:  # nothing granted: wait (holding no session) for one candidate's session
            granted = [await self._open_waiting(candidates[0], registry)]
        return sorted(granted, key=lambda item: item[0])

    async def release(self, session: EnvSession) -> None:
        await session.close()
        if getattr(session, "_kiln_granted", False):
            session._kiln_granted = False  # type: ignore[attr-defined]
            CAPACITY.released(self.key)

    def _granted(self, index: int, session: EnvSession, result: Any, retries: int) -> Opened:
        session._kiln_granted = True  # type: ignore[attr-defined]
        CAPACITY.granted(self.key)
        return index, session, result, retries

    async def _open_once(self, index: int, registry: list[EnvSession]) -> Opened:
        session, result, retries = await open_session_and_reset(
            self.url,
            self.reset_payload,
            capacity_wait_s=0.0,
            bearer_token=self.bearer_token,
            should_cancel=self.should_cancel,
            on_open=registry.append,
            on_refused=lambda error: CAPACITY.refused(self.key, error),
        )
        return self._granted(index, session, result, retries)

    async def _open_waiting(self, index: int, registry: list[EnvSession]) -> Opened:
        bounded = self.attempt_capacity_wait_s is not None
        window = min(self.capacity_wait_s, self.attempt_capacity_wait_s) if bounded else self.capacity_wait_s
        if bounded and not CAPACITY.try_wait(self.key):
            raise self._at_capacity(0.0)  # another group of this environment already waits here
        started = time.monotonic()
        try:
            session, result, retries = await open_session_and_reset(
                self.url,
                self.reset_payload,
                capacity_wait_s=window,
                bearer_token=self.bearer_token,
                should_cancel=self.should_cancel,
                on_open=registry.append,
                on_refused=lambda error: CAPACITY.refused(self.key, error),
                on_wait=lambda retries: self.heartbeat(
                    {"group_index": self.group_index, "candidate_index": index, "capacity_retries": retries}
                ),
            )
        except EnvironmentCapacityExhausted:
            waited = time.monotonic() - started
            if bounded:
                raise self._at_capacity(waited) from None
            raise capacity_exhausted(
                self.key, self.group_index, self.group_size, waited, CAPACITY.snapshot(self.key)
            ) from None
        finally:
            if bounded:
                CAPACITY.end_wait(self.key)
        return self._granted(index, session, result, retries)

    def _at_capacity(self, waited_s: float) -> EnvironmentAtCapacity:
        return EnvironmentAtCapacity(
            f"group {self.group_index}: {self.key} is at capacity; "
            "the run waits for a session without holding a gpu slot",
            details={
                "url": self.key,
                "group_index": self.group_index,
                "group_size": self.group_size,
                "attempt_wait_s": round(waited_s, 3),
                **CAPACITY.snapshot(self.key),
            },
        )
