"""What an environment grants: its session capacity, learned per worker process (issue 12/14).

Owns: the process-wide ``CapacityBook`` (per environment URL: the most sessions it ever granted
us at once, the ``max_sessions`` it advertised in ``CAPACITY_REACHED``, refusals seen; and per run
and URL the most sessions that run held at once), the per-run figures one group reports
(``group_capacity``) and their sum over a run (``merge_capacity``), the wave
size a group may open, the per-environment capacity-wait gate (at most one group per environment
waits for capacity on one worker; the others end their attempt at once), and the pure rules the
workflow uses to wait for capacity with no gpu slot held (``capacity_wait_decision``) and to word
the final failure (``capacity_exhausted``).

OpenEnv publishes no capacity (protocol §4.1): a client learns it only from refusals. Nothing here
does I/O; ``kiln.core.openenv.session`` and ``kiln.core.rollout.group`` feed the book.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kiln.core.errors import CAPACITY_WAIT_CODE, EnvironmentCapacityExhausted
from kiln.core.errors import EnvironmentAtCapacity as EnvironmentAtCapacity  # re-exported (moved to kiln.core.errors)

# One activity attempt waits at most this long for a first session before it ends (0: one try); all of
# ``capacity_wait_seconds`` is spent in workflow timers (no gpu slot held).
ATTEMPT_CAPACITY_WAIT_S = 0.0
# Workflow backoff between capacity attempts: min(first × 2^n, max), never past the deadline.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 10.0
# A learned limit is a hint: after this long without a refusal the full width is tried again
# (an environment may be restarted with more sessions).
LIMIT_MEMORY_S = 120.0
# Per-run session counts kept by one worker process (the oldest idle ones are forgotten first).
MAX_HOLDERS = 4096


@dataclass
class EnvironmentCapacity:
    """What one environment has shown this process."""

    granted_max: int = 0  # most sessions held at once
    advertised_max: int | None = None  # CAPACITY_REACHED.max_sessions
    refusals: int = 0
    held: int = 0
    last_refusal: float = 0.0

    def snapshot(self) -> dict[str, Any]:
        return {
            "sessions_granted_max": self.granted_max,
            "max_sessions_advertised": self.advertised_max,
            "refusals": self.refusals,
        }


@dataclass
class HeldSessions:
    """Sessions one holder (a run) holds at one environment on this worker, and the most at once."""

    held: int = 0
    held_max: int = 0


@dataclass
class CapacityBook:
    """Per-URL capacity knowledge shared by every group of one worker process (thread-safe).

    A grant is counted once the server answered the first reset, a release before the socket
    starts closing: the count never exceeds what the server holds for us, so
    ``sessions_granted_max`` is never more than the server allows.
    """

    _by_url: dict[str, EnvironmentCapacity] = field(default_factory=dict)
    _by_holder: dict[tuple[str, str], HeldSessions] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _entry(self, url: str) -> EnvironmentCapacity:
        entry = self._by_url.get(url)
        if entry is None:
            entry = self._by_url[url] = EnvironmentCapacity()
        return entry

    def granted(self, url: str, holder: str = "") -> None:
        with self._lock:
            entry = self._entry(url)
            entry.held += 1
            entry.granted_max = max(entry.granted_max, entry.held)
            mine = self._by_holder.setdefault((holder, url), HeldSessions())
            mine.held += 1
            mine.held_max = max(mine.held_max, mine.held)
            if len(self._by_holder) > MAX_HOLDERS:  # a long-lived worker: forget the oldest idle runs
                for key in [k for k, v in self._by_holder.items() if v.held == 0][: MAX_HOLDERS // 4]:
                    del self._by_holder[key]

    def released(self, url: str, holder: str = "") -> None:
        with self._lock:
            entry = self._entry(url)
            entry.held = max(0, entry.held - 1)
            mine = self._by_holder.get((holder, url))
            if mine is not None:
                mine.held = max(0, mine.held - 1)

    def held_max(self, url: str, holder: str = "") -> int:
        """The most sessions ``holder`` held at once at ``url`` on this worker."""
        with self._lock:
            mine = self._by_holder.get((holder, url))
            return mine.held_max if mine is not None else 0

    def advertised(self, url: str) -> int | None:
        with self._lock:
            entry = self._by_url.get(url)
            return entry.advertised_max if entry is not None else None

    def refused(self, url: str, error: dict[str, Any] | None) -> None:
        with self._lock:
            entry = self._entry(url)
            entry.refusals += 1
            entry.last_refusal = time.monotonic()
            maximum = (error or {}).get("max_sessions")
            if isinstance(maximum, int) and not isinstance(maximum, bool) and maximum >= 1:
                entry.advertised_max = maximum

    def limit(self, url: str) -> int | None:
        """Sessions one group may open at once: the advertised maximum seen in the last
        ``LIMIT_MEMORY_S``, else unknown (None)."""
        with self._lock:
            entry = self._by_url.get(url)
            if entry is None or time.monotonic() - entry.last_refusal > LIMIT_MEMORY_S:
                return None
            return entry.advertised_max

    def forget(self, url: str) -> None:
        """Drop what was learned about ``url`` (as if ``LIMIT_MEMORY_S`` had passed)."""
        with self._lock:
            self._by_url.pop(url, None)
            for key in [key for key in self._by_holder if key[1] == url]:
                del self._by_holder[key]

    def snapshot(self, url: str) -> dict[str, Any]:
        with self._lock:
            return self._entry(url).snapshot()


CAPACITY = CapacityBook()


def group_capacity(held_max: int, advertised: int | None, refusals: int, waves: int) -> dict[str, Any]:
    """What one group attempt reports for its run: the most sessions the run held at once at this
    environment (on this worker), what the environment advertised, the refusals and waves of this
    attempt only."""
    return {
        "sessions_granted_max": held_max,
        "max_sessions_advertised": advertised,
        "refusals": refusals,
        "waves": waves,
    }


def merge_capacity(total: dict[str, Any] | None, group: dict[str, Any]) -> dict[str, Any]:
    """A run's figures for one environment after one more group: refusals and waves add up, the
    most sessions held at once is the largest any group saw, the advertised maximum the latest."""
    if not total:
        return dict(group)
    advertised = group.get("max_sessions_advertised")
    return {
        "sessions_granted_max": max(
            int(total.get("sessions_granted_max") or 0), int(group.get("sessions_granted_max") or 0)
        ),
        "max_sessions_advertised": advertised if advertised is not None else total.get("max_sessions_advertised"),
        "refusals": int(total.get("refusals") or 0) + int(group.get("refusals") or 0),
        "waves": int(total.get("waves") or 0) + int(group.get("waves") or 0),
    }


def wave_size(concurrency: int, group_size: int, limit: int | None) -> int:
    """Candidates opened at once: ``min(concurrency, group_size, what the environment grants)``."""
    size = max(1, min(concurrency, group_size))
    return size if limit is None else max(1, min(size, limit))


def capacity_wait_decision(
    failure_code: str | None, waited_s: float, capacity_wait_s: float, retries: int
) -> float | None:
    """Seconds the workflow sleeps before the next attempt, or None to stop.

    Only ``environment_at_capacity`` is waited for; the wait is ``min(1 s × 2^retries, 10 s)``,
    cut so it never runs past ``capacity_wait_s`` since the first refusal.
    """
    if failure_code != CAPACITY_WAIT_CODE:
        return None
    left = capacity_wait_s - waited_s
    if left <= 0:
        return None
    return max(0.05, min(FIRST_BACKOFF_S * (2.0 ** min(retries, 8)), MAX_BACKOFF_S, left))


def capacity_exhausted(
    url: str, group_index: int, group_size: int, waited_s: float, observed: dict[str, Any] | None
) -> EnvironmentCapacityExhausted:
    """The final failure: names group_size, the sessions this environment granted and advertised."""
    observed = dict(observed or {})
    granted = observed.get("sessions_granted_max", 0)
    advertised = observed.get("max_sessions_advertised")
    return EnvironmentCapacityExhausted(
        f"group {group_index} (group_size {group_size}) got no session at {url} within "
        f"{waited_s:.1f}s: the environment granted at most {granted} session(s) at once"
        + (f" and advertises max_sessions {advertised}" if advertised is not None else "")
        + " — it is busy with other clients",
        hint="free the environment's sessions, start it with more sessions "
        "(max_concurrent_envs), or raise capacity_wait_seconds",
        retryable=False,
        details={
            "url": url,
            "group_size": group_size,
            "sessions_granted_max": granted,
            "max_sessions_advertised": advertised,
            "waited_s": round(waited_s, 1),
        },
    )
