"""``kiln serve``: the embedded stack (Temporal + SeaweedFS unless configured) + workers + API.

Each part is a supervised child process (:mod:`kiln.devstack.supervisor`): Temporal, SeaweedFS,
one worker process per role (``control-worker``, ``gpu-worker``) and the API. A child that dies
is restarted with backoff, the others keep running; ``<home>/run/serve.json`` shows each
child's state, pid and restarts (the API's ``/healthz`` the same without PIDs). Everything this
command starts is stopped by PID on Ctrl-C/SIGTERM; data under ``KILN_HOME`` (default ``.kiln``)
survives restarts, so runs and artifacts are kept.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from rich.console import Console

from kiln.core.access_rule import required_token
from kiln.client.http import ApiClient
from kiln.devstack import DevStack, DevStackError, start_devstack
from kiln.devstack.processes import ManagedProcess, ProcessStartError, start_process, wait_until
from kiln.devstack.stack import check_stack_config
from kiln.devstack.supervisor import Supervisor, SupervisorGaveUp
from kiln.core.home import PRIVATE_UMASK, secure_home, write_private_json
from kiln.core.errors import ServeConfigurationInvalid, ServeGaveUp, ServeStartFailed
from kiln.core.settings import Settings

SUPERVISE_INTERVAL_S = 0.5
RESECURE_INTERVAL_S = 60.0
WORKER_ROLES = ("control", "gpu")  # the roles of ``python -m workers``, one process each


def ensure_model(settings: Settings, console: Console) -> Path:
    """``KILN_MODEL_PATH`` if set (must exist, of a model family the engine serves:
    ``model_unsupported`` otherwise), else the demo's tiny model (built on first use)."""
    if settings.model_path is not None:
        path = Path(settings.model_path)
        if not (path / "config.json").is_file():
            from kiln.core.errors import ModelNotFound

            raise ModelNotFound(
                f"KILN_MODEL_PATH={path} is not a local model folder (no config.json)",
                hint="point KILN_MODEL_PATH at a folder saved with save_pretrained, or unset it "
                "to use the tiny demo model",
            )
        from kiln.core.policy.families import require_servable

        require_servable(path, settings.engine, cpu=True if settings.device == "cpu" else None)
        return path.resolve()
    path = settings.default_model_path
    if not (path / "config.json").is_file():
        console.print(f"building the tiny demo model in {path} …")
        from kiln.core.policy.tiny import build_tiny_model

        build_tiny_model(path)
    return path.resolve()


def _api_healthy(url: str) -> bool:
    with ApiClient(url, timeout_s=5.0) as api:
        return api.alive()


def check_serve_config(settings: Settings) -> None:
    """The whole configuration, checked before anything starts: the API token rule, and every
    port (Temporal, its UI, S3 and its +10000 gRPC twin, the API) in range, distinct and free."""
    required_token(settings)
    try:
        check_stack_config(settings, extra_ports=((settings.api_port, "Kiln API", "KILN_API_PORT"),))
    except DevStackError as exc:
        raise ServeConfigurationInvalid(str(exc)) from None


def _python_child(name: str, args: list[str], *, logs: Path, env: dict[str, str]) -> Callable[[], ManagedProcess]:
    def start() -> ManagedProcess:
        return start_process(name, [sys.executable, *args], log_path=logs / f"{name}.log", env=env)

    return start


def _api_child(settings: Settings, *, logs: Path, env: dict[str, str]) -> Callable[[], ManagedProcess]:
    url = f"http://{settings.api_host}:{settings.api_port}"
    launch = _python_child(
        "api",
        [
            "-m",
            "uvicorn",
            "--factory",
            "api.app:app_from_env",
            "--host",
            settings.api_host,
            "--port",
            str(settings.api_port),
            "--log-level",
            "warning",
        ],
        logs=logs,
        env=env,
    )

    def start() -> ManagedProcess:
        proc = launch()
        try:
            wait_until(lambda: _api_healthy(url), timeout_s=60, what=f"the Kiln API on {url}", process=proc)
        except BaseException:
            proc.stop()
            raise
        return proc

    return start


# The embedded dev server has no TLS or auth, and loopback ports are shared by every local user.
TEMPORAL_OPEN = "open_to_local_users"
TEMPORAL_OPEN_LINE = (
    "warning: the embedded Temporal and its Web UI answer every local user (the dev server "
    "has no TLS or auth); docs/durability.md names the closed set-up"
)


