"""A fork server for the test servers: ``python -m MODULE ...`` without paying the imports again.

Every OpenEnv server imports ``openenv``, which imports gradio: about 8 s of CPU on a 2-core
machine, on the critical path of each test that starts its own environment. The fork server is
one process (per pytest session) that imports those modules once and then, per request, forks a
child that runs the module as ``__main__`` with the requested arguments, environment, working
directory and stderr file. The children are real, separate server processes with their own PIDs:
tests signal them by PID exactly as before (``ForkedProcess`` has the ``subprocess.Popen`` surface
``servers.py`` uses). The server forks from its single thread and never runs torch, so a child
starts from a clean, import-only state.

Lifetime: started on first use; it exits (and SIGTERMs its children) when the pytest process that
started it goes away, even when pytest itself is killed, so no server outlives the session.
Protocol: one JSON line per request and one per answer over a Unix socket.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

# Imported once in the server; a module not listed still works (the child imports it).
PRELOAD = ("uvicorn", "openenv.core.env_server.http_server", "examples.envs")
_PR_SET_PDEATHSIG = 1
_START_TIMEOUT_S = 120.0


def _die_with_parent(sig: int) -> None:
    """Linux: ``sig`` reaches this process when the thread that forked it exits."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


# ----------------------------------------------------------------------------------------------
# The server process


def _reap(exits: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exits[pid] = os.waitstatus_to_exitcode(status)


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` and never return."""
    code = 1
    try:
        _die_with_parent(signal.SIGTERM)
        os.setpgid(0, 0)  # its own group, like a fresh server: a signal to the tests' group skips it
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDWR)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        os.close(null)
        os.close(err)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child reports every failure on its stderr
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve(sock_path: str, parent: int) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    exits: dict[int, int] = {}
    children: set[int] = set()
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.5)
        _reap(exits)
        if not ready:
            continue
        conn, _ = listener.accept()
        with conn:
            request = json.loads(conn.makefile("rb").readline())
            if request["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    _run_child(request)
                children.add(pid)
                answer: dict[str, Any] = {"pid": pid}
            else:  # poll
                _reap(exits)
                answer = {"returncode": exits.get(request["pid"])}
            conn.sendall(json.dumps(answer).encode() + b"\n")
    for pid in children:
        if pid not in exits:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def main() -> None:
    sock_path, parent = sys.argv[1], int(sys.argv[2])
    for module in PRELOAD:
        importlib.import_module(module)
    _serve(sock_path, parent)


# ----------------------------------------------------------------------------------------------
# The test side


class ForkedProcess:
    """A server child of the fork server, with the ``Popen`` methods the test helpers use."""

    def __init__(self, server: "ForkServer", pid: int, stderr_path: Path) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None
        self._stderr_path = stderr_path
        self.stderr: IO[bytes] = open(stderr_path, "rb")  # noqa: SIM115 - closed by the caller

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.request({"op": "poll", "pid": self.pid})["returncode"]
            if self.returncode is not None:
                with contextlib.suppress(OSError):
                    self._stderr_path.unlink()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.pid, timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The session's fork server process, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="kiln-forkserver-"))
        self._sock = str(self._dir / "sock")

    def _ensure_started(self, env: dict[str, str], cwd: str) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._sock)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forkserver", self._sock, str(os.getpid())],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self._dir / "server.err", "wb"),  # noqa: SIM115 - kept by the child
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not os.path.exists(self._sock):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                detail = (self._dir / "server.err").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the test fork server did not start: {detail}")
            time.sleep(0.05)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self._sock)
            conn.sendall(json.dumps(message).encode() + b"\n")
            return json.loads(conn.makefile("rb").readline())

    def spawn(self, module: str, args: list[str], *, env: dict[str, str], cwd: str) -> ForkedProcess:
        with self._lock:
            self._ensure_started(env, cwd)
            fd, stderr_path = tempfile.mkstemp(prefix="child-", suffix=".err", dir=self._dir)
            os.close(fd)
            answer = self.request(
                {"op": "spawn", "module": module, "args": args, "env": env, "cwd": cwd, "stderr": stderr_path}
            )
        return ForkedProcess(self, answer["pid"], Path(stderr_path))

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()


_SERVER: ForkServer | None = None
_SERVER_LOCK = threading.Lock()


def fork_server() -> ForkServer:
    """The process-wide fork server (stopped when this process exits)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            import atexit

            _SERVER = ForkServer()
            atexit.register(_SERVER.stop)
        return _SERVER


if __name__ == "__main__":
    main()
