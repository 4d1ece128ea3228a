"""Managed child processes: start, wait for readiness, stop by PID, pick free loopback ports.

This module owns the life cycle of the server processes Kiln starts itself (the Temporal dev
server, SeaweedFS, example environments in tests). Rules it enforces:

- every child runs in its own session (so its own process group, ``pgid == pid``) with stdout and
  stderr appended to a log file; stdin is ``/dev/null``;
- a child is stopped only through the PID (and process group) we recorded when starting it:
  SIGTERM, wait, then SIGKILL. Nothing here ever looks processes up by name;
- readiness waits are bounded and fail with a message naming what was awaited and the log path,
  with the tail of the log attached, and fail early when the child has already exited.

Ports: :func:`free_port_block` returns consecutive ports that are free *and* whose ``+10000``
partners are free too (SeaweedFS binds gRPC on ``p + 10000`` for every HTTP port ``p``). Blocks are
drawn below the kernel's ephemeral range so client sockets do not steal them.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from kiln.core.home import create_private_dirs

__all__ = [
    "ManagedProcess",
    "ProcessStartError",
    "start_process",
    "wait_until",
    "free_port",
    "free_port_block",
    "port_is_free",
    "port_accepts",
    "log_tail",
]

LOOPBACK = "127.0.0.1"
_BLOCK_LOW = 15000  # block ports [low, high) and their +10000 partners stay below 32768
_BLOCK_HIGH = 22700


class ProcessStartError(RuntimeError):
    """A managed process did not become ready (timed out or exited); the message names the log."""


def log_tail(path: Path | None, max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` of a log file, decoded leniently ('' when missing)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


class ManagedProcess:
    """A child process this Python process started; stopped only through its own PID/group."""

    def __init__(self, name: str, popen: subprocess.Popen, log_path: Path, log_file: IO[bytes] | None) -> None:
        self.name = name
        self.pid: int = popen.pid
        self.log_path = log_path
        self.argv: list[str] = list(popen.args) if isinstance(popen.args, list) else []
        #: loopback ports this process is known to listen on (filled by the starter; used by
        #: tests to check nothing is left listening after ``stop``)
        self.ports: list[int] = []
        #: callbacks run once after the process has exited (e.g. removing its stale sockets)
        self.on_exit: list[Callable[[], None]] = []
        self._popen = popen
        self._log_file = log_file
        self._stopped = False

    def __repr__(self) -> str:
        state = "alive" if self.alive() else f"exited({self._popen.returncode})"
        return f"ManagedProcess(name={self.name!r}, pid={self.pid}, {state}, log={self.log_path})"

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def alive(self) -> bool:
        """True while the child has not exited (it is reaped as soon as it has)."""
        return self._popen.poll() is None

    def _signal_group(self, sig: int) -> None:
        # The child was started with start_new_session=True, so its process group id equals its
        # pid. Signal the group only while the child is unreaped (its pid cannot have been
        # reused); afterwards signal nothing (stray grandchildren are killed by the group signal
        # sent while the leader was alive).
        if self._popen.poll() is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process (group), wait up to ``timeout_s``, then SIGKILL. Idempotent."""
        if self._stopped and self._popen.poll() is not None:
            return
        if self._popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self._popen.wait(timeout=10.0)
        self._finish()

    def kill(self) -> None:
        """SIGKILL the process (group) now and reap it (used by chaos tests)."""
        if self._popen.poll() is None:
            self._signal_group(signal.SIGKILL)
            self._popen.wait(timeout=10.0)
        self._finish()

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the child to exit by itself; returns its exit status."""
        code = self._popen.wait(timeout=timeout_s)
        self._finish()
        return code

    def _finish(self) -> None:
        if not self._stopped:
            for callback in self.on_exit:
                try:
                    callback()
                except Exception:  # noqa: BLE001 - cleanup must not mask the stop
                    pass
        self._stopped = True
        if self._log_file is not None:
            try:
                self._log_file.write(
                    f"\n[kiln] {self.name} pid {self.pid} exited with {self._popen.returncode} at {_now()}\n".encode()
                )
                self._log_file.close()
            except (OSError, ValueError):
                pass
            self._log_file = None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def start_process(
    name: str,
    argv: list[str],
    *,
    log_path: Path,
    env: dict | None = None,
    cwd: Path | None = None,
    umask: int = 0o077,
    pass_fds: tuple[int, ...] = (),
) -> ManagedProcess:
    """Start ``argv`` in its own session with output appended to ``log_path``.

    ``env`` replaces the environment entirely when given (pass ``{**os.environ, ...}`` to extend).
    The child writes with ``umask`` (default 077: its files are its owner's only), and the log
    file is created 0600. ``pass_fds`` stay open in the child (e.g. sockets bound here).
    """
    log_path = Path(log_path)
    create_private_dirs(log_path.parent)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    log_file = os.fdopen(fd, "ab", buffering=0)
    log_file.write(f"\n[kiln] starting {name} at {_now()}: {' '.join(argv)}\n".encode())
    try:
        popen = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=None if env is None else {str(k): str(v) for k, v in env.items()},
            cwd=None if cwd is None else str(cwd),
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
            umask=umask,
        )
    except OSError as exc:
        log_file.close()
        raise ProcessStartError(f"could not start {name} ({argv[0]}): {exc}") from exc
    return ManagedProcess(name, popen, log_path, log_file)


@contextmanager
def stop_on_failure(process: ManagedProcess) -> Iterator[ManagedProcess]:
    """Stop ``process`` when the block fails (or is interrupted): a server that never became
    ready is not left running."""
    try:
        yield process
    except BaseException:
        process.stop()
        raise


def wait_until(
    check: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    log_path: Path | None = None,
    process: ManagedProcess | None = None,
    interval_s: float = 0.05,
) -> None:
    """Poll ``check`` until it returns True; raise :class:`ProcessStartError` after ``timeout_s``.

    An exception raised by ``check`` counts as "not yet". When ``process`` is given and exits
    first, fail at once. The error names ``what`` and the log path and carries the log's tail.
    """
    if process is not None and log_path is None:
        log_path = process.log_path
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    delay = interval_s
    while True:
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
            last_exc = exc
        if process is not None and not process.alive():
            raise ProcessStartError(
                _wait_message(
                    f"{process.name} (pid {process.pid}) exited with status {process.returncode} before {what}",
                    log_path,
                    last_exc,
                )
            )
        if time.monotonic() >= deadline:
            raise ProcessStartError(
                _wait_message(f"timed out after {timeout_s:g}s waiting for {what}", log_path, last_exc)
            )
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 1.5, 0.5)


def _wait_message(head: str, log_path: Path | None, last_exc: BaseException | None) -> str:
    parts = [head]
    if last_exc is not None:
        parts.append(f"last check error: {type(last_exc).__name__}: {last_exc}")
    if log_path is not None:
        parts.append(f"log: {log_path}")
        tail = log_tail(log_path, 2000).strip()
        if tail:
            parts.append("log tail:\n" + tail)
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------ ports


def port_is_free(port: int, host: str = LOOPBACK, *, reuse_addr: bool = False) -> bool:
    """True when ``host:port`` can be bound right now.

    With ``reuse_addr=False`` (the default, conservative) a port in TIME_WAIT counts as taken;
    ``reuse_addr=True`` answers "is anything bound/listening there" like a server would see it.
    """
    if not 0 < port < 65536:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def port_accepts(port: int, host: str = LOOPBACK, timeout_s: float = 0.5) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def free_port() -> int:
    """A currently free loopback port chosen by the kernel."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def free_port_block(n: int, *, grpc_offset: int | None = 10000) -> list[int]:
    """``n`` consecutive free loopback ports ``p..p+n-1``; with ``grpc_offset`` also ``p+off..``.

    The block is drawn at random below the ephemeral range, so concurrent test processes rarely
    collide; a collision is still possible between this check and the server's bind (callers that
    start servers retry on a bind failure).
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    rng = random.Random(os.urandom(8))
    high = _BLOCK_HIGH - n
    for _ in range(500):
        base = rng.randrange(_BLOCK_LOW, high)
        ports = list(range(base, base + n))
        wanted = ports + ([p + grpc_offset for p in ports] if grpc_offset else [])
        if all(port_is_free(p) for p in wanted):
            return ports
    raise RuntimeError(f"no block of {n} free loopback ports found (grpc_offset={grpc_offset})")
