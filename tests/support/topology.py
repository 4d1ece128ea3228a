"""The production topology without Docker: every part a separate real process, started by a test.

Owns :class:`Topology`: a Temporal dev server that Kiln did **not** start and that has none of
Kiln's search attributes (its own db file; :func:`start_bare_temporal`), SeaweedFS with an
explicit S3 identity file and a non-default secret, a counter environment, the Kiln API (uvicorn,
with a bearer token), one control worker and any number of gpu workers (each with its own
``KILN_HOME``), each running ``workers.__main__.main([ROLE])`` like compose does. Every process
is stopped by PID in :meth:`Topology.close`.

``python -m tests.support.topology worker ROLE`` runs ``python -m workers ROLE`` with one test
hook: while the file named by ``KILN_TEST_SAMPLE_DELAY_FILE`` exists, every policy ``sample`` call
first sleeps the seconds it contains (slows, never alters), so a kill can land mid-group.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.devstack import start_seaweedfs, temporal_binary, temporal_healthy
from kiln.devstack.processes import LOOPBACK, ManagedProcess, free_port_block, start_process, wait_until
from kiln.devstack.temporal import SQLITE_PRAGMAS

REPO_ROOT = Path(__file__).resolve().parents[2]
DELAY_FILE_ENV = "KILN_TEST_SAMPLE_DELAY_FILE"


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a child process: this worktree's code, offline, one thread."""
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and not k.startswith("KILN_")}
    env.update(
        {
            "PYTHONPATH": str(REPO_ROOT),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
    )
    env.update(extra)
    return env


def start_bare_temporal(
    root: Path, *, port: int | None = None, search_attributes: dict[str, str] | None = None
) -> tuple[ManagedProcess, str]:
    """A headless Temporal dev server with its own db file and *only* ``search_attributes``."""
    root = Path(root)
    (root / "temporal").mkdir(parents=True, exist_ok=True)
    port = port or free_port_block(1, grpc_offset=None)[0]
    argv = [
        temporal_binary(), "server", "start-dev", "--headless",
        "--db-filename", str(root / "temporal" / "bare.db"),
        *(arg for pragma in SQLITE_PRAGMAS for arg in ("--sqlite-pragma", pragma)),
        "--ip", LOOPBACK, "--port", str(port), "--log-level", "warn",
    ]
    for name, kind in (search_attributes or {}).items():
        argv += ["--search-attribute", f"{name}={kind}"]
    proc = start_process("bare-temporal", argv, log_path=root / "logs" / "bare-temporal.log", cwd=root)
    proc.ports = [port]
    address = f"{LOOPBACK}:{port}"
    try:
        wait_until(lambda: temporal_healthy(address), timeout_s=60, what=f"Temporal at {address}", process=proc)
    except BaseException:
        proc.stop()
        raise
    return proc, address


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


@dataclass
class Topology:
    """Bare Temporal + SeaweedFS + counter env + API + control worker + gpu workers."""

    root: Path
    model_path: Path
    heartbeat_timeout_s: float = 15.0
    env_max_sessions: int = 8
    gpu_max_concurrent: int = 1
    bucket: str = "kiln-topology"
    access_key: str = "kiln-topology-access"
    secret_key: str = field(default_factory=lambda: "s3-" + secrets.token_hex(16))
    api_token: str = field(default_factory=lambda: "api-" + secrets.token_hex(16))
    temporal: ManagedProcess | None = None
    temporal_address: str = ""
    s3: ManagedProcess | None = None
    env: ManagedProcess | None = None
    api: ManagedProcess | None = None
    control: ManagedProcess | None = None
    gpus: list[ManagedProcess] = field(default_factory=list)
    every_process: list[ManagedProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        (self.s3_port,) = free_port_block(1)
        self.env_port, self.api_port = free_port_block(2, grpc_offset=None)
        self.queue_suffix = uuid.uuid4().hex[:8]

    @property
    def s3_endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.s3_port}"

    @property
    def env_url(self) -> str:
        return f"http://{LOOPBACK}:{self.env_port}"

    @property
    def api_url(self) -> str:
        return f"http://{LOOPBACK}:{self.api_port}"

    def kiln_env(self, home: Path) -> dict[str, str]:
        """What compose's ``x-kiln-env`` sets, pointed at this topology."""
        return child_env(
            {
                "KILN_HOME": str(home),
                "KILN_TEMPORAL_ADDRESS": self.temporal_address,
                "KILN_S3_ENDPOINT": self.s3_endpoint,
                "KILN_S3_ACCESS_KEY": self.access_key,
                "KILN_S3_SECRET_KEY": self.secret_key,
                "KILN_S3_BUCKET": self.bucket,
                "KILN_MODEL_PATH": str(self.model_path),
                "KILN_CONTROL_TASK_QUEUE": f"topo-control-{self.queue_suffix}",
                "KILN_GPU_TASK_QUEUE": f"topo-gpu-{self.queue_suffix}",
                "KILN_HEARTBEAT_TIMEOUT_S": str(self.heartbeat_timeout_s),
                "KILN_GPU_MAX_CONCURRENT_ACTIVITIES": str(self.gpu_max_concurrent),
                "KILN_TEMPORAL_CONNECT_TIMEOUT_S": "60",
            }
        )

    def store(self) -> Any:
        from kiln.core.artifacts.store import S3Store

        return S3Store(endpoint=self.s3_endpoint, access_key=self.access_key, secret_key=self.secret_key,
                       bucket=self.bucket, connect_timeout_s=2, read_timeout_s=10, max_attempts=2)

    # ------------------------------------------------------------------ lifecycle
    def start_servers(self) -> "Topology":
        """Temporal (bare), SeaweedFS and the counter env; no Kiln process yet."""
        self.temporal, self.temporal_address = start_bare_temporal(self.root)
        self.every_process.append(self.temporal)
        self.s3 = start_seaweedfs(self.root / "seaweedfs", s3_port=self.s3_port, access_key=self.access_key,
                                  secret_key=self.secret_key, bucket=self.bucket, log_dir=self.root / "logs")
        self.every_process.append(self.s3)
        argv = [sys.executable, "-m", "examples.envs", "counter", "--port", str(self.env_port),
                "--max-concurrent-envs", str(self.env_max_sessions)]
        self.env = self._start("counter-env", argv, child_env({}))
        self.env.ports = [self.env_port]
        wait_until(lambda: _http_ok(self.env_url + "/health"), timeout_s=60, what="the counter env",
                   process=self.env)
        return self

    def start_kiln(self, gpu_workers: int = 2, *, roles: list[str] | None = None,
                   role_env: dict[str, dict[str, str]] | None = None) -> "Topology":
        """The control worker (which creates the search attributes), the gpu workers and the API.
        ``roles`` (default ``gpu`` × ``gpu_workers``) names each model worker's role (``gpu``,
        ``sampler``, ``trainer``); ``role_env`` adds variables to the workers of a role."""
        self.control = self.start_worker("control", "control")
        # The gpu workers start side by side (the search attributes exist by now).
        roles = roles if roles is not None else ["gpu"] * gpu_workers
        names = [f"{role}-{index}" for index, role in enumerate(roles)]
        gpus = [self.start_worker(role, name, wait=False, extra=(role_env or {}).get(role))
                for role, name in zip(roles, names)]
        for name, proc in zip(names, gpus):
            self._wait_polling(proc, name)
        self.gpus.extend(gpus)
        env = self.kiln_env(self.root / "home-api")
        env.update({"KILN_API_HOST": LOOPBACK, "KILN_API_PORT": str(self.api_port), "KILN_API_TOKEN": self.api_token})
        argv = [sys.executable, "-m", "uvicorn", "--factory", "api.app:app_from_env", "--host", LOOPBACK,
                "--port", str(self.api_port), "--log-level", "warning"]
        self.api = self._start("api", argv, env)
        self.api.ports = [self.api_port]
        wait_until(lambda: _http_ok(self.api_url + "/healthz"), timeout_s=60, what="the Kiln API",
                   process=self.api)
        return self

    def delay_file(self, name: str) -> Path:
        return self.root / f"sample-delay-{name}"

    def start_worker(self, role: str, name: str, *, wait: bool = True,
                     extra: dict[str, str] | None = None) -> ManagedProcess:
        """``python -m workers ROLE`` (with the sample-delay hook) and its own ``KILN_HOME``."""
        env = self.kiln_env(self.root / f"home-{name}")
        env.update(extra or {})
        env[DELAY_FILE_ENV] = str(self.delay_file(name))
        proc = self._start(f"worker-{name}", [sys.executable, "-m", "tests.support.topology", "worker", role], env)
        if wait:
            self._wait_polling(proc, name)
        return proc

    def _wait_polling(self, proc: ManagedProcess, name: str) -> None:
        wait_until(lambda: b"polling" in proc.log_path.read_bytes(), timeout_s=120,
                   what=f"worker {name} to poll", process=proc)

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        proc = start_process(name, argv, log_path=self.root / "logs" / f"{name}.log", env=env, cwd=REPO_ROOT)
        self.every_process.append(proc)
        return proc

    def close(self) -> list[ManagedProcess]:
        """Stop every process (Kiln first, servers last) by PID; returns them all."""
        for proc in reversed(self.every_process):
            proc.stop(timeout_s=15)
        return list(self.every_process)

    # ------------------------------------------------------------------ the API
    def api_call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.api_url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.api_token}")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def wait_run(self, run_id: str, *, timeout_s: float) -> dict[str, Any]:
        """Poll ``GET /v1/openenv/runs/{id}`` until the run ends; returns the final status."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            code, status = self.api_call("GET", f"/v1/openenv/runs/{run_id}")
            if code == 200:
                last = status
                if status.get("state") in ("completed", "failed", "cancelled"):
                    return status
            time.sleep(0.5)
        raise AssertionError(f"run {run_id} did not end within {timeout_s}s; last: {json.dumps(last)[:2000]}")


# =============================================================================== worker entry


class _DelayedSampling:
    """Delegates to the worker's policy; sleeps before each ``sample`` while the delay file exists."""

    def __init__(self, inner: Any, delay_file: Path) -> None:
        self._inner = inner
        self._delay_file = delay_file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        try:
            time.sleep(float(self._delay_file.read_text().strip() or 0))
        except (OSError, ValueError):
            pass
        return self._inner.sample(*args, **kwargs)


def worker_main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "worker":
        print("usage: python -m tests.support.topology worker control|gpu|sampler|trainer", file=sys.stderr)
        raise SystemExit(2)
    if argv[1] in ("gpu", "sampler"):
        import activities.gpu as gpu_mod

        delay_file = Path(os.environ[DELAY_FILE_ENV])
        original = gpu_mod.GpuActivities.policy

        def policy(self: Any) -> Any:
            return _DelayedSampling(original(self), delay_file)

        gpu_mod.GpuActivities.policy = policy  # type: ignore[method-assign]
    from workers.__main__ import main

    main([argv[1]])


if __name__ == "__main__":
    worker_main(sys.argv[1:])