def _child_env(home: Path, stack: DevStack, model_path: Path) -> dict[str, str]:
    """The workers' and the API's environment: this process's, pointed at the stack just started."""
    env = dict(os.environ)
    env.update(
        {
            "KILN_HOME": str(home),
            "KILN_TEMPORAL_ADDRESS": stack.temporal_address,
            "KILN_S3_ENDPOINT": stack.s3_endpoint,
            "KILN_MODEL_PATH": str(model_path),
            "HF_HUB_OFFLINE": "1",
        }
    )
    if stack.temporal_ui_url:
        env["KILN_TEMPORAL_UI_URL"] = stack.temporal_ui_url
    return env


def _print_stack(
    console: Console,
    settings: Settings,
    stack: DevStack,
    *,
    api_url: str,
    model_path: Path,
    logs: Path,
    supervisor: Supervisor,
) -> None:
    console.print(f"kiln api      {api_url}")
    console.print(f"temporal      {stack.temporal_address}")
    if stack.temporal_ui_url:
        console.print(f"web ui        {stack.temporal_ui_url}")
    console.print(f"s3            {stack.s3_endpoint} (bucket {settings.s3_bucket})")
    console.print(f"model         {model_path}")
    console.print(f"logs          {logs}")
    console.print(f"supervising   {', '.join(child.name for child in supervisor.children)}")
    if settings.temporal_address is None:
        console.print(f"[yellow]{TEMPORAL_OPEN_LINE}[/]")


def _supervise(supervisor: Supervisor, stop: threading.Event, home: Path) -> None:
    """Until ``stop``: restart dead children (the supervisor's rule) and keep KILN_HOME private."""
    secured_at = time.monotonic()
    while not stop.is_set():
        if time.monotonic() - secured_at >= RESECURE_INTERVAL_S:
            secure_home(home)  # some files are chmod-ed 0644 by SeaweedFS itself
            secured_at = time.monotonic()
        try:
            supervisor.check()
        except SupervisorGaveUp as exc:
            raise ServeGaveUp(str(exc), hint="fix the cause in that log, then start `kiln serve` again") from None
        stop.wait(SUPERVISE_INTERVAL_S)


def serve(settings: Settings, console: Console, *, ready_file: Path | None = None) -> None:
    """Run and supervise the stack until Ctrl-C/SIGTERM (see :mod:`kiln.devstack.supervisor`).

    Refuses a bad configuration before starting anything; if a first start fails, stops everything
    it had started before raising. Afterwards a child that dies is restarted with backoff; one
    that keeps failing right after each restart stops the whole stack with one line."""
    home = Path(settings.home).resolve()
    check_serve_config(settings)
    os.umask(PRIVATE_UMASK)  # everything serve and its children write is the owner's only
    secure_home(home)
    model_path = ensure_model(settings, console)
    stack: DevStack | None = None
    stop = threading.Event()
    status_path = home / "run" / "serve.json"
    info: dict[str, object] = {}

    def publish() -> None:
        if info:
            write_private_json(status_path, {**info, "components": supervisor.snapshot()})

    supervisor = Supervisor(on_event=lambda line: console.print(f"[yellow]{line}[/]"), on_change=publish)

    def _stop(*_args: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        try:
            stack = start_devstack(settings)
            for proc in list(stack.processes):
                supervisor.adopt(proc.name, proc, partial(stack.restart, proc.name))
        except (DevStackError, ProcessStartError) as exc:
            raise ServeStartFailed(str(exc).splitlines()[0]) from None
        env = _child_env(home, stack, model_path)
        logs = home / "logs"
        api_url = f"http://{settings.api_host}:{settings.api_port}"
        try:
            # One process per worker role: a gpu worker that dies leaves the control worker polling.
            for role in WORKER_ROLES:
                supervisor.launch(
                    f"{role}-worker", _python_child(f"{role}-worker", ["-m", "workers", role], logs=logs, env=env)
                )
            supervisor.launch("api", _api_child(settings, logs=logs, env=env))
        except ProcessStartError as exc:
            raise ServeStartFailed(str(exc).splitlines()[0]) from None
        info.update(
            {
                "pid": os.getpid(),
                "api_url": api_url,
                "temporal_address": stack.temporal_address,
                "temporal_ui": stack.temporal_ui_url or None,
                "s3_endpoint": stack.s3_endpoint,
                "model_path": str(model_path),
                **({"temporal_exposure": TEMPORAL_OPEN} if settings.temporal_address is None else {}),
            }
        )
        publish()
        _print_stack(console, settings, stack, api_url=api_url, model_path=model_path, logs=logs, supervisor=supervisor)
        console.print("ready — Ctrl-C stops everything this command started")
        if ready_file is not None:
            ready_file.write_text(json.dumps(info))
        _supervise(supervisor, stop, home)
    finally:
        supervisor.stop()
        if stack is not None:
            stack.stop()
        try:
            status_path.unlink()
        except FileNotFoundError:
            pass
        console.print("stopped")
