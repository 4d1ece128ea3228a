"""The real Kiln stack a chaos test disturbs, every part a separate process restartable in place.

:class:`ChaosStack` starts (and stops, by PID) a Temporal dev server and a SeaweedFS S3 server on
*fixed* loopback ports with their data on disk, a counter environment on a fixed port, and the
Kiln workers as separate processes (``python -m tests.support.chaos worker ROLE``), so a worker
can be SIGKILLed; :func:`serve_counter` starts an extra counter environment. Python processes
fork from the session's fork server (``tests.support.forkserver``), imports already done.

Every worker process starts as a *spare* (its imports done, waiting to be told to run, see
``tests.support.chaos.worker``): one spare per role is kept ready, so starting a fresh worker after
a kill costs its connection, not the seconds of a cold Python's imports on a loaded machine.
"""

from __future__ import annotations

import os
import sys
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.chaos.faults import HOOKS_ENV, FaultHooks
from tests.support.chaos.worker import GO_ENV
from tests.support.forkserver import child_base_env, start_managed

REPO_ROOT = Path(__file__).resolve().parents[3]
LOOPBACK = "127.0.0.1"


def _http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    return {**child_base_env(), **extra}


@dataclass
class ChaosStack:
    """Temporal + SeaweedFS + counter env + control/gpu worker processes, all restartable in place."""

    root: Path
    model_path: Path
    heartbeat_timeout_s: float = 3.0
    max_active_runs: int = 1
    worker_settings: dict[str, str] = field(default_factory=dict)  # more KILN_* variables of the workers
    env_max_sessions: int = 8
    bucket: str = "kiln-chaos"
    access_key: str = "kiln-chaos-access"
    secret_key: str = "kiln-chaos-secret-key"
    control_queue: str = field(default_factory=lambda: f"chaos-control-{uuid.uuid4().hex[:8]}")
    gpu_queue: str = field(default_factory=lambda: f"chaos-gpu-{uuid.uuid4().hex[:8]}")
    temporal: Any = None
    s3: Any = None
    env: Any = None
    workers: dict[str, Any] = field(default_factory=dict)
    every_process: list[Any] = field(default_factory=list)
    _starts: int = 0
    _spares: dict[str, tuple[Any, Path]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kiln.devstack.processes import free_port_block

        self.root = Path(self.root)
        self.hooks = FaultHooks(self.root / "hooks")
        self.temporal_port, self.temporal_ui_port = free_port_block(2, grpc_offset=None)
        (self.s3_port,) = free_port_block(1)
        (self.env_port,) = free_port_block(1, grpc_offset=None)

    # ------------------------------------------------------------------ addresses
    @property
    def temporal_address(self) -> str:
        return f"{LOOPBACK}:{self.temporal_port}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.s3_port}"

    @property
    def env_url(self) -> str:
        return f"http://{LOOPBACK}:{self.env_port}"

    def settings(self) -> Any:
        """The Settings the workers run with (for S3 access from the test process)."""
        from kiln.core.settings import Settings

        return Settings(
            home=self.root / "kiln-home",
            temporal_address=self.temporal_address,
            s3_endpoint=self.s3_endpoint,
            s3_access_key=self.access_key,
            s3_secret_key=self.secret_key,
            s3_bucket=self.bucket,
            model_path=self.model_path,
            control_task_queue=self.control_queue,
            gpu_task_queue=self.gpu_queue,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            max_active_runs=self.max_active_runs,
        )

    def store(self) -> Any:
        from kiln.core.artifacts.store import S3Store

        return S3Store(
            endpoint=self.s3_endpoint,
            access_key=self.access_key,
            secret_key=self.secret_key,
            bucket=self.bucket,
            connect_timeout_s=1,
            read_timeout_s=5,
            max_attempts=1,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "ChaosStack":
        for role in ("control", "gpu"):  # their imports run while the servers start
            self._spares[role] = self._spawn_worker(role)
        self.start_temporal()
        self.start_s3()
        self.start_env()
        self.start_worker("control")
        self.start_worker("gpu")
        return self

    def close(self) -> list[Any]:
        """Stop every process this stack started (workers first); returns them all."""
        for name in ("gpu", "control"):
            proc = self.workers.pop(name, None)
            if proc is not None:
                proc.stop(timeout_s=15)
        for attr in ("env", "s3", "temporal"):
            proc = getattr(self, attr)
            if proc is not None:
                proc.stop(timeout_s=15)
                setattr(self, attr, None)
        for proc in self.every_process:
            proc.stop(timeout_s=5)
        return list(self.every_process)

    # ------------------------------------------------------------------ temporal
    def start_temporal(self) -> None:
        from kiln.devstack import start_temporal

        self.temporal = start_temporal(
            self.root / "temporal",
            port=self.temporal_port,
            ui_port=self.temporal_ui_port,
            log_dir=self.root / "logs",
            headless=True,
        )
        self.every_process.append(self.temporal)

    def stop_temporal(self) -> None:
        """SIGTERM the dev server (history stays in its db file)."""
        self.temporal.stop(timeout_s=15)
        self.temporal = None

    # ------------------------------------------------------------------ s3
    def start_s3(self) -> None:
        from kiln.devstack import start_seaweedfs

        self.s3 = start_seaweedfs(
            self.root / "seaweedfs",
            s3_port=self.s3_port,
            access_key=self.access_key,
            secret_key=self.secret_key,
            bucket=self.bucket,
            log_dir=self.root / "logs",
        )
        self.every_process.append(self.s3)

    def stop_s3(self) -> None:
        """Graceful stop (SIGTERM); data stays in the data dir."""
        self.s3.stop(timeout_s=15)
        self.s3 = None

    # ------------------------------------------------------------------ environment
    def start_env(self) -> None:
        from kiln.devstack.processes import wait_until

        argv = [sys.executable, "-m", "examples.envs", "counter", "--port", str(self.env_port),
                "--max-concurrent-envs", str(self.env_max_sessions)]
        self._starts += 1
        proc = start_managed(f"counter-env-{self._starts}", argv,
                             log_path=self.root / "logs" / f"env-{self._starts}.log",
                             env=_child_env({}), cwd=REPO_ROOT)
        proc.ports = [self.env_port]
        self.every_process.append(proc)
        wait_until(lambda: _http_ok(self.env_url + "/health"), timeout_s=60,
                   what=f"the counter env at {self.env_url}/health", process=proc)
        self.env = proc

    def kill_env(self) -> None:
        self.env.kill()
        self.env = None

    # ------------------------------------------------------------------ workers
    def worker_env(self) -> dict[str, str]:
        return _child_env(
            {
                HOOKS_ENV: str(self.hooks.directory),
                "KILN_HOME": str(self.root / "kiln-home"),
                "KILN_TEMPORAL_ADDRESS": self.temporal_address,
                "KILN_S3_ENDPOINT": self.s3_endpoint,
                "KILN_S3_ACCESS_KEY": self.access_key,
                "KILN_S3_SECRET_KEY": self.secret_key,
                "KILN_S3_BUCKET": self.bucket,
                "KILN_MODEL_PATH": str(self.model_path),
                "KILN_CONTROL_TASK_QUEUE": self.control_queue,
                "KILN_GPU_TASK_QUEUE": self.gpu_queue,
                "KILN_HEARTBEAT_TIMEOUT_S": str(self.heartbeat_timeout_s),
                "KILN_MAX_ACTIVE_RUNS": str(self.max_active_runs),
                **self.worker_settings,
                "KILN_MAX_TRACKED_RUNS": "32",
            }
        )

    def start_worker(self, role: str, *, timeout_s: float = 90.0) -> Any:
        """Start a fresh ``role`` worker process and wait until it polls its task queue.

        The process is the role's spare when one is alive (else a new one); afterwards a new spare
        starts in the background for the next call."""
        from kiln.devstack.processes import wait_until

        proc, go = self._take_spare(role)
        go.touch()
        wait_until(lambda: b"polling" in proc.log_path.read_bytes(), timeout_s=timeout_s,
                   what=f"the {role} worker to poll", process=proc)
        self.workers[role] = proc
        self._spares[role] = self._spawn_worker(role)
        return proc

    def spares(self) -> list[Any]:
        """The spare worker processes (started, not yet told to run)."""
        return [proc for proc, _ in self._spares.values()]

    def _take_spare(self, role: str) -> tuple[Any, Path]:
        spare = self._spares.pop(role, None)
        if spare is not None and spare[0].alive():
            return spare
        if spare is not None:
            spare[0].stop(timeout_s=5)
        return self._spawn_worker(role)

    def _spawn_worker(self, role: str) -> tuple[Any, Path]:
        """Start a spare ``role`` worker process; returns it and the file that makes it run."""
        self._starts += 1
        log_path = self.root / "logs" / f"worker-{role}-{self._starts}.log"
        go = self.root / "go" / f"worker-{role}-{self._starts}"
        go.parent.mkdir(parents=True, exist_ok=True)
        env = {**self.worker_env(), GO_ENV: str(go)}
        proc = start_managed(f"kiln-worker-{role}", [sys.executable, "-m", "tests.support.chaos", "worker", role],
                             log_path=log_path, env=env, cwd=REPO_ROOT)
        self.every_process.append(proc)
        return proc, go

    def kill_worker(self, role: str) -> int:
        """SIGKILL ``role``'s worker process; returns its pid."""
        proc = self.workers.pop(role)
        proc.kill()
        return proc.pid


# =============================================================================== driving runs


def serve_counter(root: Path, name: str, *, port: int, **options: object) -> Any:
    """Start a counter env process on ``port``; returns its ManagedProcess (stop it by PID)."""
    from kiln.devstack.processes import wait_until

    argv = [sys.executable, "-m", "examples.envs", "counter", "--port", str(port)]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    proc = start_managed(name, argv, log_path=Path(root) / "logs" / f"{name}.log", env=_child_env({}), cwd=REPO_ROOT)
    proc.ports = [port]
    wait_until(lambda: _http_ok(f"http://{LOOPBACK}:{port}/health"), timeout_s=60,
               what=f"{name} on port {port}", process=proc)
    return proc


# =============================================================================== figures
