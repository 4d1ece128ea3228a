"""Supervision of ``kiln serve``'s children: restart a dead one with backoff, give up on a crash loop.

Owns the restart policy, and nothing about what a child is: each :class:`Child` brings its own
``start`` callable (which starts the process and, where the child has a readiness check, waits for
it). One :meth:`Supervisor.check` call is one supervision step; ``kiln serve`` calls it about once
a second. Rules:

- a child that exits is started again after a backoff: ``first_backoff_s`` after a run that lasted
  at least ``stable_after_s``; after a *fast failure* (an exit sooner than that, or a start that
  failed) the delay doubles per consecutive fast failure, up to ``max_backoff_s``;
- ``give_up_after`` consecutive fast failures of one child raise :class:`SupervisorGaveUp`, whose
  message is one line naming the child, the count and its log;
- an incident counts once: the failed starts of one outage (the child cannot come up until what
  it needs is back) are one fast failure, however many retries the outage takes; they double the
  backoff and end in :class:`SupervisorGaveUp` after ``give_up_after`` failed starts in a row, but
  a death after the child came up again starts counting from that one fast failure, not from the
  outage's retries;
- a restart of one child never touches the others (each runs in its own process group);
- every state change is reported through ``on_event`` (one human line) and kept in
  :meth:`Supervisor.snapshot` (what ``/healthz`` and ``<home>/run/serve.json`` show).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.devstack.processes import ManagedProcess

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 30.0
GIVE_UP_AFTER = 5


class SupervisorGaveUp(RuntimeError):
    """A child failed fast too many times in a row; the message is one line with its log path."""


def describe_exit(code: int | None) -> str:
    """``status 3`` or ``signal 9 (SIGKILL)`` for a Popen return code."""
    import signal

    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


@dataclass
class Child:
    """One supervised process: its name, how to (re)start it, and its restart history."""

    name: str
    start: Callable[[], ManagedProcess]
    process: ManagedProcess | None = None
    log_path: Path | None = None
    restarts: int = 0
    fast_failures: int = 0
    failed_starts: int = 0  # consecutive failed starts: one outage, counted once in fast_failures
    state: str = "starting"  # running | restarting | failed | stopped
    last_exit: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None
    down_since: float | None = None

    def view(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "pid": self.process.pid if self.process is not None and self.process.alive() else None,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
        }


class Supervisor:
    """Keeps a fixed set of children running (see the module docstring for the policy)."""

    def __init__(
        self,
        *,
        on_event: Callable[[str], None] = lambda _line: None,
        on_change: Callable[[], None] = lambda: None,
        first_backoff_s: float = FIRST_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        stable_after_s: float = STABLE_AFTER_S,
        give_up_after: int = GIVE_UP_AFTER,
    ) -> None:
        self.children: list[Child] = []
        self.on_event = on_event
        self.on_change = on_change
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self.give_up_after = give_up_after

    def adopt(self, name: str, process: ManagedProcess, start: Callable[[], ManagedProcess]) -> Child:
        """Supervise ``process`` (already started and ready); ``start`` makes its replacement."""
        child = Child(name=name, start=start, process=process, log_path=process.log_path, state="running")
        self.children.append(child)
        self.on_change()
        return child

    def launch(self, name: str, start: Callable[[], ManagedProcess]) -> Child:
        """Start a child now (a failure to start propagates: nothing is supervised yet)."""
        return self.adopt(name, start(), start)

    def child(self, name: str) -> Child:
        for child in self.children:
            if child.name == name:
                return child
        raise KeyError(name)

    def _backoff(self, child: Child) -> float:
        failures = child.fast_failures + max(0, child.failed_starts - 1)  # an outage's retries double it too
        if failures == 0:
            return self.first_backoff_s
        return min(self.first_backoff_s * 2 ** (failures - 1), self.max_backoff_s)

    def _failed(self, child: Child, reason: str, now: float, *, start_failed: bool = False) -> None:
        """Record a death (or a failed start) and schedule the restart, or give up."""
        fast = now - child.started_at < self.stable_after_s
        if not (start_failed and child.failed_starts > 0):  # an outage's later retries: same incident
            child.fast_failures = child.fast_failures + 1 if fast else 0
        child.failed_starts = child.failed_starts + 1 if start_failed else 0
        child.last_exit = reason
        if max(child.fast_failures, child.failed_starts) >= self.give_up_after:
            child.state = "failed"
            self.on_change()
            raise SupervisorGaveUp(
                f"{child.name} failed {max(child.fast_failures, child.failed_starts)} times in a row, each within "
                f"{self.stable_after_s:g}s of starting (last: {reason}); gave up — see {child.log_path}"
            )
        wait = self._backoff(child)
        child.state = "restarting"
        child.restart_at = now + wait
        if child.down_since is None:
            child.down_since = now
        self.on_event(f"{child.name} {reason}; restarting in {wait:g}s")
        self.on_change()

    def _restart(self, child: Child) -> None:
        old_pid = child.process.pid if child.process is not None else None
        child.started_at = time.monotonic()
        try:
            process = child.start()
        except Exception as exc:  # noqa: BLE001 - any failed start (port taken, not ready) is retried
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._failed(child, f"did not start ({reason})", time.monotonic(), start_failed=True)
            return
        child.failed_starts = 0
        child.process = process
        child.log_path = process.log_path
        child.restarts += 1
        child.state = "running"
        child.restart_at = None
        down_s = time.monotonic() - (child.down_since or child.started_at)
        child.down_since = None
        self.on_event(
            f"{child.name} restarted: pid {old_pid} → {process.pid} (restart {child.restarts}, down {down_s:.1f}s)"
        )
        self.on_change()

    def check(self) -> None:
        """One supervision step: notice deaths, restart children whose backoff has elapsed."""
        for child in self.children:
            now = time.monotonic()
            if child.state == "running" and child.process is not None and not child.process.alive():
                child.process.wait(0)  # reap, close its log
                self._failed(child, f"exited with {describe_exit(child.process.returncode)}", now)
            elif child.state == "running" and child.fast_failures and now - child.started_at >= self.stable_after_s:
                child.fast_failures = 0  # up long enough: the next death starts a fresh count
            if child.state == "restarting" and child.restart_at is not None and now >= child.restart_at:
                self._restart(child)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{name: {state, pid, restarts, last_exit}}`` of every child."""
        return {child.name: child.view() for child in self.children}

    def stop(self) -> None:
        """Stop every child by PID, in reverse start order. Idempotent."""
        for child in reversed(self.children):
            if child.process is not None:
                child.process.stop()
            child.state = "stopped"
