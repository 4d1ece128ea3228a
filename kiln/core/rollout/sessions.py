"""Opening a group's sessions in waves that fit what the environment grants (issue 12/14).

Owns: one wave's session opening — all or nothing, every candidate tried once; a partly refused
wave releases what it got and either shrinks (the environment grants fewer sessions) or waits
holding nothing (on the activity path ``EnvironmentAtCapacity`` at once, so the workflow waits in a
timer with no gpu slot held) — the ``CapacityBook`` bookkeeping of every grant, refusal and
release, and registration of each socket the moment it opens (the caller closes all of them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from kiln.core.errors import EnvironmentCapacityExhausted
from kiln.core.openenv.capacity import (
    CAPACITY,
    EnvironmentAtCapacity,
    capacity_exhausted,
    group_capacity,
    wave_size,
)
from kiln.core.openenv.session import EnvSession
from kiln.core.openenv.session_open import open_session_and_reset
from kiln.core.openenv.urls import EnvironmentUrl

Opened = tuple[int, EnvSession, Any, int]  # (candidate, session, reset result, capacity retries)


@dataclass(eq=False)
class SessionPlanner:
    """Opens one group's sessions wave by wave against one environment. ``holder`` names whose
    sessions these are (the run id): the most sessions held at once is counted per holder, so one
    run's figures never include another's."""

    url: EnvironmentUrl
    reset_payload: dict[str, Any]
    _: KW_ONLY
    bearer_token: str | None = field(repr=False)  # a secret: never in a repr or a log line
    group_index: int
    group_size: int
    capacity_wait_s: float
    attempt_capacity_wait_s: float | None
    should_cancel: Callable[[], bool]
    heartbeat: Callable[[dict[str, Any]], None]
    holder: str = ""
    refusals: int = field(default=0, init=False)
    key: str = field(init=False)
    _busy_since: float | None = field(default=None, init=False)
    _busy_waits: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.key = self.url.websocket_url

    def wave_size(self, concurrency: int) -> int:
        return wave_size(concurrency, self.group_size, CAPACITY.limit(self.key))

    def observed(self, waves: int = 0) -> dict[str, Any]:
        """This group's figures for its run (``kiln.core.openenv.capacity.group_capacity``)."""
        return group_capacity(
            CAPACITY.held_max(self.key, self.holder), CAPACITY.advertised(self.key), self.refusals, waves
        )

    async def open_wave(self, candidates: list[int], registry: list[EnvSession], concurrency: int) -> list[Opened]:
        """Every candidate of the wave granted a session (sorted), or ``[]`` when the caller must
        plan again; sockets go into ``registry`` the moment they open.

        A wave is all or nothing, so which candidates share a sampling batch depends only on what
        the environment grants (its advertised ``max_sessions``), never on which sessions happened
        to be free: a retried group (after a worker died and left sessions behind) samples in the
        same batches and writes the same bytes. A partly refused wave releases what it got; if the
        environment grants fewer sessions than the wave the caller plans smaller waves, else the
        environment is busy and the group waits holding nothing (on the activity path: it ends
        with ``environment_at_capacity`` and the workflow waits in a timer).
        """
        attempts = await asyncio.gather(
            *(self._open_once(index, registry) for index in candidates), return_exceptions=True
        )
        failures = [
            a for a in attempts if isinstance(a, BaseException) and not isinstance(a, EnvironmentCapacityExhausted)
        ]
        if failures:
            raise failures[0]
        granted = [a for a in attempts if not isinstance(a, BaseException)]
        if len(granted) == len(candidates):
            return sorted(granted, key=lambda item: item[0])
        for item in granted:
            await self.release(item[1])
        if self.wave_size(concurrency) < len(candidates):
            return []  # the environment grants fewer sessions than this wave: plan smaller waves
        await self._wait_for_room()
        return []

    async def _wait_for_room(self) -> None:
        """The environment is busy (not too small): wait, holding no session, then try again."""
        if self.attempt_capacity_wait_s is not None:
            raise self._at_capacity(0.0)
        if self._busy_since is None:
            self._busy_since = time.monotonic()
        waited = time.monotonic() - self._busy_since
        if waited >= self.capacity_wait_s:
            raise capacity_exhausted(self.key, self.group_index, self.group_size, waited, CAPACITY.snapshot(self.key))
        self._busy_waits += 1
        self.heartbeat({"group_index": self.group_index, "capacity_waits": self._busy_waits})
        delay = min(0.25 * self._busy_waits, 2.0, self.capacity_wait_s - waited)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:  # cancellation is checked every 100 ms
            if self.should_cancel():
                from kiln.core.errors import RunCancelled

                raise RunCancelled("cancelled while waiting for environment capacity")
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    async def release(self, session: EnvSession) -> None:
        """Close ``session``; its grant leaves the book before the socket starts closing."""
        await session.close()

    def _granted(self, index: int, session: EnvSession, result: Any, retries: int) -> Opened:
        CAPACITY.granted(self.key, self.holder)
        # Released synchronously when the socket starts closing (a group closing a finished
        # episode, a failure, a cancel): the server may free the session at once, and another
        # group's grant must never be counted while this one still is.
        session.on_close = lambda: CAPACITY.released(self.key, self.holder)
        return index, session, result, retries

    def _refused(self, error: dict[str, Any] | None) -> None:
        self.refusals += 1
        CAPACITY.refused(self.key, error)

    async def _open_once(self, index: int, registry: list[EnvSession]) -> Opened:
        session, result, retries = await open_session_and_reset(
            self.url,
            self.reset_payload,
            capacity_wait_s=0.0,
            bearer_token=self.bearer_token,
            should_cancel=self.should_cancel,
            on_open=registry.append,
            on_refused=self._refused,
        )
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
                **self.observed(),
            },
        )
