"""Chaos-test support: a real Kiln stack in separate processes, faults injected for real.

What this module owns:

- :class:`ChaosStack` starts (and stops, by PID) the whole stack a chaos test disturbs: a Temporal
  dev server and a SeaweedFS S3 server on *fixed* loopback ports with their data on disk (so each
  can be stopped and restarted in place), a counter environment on a fixed port (killed and
  restarted in place), and the Kiln workers as separate processes (``python -m workers control``
  and ``python -m workers gpu`` through :func:`worker_main`), so a worker can be SIGKILLed.
- :class:`FaultHooks`: a folder of tiny files read by the worker processes at run time. It slows
  (never alters) work so a fault can land at a chosen point — a delay per sampling step, a delay
  per training step, a hold before publication — and it logs, as JSON lines, every collection
  attempt, training step/checkpoint/attempt and publication attempt with the worker's pid, so a
  test can count exactly what was re-done. With no hook file present the workers behave exactly
  like ``python -m workers``.
- Helpers the tests share: driving a run through Temporal (start, poll ``status``, decode pending
  activities' heartbeat details), comparing a run's artifacts with a reference run's, checking a
  manifest against the bytes in S3, holding/probing WebSocket sessions on an environment, and
  recording recovery figures (:func:`record`) that ``tests/chaos/conftest.py`` prints at the end.

Worker entry point: ``python -m tests.support.chaos worker control|gpu`` installs the hooks and
then calls ``workers.__main__.main([role])`` (same settings, same workers, same defaults).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.server
import json
import os
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parents[2]
HOOKS_ENV = "KILN_CHAOS_DIR"
LOOPBACK = "127.0.0.1"

# Hook file names (values are decimal seconds unless noted).
SAMPLE_DELAY = "sample_delay_s"  # sleep before every policy.sample call (collection steps)
TRAIN_STEP_DELAY = "train_step_delay_s"  # sleep after every training step's progress heartbeat
PUBLISH_HOLD = "publish_hold"  # while this file exists, publish_run waits before doing anything
PUBLISH_HOLD_AFTER = "publish_hold_after"  # ... waits after its commit point (manifest written)
# One-shot faults (the worker deletes the file when it fires):
TRAIN_FAIL_NOW = "train_fail_now"  # the next training step's heartbeat raises a transient error
TRAIN_FAIL_RESUMED = "train_fail_resumed"  # a resumed training attempt fails right after starting
TRAIN_SETUP_DELAY = "train_setup_delay_s"  # the next training attempt sleeps this long before setup
EVENTS = "events.jsonl"

PUBLISH_HOLD_MAX_S = 120.0


# =============================================================================== fault hooks


class FaultHooks:
    """The hook folder shared by the test process and the worker processes."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- knobs (test side)
    def set(self, name: str, value: object = "") -> None:
        tmp = self.directory / f".{name}.tmp"
        tmp.write_text(str(value))
        tmp.replace(self.directory / name)

    def clear(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / name).unlink()

    def clear_all(self) -> None:
        for name in (SAMPLE_DELAY, TRAIN_STEP_DELAY, PUBLISH_HOLD, TRAIN_FAIL_NOW, TRAIN_FAIL_RESUMED,
                     TRAIN_SETUP_DELAY):
            self.clear(name)

    @contextlib.contextmanager
    def knob(self, name: str, value: object = "") -> Iterator[None]:
        self.set(name, value)
        try:
            yield
        finally:
            self.clear(name)

    # ---------------------------------------------------------------- knobs (worker side)
    def present(self, name: str) -> bool:
        return (self.directory / name).exists()

    def fire(self, name: str) -> str | None:
        """Consume a one-shot hook: its content when it was set (and is now removed), else None."""
        path = self.directory / name
        try:
            value = path.read_text()
            path.unlink()
        except FileNotFoundError:
            return None
        return value

    def number(self, name: str) -> float:
        try:
            return float((self.directory / name).read_text().strip() or 0.0)
        except (OSError, ValueError):
            return 0.0

    # ---------------------------------------------------------------- events
    def log(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": event, **fields}) + "\n"
        fd = os.open(self.directory / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Logged events (optionally of one kind and matching ``field=value`` pairs), in order."""
        try:
            lines = (self.directory / EVENTS).read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                item = json.loads(line)
            except ValueError:  # a line being written right now
                continue
            if event is not None and item.get("event") != event:
                continue
            if all(item.get(k) == v for k, v in match.items()):
                out.append(item)
        return out


def _activity_attempt() -> int | None:
    try:
        from temporalio import activity

        return activity.info().attempt
    except Exception:  # noqa: BLE001 - outside an activity
        return None


class _SlowSampling:
    """Delegates to the worker's policy; sleeps ``sample_delay_s`` before each ``sample``."""

    def __init__(self, inner: Any, hooks: FaultHooks) -> None:
        self._inner = inner
        self._hooks = hooks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        delay = self._hooks.number(SAMPLE_DELAY)
        if delay > 0:
            time.sleep(delay)
        return self._inner.sample(*args, **kwargs)


def install_hooks(role: str, hooks: FaultHooks) -> None:
    """Wrap the worker's activity bodies with the hook points (see the module docstring)."""
    if role in ("gpu", "all"):
        import activities.gpu as gpu_mod
        import kiln.policy.runtime  # noqa: F401 - import torch before polling: "ready" means ready
        import kiln.stages.training as training_mod

        original_collect = gpu_mod.collect

        async def collect(inp: Any, *args: Any, **kwargs: Any) -> Any:
            attempt = kwargs.get("attempt")
            hooks.log("collect_start", run_id=inp.run_id, group_index=inp.group_index, attempt=attempt)
            try:
                result = await original_collect(inp, *args, **kwargs)
            except BaseException as exc:
                hooks.log("collect_end", run_id=inp.run_id, group_index=inp.group_index,
                          attempt=attempt, outcome=f"error:{type(exc).__name__}")
                raise
            hooks.log("collect_end", run_id=inp.run_id, group_index=inp.group_index,
                      attempt=attempt, outcome="ok", group_sha256=result.group.sha256)
            return result

        gpu_mod.collect = collect

        original_policy = gpu_mod.GpuActivities.policy

        def policy(self: Any) -> Any:
            return _SlowSampling(original_policy(self), hooks)

        gpu_mod.GpuActivities.policy = policy  # type: ignore[method-assign]

        original_train = training_mod.train

        def train(inp: Any, *args: Any, **kwargs: Any) -> Any:
            attempt = _activity_attempt()
            run_id = inp.run_id
            beat = kwargs["heartbeat"]

            def heartbeat(details: dict[str, Any]) -> None:
                beat(details)
                if "step" in details and hooks.fire(TRAIN_FAIL_NOW) is not None:
                    hooks.log("train_injected_failure", run_id=run_id, attempt=attempt, step=details["step"])
                    raise RuntimeError(f"chaos: injected transient failure after step {details['step']}")
                if "step" in details:
                    hooks.log("train_step", run_id=run_id, attempt=attempt, step=details["step"],
                              total_steps=details.get("total_steps"))
                    delay = hooks.number(TRAIN_STEP_DELAY)
                    if delay > 0:
                        time.sleep(delay)
                elif "checkpoint_step" in details:
                    hooks.log("train_checkpoint", run_id=run_id, attempt=attempt,
                              step=details["checkpoint_step"])

            kwargs["heartbeat"] = heartbeat
            resume = kwargs.get("resume_checkpoint")
            hooks.log("train_start", run_id=run_id, attempt=attempt, resumed=resume is not None)
            try:
                if resume is not None and hooks.fire(TRAIN_FAIL_RESUMED) is not None:
                    raise RuntimeError("chaos: injected transient failure of a resumed attempt")
                setup_delay = hooks.fire(TRAIN_SETUP_DELAY)
                if setup_delay:
                    time.sleep(float(setup_delay))
                result = original_train(inp, *args, **kwargs)
            except BaseException as exc:
                hooks.log("train_end", run_id=run_id, attempt=attempt, outcome=f"error:{type(exc).__name__}")
                raise
            hooks.log("train_end", run_id=run_id, attempt=attempt, outcome="ok",
                      steps=result.steps, adapter_sha256=result.adapter_sha256)
            return result

        training_mod.train = train

    if role in ("control", "all"):
        import activities.control as control_mod

        original_publish = control_mod.publish

        def publish(store: Any, inp: Any, *args: Any, **kwargs: Any) -> Any:
            attempt = _activity_attempt()
            hooks.log("publish_start", run_id=inp.run_id, attempt=attempt)
            deadline = time.monotonic() + PUBLISH_HOLD_MAX_S
            while hooks.present(PUBLISH_HOLD) and time.monotonic() < deadline:
                time.sleep(0.05)
            try:
                result = original_publish(store, inp, *args, **kwargs)
            except BaseException as exc:
                hooks.log("publish_end", run_id=inp.run_id, attempt=attempt, outcome=f"error:{type(exc).__name__}")
                raise
            hooks.log("publish_end", run_id=inp.run_id, attempt=attempt, outcome="ok")
            while hooks.present(PUBLISH_HOLD_AFTER) and time.monotonic() < deadline + PUBLISH_HOLD_MAX_S:
                time.sleep(0.05)
            return result

        control_mod.publish = publish


def worker_main(argv: list[str]) -> None:
    """``python -m tests.support.chaos worker ROLE``: install hooks, then run Kiln's workers."""
    if len(argv) != 2 or argv[0] != "worker":
        print("usage: python -m tests.support.chaos worker control|gpu|all", file=sys.stderr)
        raise SystemExit(2)
    role = argv[1]
    install_hooks(role, FaultHooks(Path(os.environ[HOOKS_ENV])))
    from workers.__main__ import main

    main([role])


class BugReproduced(AssertionError):
    """Raised by the assertion that shows a known product bug (``xfail(raises=BugReproduced)``),
    so that any other failure of such a test still fails the suite."""


def expect_fixed(condition: bool, message: str) -> None:
    """Assert a behaviour a known product bug breaks (raises :class:`BugReproduced`)."""
    if not condition:
        raise BugReproduced(message)


# =============================================================================== the stack


def _http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
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


@dataclass
class ChaosStack:
    """Temporal + SeaweedFS + counter env + control/gpu worker processes, all restartable in place."""

    root: Path
    model_path: Path
    heartbeat_timeout_s: float = 3.0
    max_active_runs: int = 1
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
        from kiln.settings import Settings

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
        from kiln.artifacts.store import S3Store

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
        from kiln.devstack.processes import start_process, wait_until

        argv = [sys.executable, "-m", "examples.envs", "counter", "--port", str(self.env_port),
                "--max-concurrent-envs", str(self.env_max_sessions)]
        self._starts += 1
        proc = start_process(f"counter-env-{self._starts}", argv,
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
                "KILN_MAX_TRACKED_RUNS": "32",
            }
        )

    def start_worker(self, role: str, *, timeout_s: float = 90.0) -> Any:
        """Start ``role``'s worker process and wait until it polls its task queue."""
        from kiln.devstack.processes import start_process, wait_until

        self._starts += 1
        log_path = self.root / "logs" / f"worker-{role}-{self._starts}.log"
        proc = start_process(f"kiln-worker-{role}", [sys.executable, "-m", "tests.support.chaos", "worker", role],
                             log_path=log_path, env=self.worker_env(), cwd=REPO_ROOT)
        self.every_process.append(proc)
        wait_until(lambda: b"polling" in log_path.read_bytes(), timeout_s=timeout_s,
                   what=f"the {role} worker to poll", process=proc)
        self.workers[role] = proc
        return proc

    def kill_worker(self, role: str) -> int:
        """SIGKILL ``role``'s worker process; returns its pid."""
        proc = self.workers.pop(role)
        proc.kill()
        return proc.pid


# =============================================================================== driving runs


async def connect(stack: ChaosStack) -> Any:
    from temporalio.client import Client
    from temporalio.contrib.pydantic import pydantic_data_converter

    return await Client.connect(stack.temporal_address, data_converter=pydantic_data_converter)


async def start_run(client: Any, stack: ChaosStack, request: dict[str, Any], run_id: str | None = None) -> Any:
    from workflows.options import WORKFLOW_NAME

    run_id = run_id or f"chaos-{uuid.uuid4().hex[:12]}"
    return await client.start_workflow(WORKFLOW_NAME, request, id=run_id, task_queue=stack.control_queue)


async def query_status(handle: Any) -> dict[str, Any] | None:
    """The run's ``status`` query, or None while Temporal (or the workflow's worker) does not answer."""
    try:
        return await asyncio.wait_for(handle.query("status"), timeout=5)
    except Exception:  # noqa: BLE001 - server restarting, worker busy: "not now"
        return None


async def wait_status(
    handle: Any, predicate: Callable[[dict[str, Any]], bool], *, timeout_s: float, what: str,
    interval_s: float = 0.05,
) -> dict[str, Any]:
    """Poll ``status`` until ``predicate`` holds; fail naming ``what`` and the last status seen."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        status = await query_status(handle)
        if status is not None:
            last = status
            if predicate(status):
                return status
            if status.get("state") in ("completed", "failed", "cancelled") and not predicate(status):
                raise AssertionError(f"run ended ({status.get('state')}) before {what}: {_brief(status)}")
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last status: {_brief(last)}")


async def wait_until_async(check: Callable[[], Any], *, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll a sync or async ``check`` until it returns a truthy value (returned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


def _brief(status: dict[str, Any] | None) -> str:
    if status is None:
        return "None"
    keys = ("state", "phase", "progress", "failure", "interruptions", "admission", "cancelled_stage")
    return json.dumps({k: status.get(k) for k in keys}, default=str)


async def pending_activities(client: Any, handle: Any) -> list[dict[str, Any]]:
    """The run's pending activities with decoded heartbeat details ([] while unreachable)."""
    from temporalio.api.enums.v1 import PendingActivityState

    try:
        described = await asyncio.wait_for(handle.describe(), timeout=5)
    except Exception:  # noqa: BLE001
        return []
    out = []
    for pending in described.raw_description.pending_activities:
        details: list[Any] = []
        if pending.HasField("heartbeat_details") and pending.heartbeat_details.payloads:
            details = await client.data_converter.decode(pending.heartbeat_details.payloads)
        out.append(
            {
                "type": pending.activity_type.name,
                "state": PendingActivityState.Name(pending.state).removeprefix("PENDING_ACTIVITY_STATE_"),
                "attempt": pending.attempt,
                "details": details,
                "worker": pending.last_worker_identity,
            }
        )
    return out


async def wait_activity(
    client: Any, handle: Any, predicate: Callable[[dict[str, Any]], bool], *, timeout_s: float, what: str,
) -> dict[str, Any]:
    """Poll the run's pending activities until one satisfies ``predicate`` (returned).

    Fails at once when the run has closed first (the fault would have landed too late).
    """
    from temporalio.client import WorkflowExecutionStatus

    deadline = time.monotonic() + timeout_s
    while True:
        for act in await pending_activities(client, handle):
            if predicate(act):
                return act
        try:
            described = await asyncio.wait_for(handle.describe(), timeout=5)
            if described.status != WorkflowExecutionStatus.RUNNING:
                raise AssertionError(f"run {handle.id} closed ({described.status.name}) before {what}")
        except AssertionError:
            raise
        except Exception:  # noqa: BLE001 - server unreachable right now
            pass
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def last_details(act: dict[str, Any]) -> dict[str, Any]:
    """The latest heartbeat details of a pending activity (``{}`` when none)."""
    details = act.get("details") or []
    return details[-1] if details and isinstance(details[-1], dict) else {}


async def result_within(handle: Any, timeout_s: float) -> tuple[str, Any]:
    """``("completed", result)``, ``("failed", error)`` or ``("cancelled", error)`` within a bound."""
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import CancelledError

    try:
        return "completed", await asyncio.wait_for(handle.result(), timeout=timeout_s)
    except WorkflowFailureError as err:
        if isinstance(err.cause, CancelledError):
            return "cancelled", err
        return "failed", err


async def drive(client: Any, stack: ChaosStack, request: dict[str, Any], *, timeout_s: float = 120.0) -> "RunOutcome":
    """Run ``request`` undisturbed to completion and collect what a comparison needs."""
    started = time.monotonic()
    handle = await start_run(client, stack, request)
    state, value = await result_within(handle, timeout_s)
    assert state == "completed", f"reference run {handle.id} ended {state}: {value}"
    return RunOutcome.of(stack, handle.id, value, time.monotonic() - started)


# =============================================================================== artifacts


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_uri(store: Any, uri: str) -> bytes:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return store.client.get_object(Bucket=bucket, Key=key)["Body"].read()


@dataclass
class RunOutcome:
    """A completed run's final status and the digests a disturbed run must reproduce."""

    run_id: str
    status: dict[str, Any]
    digests: dict[str, str]  # artifact name -> sha256, train_receipt.json excluded (timestamps)
    adapter_sha256: str | None  # train_receipt.json's adapter_sha256 (None for rollout runs)
    manifest: dict[str, Any]
    seconds: float

    @classmethod
    def of(cls, stack: ChaosStack, run_id: str, status: dict[str, Any], seconds: float) -> "RunOutcome":
        store = stack.store()
        manifest = verify_published(store, run_id, status)
        digests = {a["name"]: a["sha256"] for a in status["artifacts"] if a["name"] != "train_receipt.json"}
        adapter = None
        receipt = next((a for a in status["artifacts"] if a["name"] == "train_receipt.json"), None)
        if receipt is not None:
            adapter = json.loads(read_uri(store, receipt["uri"]))["adapter_sha256"]
        return cls(run_id, status, digests, adapter, manifest, seconds)

    def _diff(self, other: "RunOutcome", stack: "ChaosStack", name: str) -> str:
        store = stack.store()
        return _text_diff(name, read_uri(store, _uri_of(self, name)), read_uri(store, _uri_of(other, name)))

    def receipt(self, stack: ChaosStack) -> dict[str, Any]:
        entry = next(a for a in self.status["artifacts"] if a["name"] == "train_receipt.json")
        return json.loads(read_uri(stack.store(), entry["uri"]))

    def assert_same_artifacts(self, other: "RunOutcome", stack: "ChaosStack | None" = None) -> None:
        """Every artifact byte-identical (by digest) and the same trained adapter.

        With ``stack``, a differing text artifact's first differing lines are shown.
        """
        assert set(other.digests) == set(self.digests), (sorted(other.digests), sorted(self.digests))
        differing = [name for name, digest in self.digests.items() if other.digests[name] != digest]
        if differing and stack is not None:
            raise AssertionError(
                f"artifacts differ from the reference run's: {differing}\n"
                + "\n".join(self._diff(other, stack, name) for name in differing)
            )
        assert not differing, f"artifacts differ from the reference run's: {differing}"
        assert other.adapter_sha256 == self.adapter_sha256
        for key in ("adapter_sha256", "stats", "behavior_policy", "reset_plan_sha256", "promoted"):
            assert other.manifest.get(key) == self.manifest.get(key), f"manifest {key} differs"


def _uri_of(outcome: RunOutcome, name: str) -> str:
    return next(a["uri"] for a in outcome.status["artifacts"] if a["name"] == name)


def _text_diff(name: str, ours: bytes, theirs: bytes, limit: int = 40) -> str:
    import difflib

    if len(ours) > 200_000 or len(theirs) > 200_000 or name.endswith(".safetensors"):
        return f"--- {name}: {len(ours)} vs {len(theirs)} bytes (binary)"
    lines = difflib.unified_diff(
        ours.decode("utf-8", "replace").splitlines(), theirs.decode("utf-8", "replace").splitlines(),
        "reference/" + name, "disturbed/" + name, lineterm="", n=1,
    )
    return "\n".join(list(lines)[:limit])


def verify_published(store: Any, run_id: str, status: dict[str, Any]) -> dict[str, Any]:
    """Exactly one manifest for the run, equal to what status names; every listed object intact."""
    from kiln.artifacts.manifest import manifest_key

    key = manifest_key(run_id)
    keys = [k for k in store.list_keys(f"runs/{run_id}/") if k.endswith("manifest.json")]
    assert keys == [key], f"expected exactly one manifest for {run_id}, found {keys}"
    data = store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read()
    assert status["manifest"]["sha256"] == sha256_of(data), "the manifest in S3 is not the one status names"
    manifest = json.loads(data)
    assert {a["name"] for a in manifest["artifacts"]} == {a["name"] for a in status["artifacts"]}
    for entry in manifest["artifacts"]:
        blob = read_uri(store, entry["uri"])
        assert len(blob) == entry["bytes"] and sha256_of(blob) == entry["sha256"], entry["name"]
    return manifest


def manifest_absent(store: Any, run_id: str) -> bool:
    from kiln.artifacts.manifest import manifest_key

    return not store.exists(manifest_key(run_id))


# =============================================================================== environments


def ws_url(base_url: str) -> str:
    return base_url.replace("http://", "ws://", 1).rstrip("/") + "/ws"


def _ws_connect(base_url: str) -> Any:
    from websockets.sync.client import connect as ws_connect

    return ws_connect(ws_url(base_url), open_timeout=10, close_timeout=2, proxy=None)


def _reset_reply(sock: Any, seed: int) -> dict[str, Any]:
    sock.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
    return json.loads(sock.recv(timeout=10))


def probe_sessions(base_url: str, sessions: int) -> tuple[int, bool]:
    """Open ``sessions`` + 1 WebSocket sessions at once and reset each.

    Returns (how many of the first ``sessions`` got an observation, whether the extra one was
    refused with CAPACITY_REACHED). ``(sessions, True)`` means no other session is open there.
    """
    accepted = 0
    refused = False
    with contextlib.ExitStack() as opened:
        for index in range(sessions + 1):
            sock = opened.enter_context(_ws_connect(base_url))
            if index < sessions:
                with contextlib.suppress(Exception):
                    accepted += _reset_reply(sock, index).get("type") == "observation"
            else:
                # A refused session is told so at once (CAPACITY_REACHED), then closed.
                with contextlib.suppress(Exception):
                    reply = json.loads(sock.recv(timeout=2))
                    refused = (reply.get("data") or {}).get("code") == "CAPACITY_REACHED"
    return accepted, refused


async def wait_env_idle(base_url: str, sessions: int, *, timeout_s: float = 15.0) -> float:
    """Wait until exactly ``sessions`` sessions can be opened (none leaked); returns seconds waited."""
    started = time.monotonic()
    last: tuple[int, bool] = (0, False)
    while time.monotonic() - started < timeout_s:
        last = await asyncio.to_thread(probe_sessions, base_url, sessions)
        if last == (sessions, True):
            return time.monotonic() - started
        await asyncio.sleep(0.25)
    raise AssertionError(
        f"{base_url} still has sessions open after {timeout_s}s: "
        f"{last[0]}/{sessions} accepted, extra refused={last[1]}"
    )


class SessionHolder:
    """Holds one WebSocket session (reset done) on an environment until :meth:`release`."""

    def __init__(self, base_url: str) -> None:
        self.sock = _ws_connect(base_url).__enter__()
        reply = _reset_reply(self.sock, 12345)
        assert reply.get("type") == "observation", reply

    def release(self) -> None:
        with contextlib.suppress(Exception):
            self.sock.__exit__(None, None, None)


class SlowHealthServer:
    """A loopback HTTP server whose every GET sleeps ``delay_s`` (a stalled environment)."""

    def __init__(self, delay_s: float = 60.0) -> None:
        self.requests = 0
        self._stop = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.requests += 1
                outer._stop.wait(delay_s)
                with contextlib.suppress(OSError):
                    self.send_response(503)
                    self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{LOOPBACK}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def serve_counter(root: Path, name: str, *, port: int, **options: object) -> Any:
    """Start a counter env process on ``port``; returns its ManagedProcess (stop it by PID)."""
    from kiln.devstack.processes import start_process, wait_until

    argv = [sys.executable, "-m", "examples.envs", "counter", "--port", str(port)]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    proc = start_process(name, argv, log_path=Path(root) / "logs" / f"{name}.log", env=_child_env({}), cwd=REPO_ROOT)
    proc.ports = [port]
    wait_until(lambda: _http_ok(f"http://{LOOPBACK}:{port}/health"), timeout_s=60,
               what=f"{name} on port {port}", process=proc)
    return proc


# =============================================================================== figures

FIGURES: list[dict[str, Any]] = []


def record(case: str, **figures: Any) -> None:
    """Keep (and print, visible with ``pytest -s``) one case's recovery figures."""
    entry = {"case": case, **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in figures.items()}}
    FIGURES.append(entry)
    print(f"\n[chaos] {json.dumps(entry, default=str)}", flush=True)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
