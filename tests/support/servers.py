"""Start servers for tests as subprocesses on a free loopback port; stop them by PID.

``serve_app_process(argv_factory)`` is the generic helper: ``argv_factory(port)`` returns the
command line, the helper waits until ``GET /health`` (or a plain TCP accept) answers, yields the
base URL and always terminates the process by its own PID. ``serve_example_env`` serves
``examples/envs`` environments through it. A ``python -m MODULE`` command is forked from the
session's fork server (``forkserver.py``), which has imported openenv once.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support.forkserver import DISABLE_VARIABLE, child_base_env, fork_server

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A currently unused TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _ready(port: int, health_path: str | None) -> bool:
    try:
        if health_path is None:
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return True
        conn = http.client.HTTPConnection(LOOPBACK, port, timeout=1.0)
        try:
            conn.request("GET", health_path)
            return conn.getresponse().status == 200
        finally:
            conn.close()
    except OSError:
        return False


def stop_process(proc: Any, timeout_s: float = 5.0) -> None:
    """Terminate ``proc`` by its PID (SIGTERM, then SIGKILL), and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def serve_app_process(
    argv: list[str] | Callable[[int], list[str]],
    *,
    port: int | None = None,
    health_path: str | None = "/health",
    startup_timeout_s: float = 90.0,  # a loaded 2-core machine took 23 s to import openenv
    env: dict[str, str] | None = None,
    attempts: int = 3,
) -> Iterator[str]:
    """Run a server subprocess and yield ``http://127.0.0.1:<port>``.

    ``argv`` is a list (the port is then given by ``port``) or a callable building the command
    line from a freshly chosen port; in that case a port race is retried up to ``attempts``
    times. ``health_path=None`` waits for a TCP accept instead of ``GET /health`` == 200.
    """
    child_env = {**child_base_env(), **(env or {})}
    last_error = "server did not start"
    for _ in range(max(1, attempts if callable(argv) else 1)):
        chosen = port if port is not None else free_port()
        command = argv(chosen) if callable(argv) else list(argv)
        proc = _start(command, child_env)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if _ready(chosen, health_path):
                    yield f"http://{LOOPBACK}:{chosen}"
                    return
                time.sleep(0.05)
            if proc.poll() is None:
                last_error = f"server did not become ready within {startup_timeout_s}s"
            else:
                stderr = proc.stderr.read().decode("utf-8", "replace") if proc.stderr else ""
                last_error = f"server exited with {proc.returncode}: {stderr[-2000:]}"
        finally:
            stop_process(proc)
            if proc.stderr:
                proc.stderr.close()
    raise RuntimeError(last_error)


def _start(command: list[str], env: dict[str, str]) -> Any:
    """The command forked from the session's fork server when it can be (see ``forkserver``),
    else (or with ``KILN_TEST_FORKSERVER=0``) a plain subprocess."""
    if os.environ.get(DISABLE_VARIABLE, "1") != "0":
        forked = fork_server().spawn(command, env=env, cwd=str(REPO_ROOT))
        if forked is not None:
            return forked
    return subprocess.Popen(command, cwd=str(REPO_ROOT), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def example_env_argv(name: str, port: int, **options: object) -> list[str]:
    """``python -m examples.envs NAME --port P --opt-name value ...``."""
    argv = [sys.executable, "-m", "examples.envs", name, "--port", str(port)]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


@contextlib.contextmanager
def serve_example_env(name: str, **options: object) -> Iterator[str]:
    """Serve example environment ``name`` (e.g. ``max_concurrent_envs=2``); yield its base URL."""
    with serve_app_process(lambda port: example_env_argv(name, port, **options)) as base_url:
        yield base_url


@contextlib.contextmanager
def serve_module(module: str, *args: str, health_path: str | None = "/health") -> Iterator[str]:
    """Serve ``python -m MODULE --port P *args`` (any module with a ``--port`` option)."""
    with serve_app_process(
        lambda port: [sys.executable, "-m", module, "--port", str(port), *args],
        health_path=health_path,
    ) as base_url:
        yield base_url
