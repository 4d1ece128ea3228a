"""A fork server for test processes: ``python -m MODULE ...`` without paying the imports again.

Every OpenEnv server imports ``openenv``, which imports gradio (about 8 s of CPU on a 2-core
machine), and every worker or child process imports torch, transformers and peft (about 10 s):
on the critical path of each test that starts its own environment or worker. The fork server is
one process (per pytest session) that imports those modules once (``PRELOAD``) and then, per
request, forks a child that runs the module as ``__main__`` with the requested arguments,
environment, working directory and output files. The children are real, separate processes with
their own PIDs and process groups: tests signal them by PID exactly as before
(``ForkedProcess`` has the ``subprocess.Popen`` surface the helpers use). The server forks from
its single Python thread and never runs a torch operation, so a child starts from an import-only
state; a request whose import-time environment (``IMPORT_TIME_VARIABLES``: thread counts, offline
flags, ``PYTHONPATH`` …) differs from the server's is refused, and the caller starts a plain
subprocess. ``KILN_TEST_FORKSERVER=0`` turns the fork server off.

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

REPO_ROOT = Path(__file__).resolve().parents[2]

# Imported once in the server; a module not listed still works (the child imports it).
PRELOAD = (
    "uvicorn",
    "openenv.core.env_server.http_server",
    "examples.envs",
    "torch",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "peft",
    "temporalio.client",
    "temporalio.worker",
    "botocore.session",
)
# Read when the interpreter starts or a preloaded module is imported: a child asking for other
# values than the server's cannot be forked from it and is started as a plain subprocess instead.
# (An explicit list: libraries add variables of their own as they load, e.g. torch sets
# TORCHINDUCTOR_CACHE_DIR, and a prefix match then refused every later request.)
IMPORT_TIME_VARIABLES = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
                         "OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE",
                         "TOKENIZERS_PARALLELISM", "ATEN_CPU_CAPABILITY", "CUDA_VISIBLE_DEVICES")
DISABLE_VARIABLE = "KILN_TEST_FORKSERVER"  # "0": every test process is a plain subprocess
_PR_SET_PDEATHSIG = 1
_START_TIMEOUT_S = 180.0


def child_base_env() -> dict[str, str]:
    """The environment of the fork server, and the base of every test server's environment."""
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    env.update({"PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    return env


def _import_time(env: dict[str, str]) -> dict[str, str | None]:
    return {name: env.get(name) for name in IMPORT_TIME_VARIABLES}


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
        if request["umask"] is not None:
            os.umask(request["umask"])
        mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
        null = os.open(os.devnull, os.O_RDWR)
        err = os.open(request["stderr"], mode, 0o600)
        out = os.open(request["stdout"], mode, 0o600) if request["stdout"] else null
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, err, out}:
            os.close(fd)
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

    def __init__(self, server: "ForkServer", pid: int, args: list[str], stderr_path: Path, *, own_stderr: bool) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._stderr_path = stderr_path if own_stderr else None
        self.stderr: IO[bytes] | None = open(stderr_path, "rb") if own_stderr else None  # noqa: SIM115

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.request({"op": "poll", "pid": self.pid})["returncode"]
            if self.returncode is not None and self._stderr_path is not None:
                with contextlib.suppress(OSError):
                    self._stderr_path.unlink()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.pid, timeout or 0.0)
            time.sleep(0.05)
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
        self.env = child_base_env()

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._sock)
        with open(self._dir / "server.err", "wb") as err:  # the child keeps its own copy
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.forkserver", self._sock, str(os.getpid())],
                cwd=str(REPO_ROOT),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not os.path.exists(self._sock):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                detail = (self._dir / "server.err").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the test fork server did not start: {detail}")
            time.sleep(0.05)

    def start_in_background(self) -> None:
        """Start the server on a daemon thread (its imports overlap the caller's work); a spawn
        meanwhile waits for it."""

        def start() -> None:
            with self._lock, contextlib.suppress(RuntimeError):  # a spawn reports a failed start
                self._ensure_started()

        threading.Thread(target=start, name="fork-server-start", daemon=True).start()

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self._sock)
            conn.sendall(json.dumps(message).encode() + b"\n")
            return json.loads(conn.makefile("rb").readline())

    def spawn(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        stdout: Path | None = None,
        stderr: Path | None = None,
        append: bool = False,
        umask: int | None = None,
    ) -> ForkedProcess | None:
        """Fork ``argv`` (``[sys.executable, "-m", MODULE, *args]``); None when it cannot be forked
        from this server (another command, or other import-time environment values).

        Output goes to the ``stdout`` and ``stderr`` files (truncated, or appended to with
        ``append``); without ``stdout`` it is discarded, without ``stderr`` it is readable from
        the process's ``.stderr``."""
        if argv[:2] != [sys.executable, "-m"] or len(argv) < 3 or _import_time(env) != _import_time(self.env):
            return None
        with self._lock:
            self._ensure_started()
            if stderr is None:
                fd, own = tempfile.mkstemp(prefix="child-", suffix=".err", dir=self._dir)
                os.close(fd)
            request = {"op": "spawn", "module": argv[2], "args": argv[3:], "env": env, "cwd": cwd,
                       "stdout": None if stdout is None else str(stdout),
                       "stderr": own if stderr is None else str(stderr), "append": append, "umask": umask}
            answer = self.request(request)
        return ForkedProcess(self, answer["pid"], list(argv), Path(request["stderr"]), own_stderr=stderr is None)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()


def start_managed(name: str, argv: list[str], *, log_path: Path, env: dict[str, str], cwd: Path) -> Any:
    """``kiln.devstack.processes.start_process`` for test processes: forked from the fork server
    when it can be (the same ``ManagedProcess``, output appended to ``log_path``, umask 077)."""
    from kiln.devstack.processes import ManagedProcess, start_process

    forked = None
    if os.environ.get(DISABLE_VARIABLE, "1") != "0":
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"\n[kiln] starting {name} (forked): {' '.join(argv)}\n".encode())
        forked = fork_server().spawn(argv, env=env, cwd=str(cwd), stdout=log_path, stderr=log_path, append=True,
                                     umask=0o077)
    if forked is None:
        return start_process(name, argv, log_path=log_path, env=env, cwd=cwd)
    return ManagedProcess(name, forked, log_path, open(log_path, "ab", buffering=0))  # noqa: SIM115


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
