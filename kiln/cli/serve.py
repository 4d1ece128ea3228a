"""``kiln serve``: the embedded stack (Temporal + SeaweedFS unless configured) + workers + API.

Everything this command starts is stopped by PID on Ctrl-C/SIGTERM; data under ``KILN_HOME``
(default ``.kiln``) survives restarts, so runs and artifacts are kept.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import httpx
from rich.console import Console

from kiln.access_rule import required_token
from kiln.devstack import DevStack, DevStackError, start_devstack
from kiln.devstack.processes import ManagedProcess, ProcessStartError, start_process, wait_until
from kiln.devstack.stack import check_stack_config
from kiln.errors import KilnError
from kiln.settings import Settings


def ensure_model(settings: Settings, console: Console) -> Path:
    """``KILN_MODEL_PATH`` if set (must exist), else the demo's tiny model (built on first use)."""
    if settings.model_path is not None:
        path = Path(settings.model_path)
        if not (path / "config.json").is_file():
            from kiln.errors import ModelNotFound

            raise ModelNotFound(
                f"KILN_MODEL_PATH={path} is not a local model folder (no config.json)",
                hint="point KILN_MODEL_PATH at a folder saved with save_pretrained, or unset it "
                "to use the tiny demo model",
            )
        return path.resolve()
    path = settings.default_model_path
    if not (path / "config.json").is_file():
        console.print(f"building the tiny demo model in {path} …")
        from kiln.policy.tiny import build_tiny_model

        build_tiny_model(path)
    return path.resolve()


def _api_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class ServeConfigurationInvalid(KilnError):
    """``kiln serve`` refused its configuration; nothing was started."""

    code = "serve_configuration_invalid"


class ServeStartFailed(KilnError):
    """A part of ``kiln serve`` failed to start; everything it had started was stopped."""

    code = "serve_start_failed"


def check_serve_config(settings: Settings) -> None:
    """The whole configuration, checked before anything starts: the API token rule, and every
    port (Temporal, its UI, S3 and its +10000 gRPC twin, the API) in range, distinct and free."""
    required_token(settings)
    try:
        check_stack_config(
            settings, extra_ports=((settings.api_port, "Kiln API", "KILN_API_PORT"),)
        )
    except DevStackError as exc:
        raise ServeConfigurationInvalid(str(exc)) from None


def serve(settings: Settings, console: Console, *, ready_file: Path | None = None) -> None:
    """Run the stack until Ctrl-C/SIGTERM. Refuses a bad configuration before starting anything;
    if a start fails later, stops everything it had started before raising."""
    home = Path(settings.home).resolve()
    check_serve_config(settings)
    model_path = ensure_model(settings, console)
    processes: list[ManagedProcess] = []
    stack: DevStack | None = None
    stop = threading.Event()

    def _stop(*_args: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        try:
            stack = start_devstack(settings)
        except (DevStackError, ProcessStartError) as exc:
            raise ServeStartFailed(str(exc).splitlines()[0]) from None
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
        logs = home / "logs"
        processes.append(
            start_process("workers", [sys.executable, "-m", "workers", "all"], log_path=logs / "workers.log", env=env)
        )
        api_url = f"http://{settings.api_host}:{settings.api_port}"
        processes.append(
            start_process(
                "api",
                [
                    sys.executable, "-m", "uvicorn", "--factory", "api.app:app_from_env",
                    "--host", settings.api_host, "--port", str(settings.api_port), "--log-level", "warning",
                ],
                log_path=logs / "api.log",
                env=env,
            )
        )
        try:
            wait_until(lambda: _api_healthy(api_url), timeout_s=60, what=f"the Kiln API on {api_url}",
                       process=processes[-1])
        except ProcessStartError as exc:
            raise ServeStartFailed(str(exc).splitlines()[0]) from None
        info = {
            "pid": os.getpid(),
            "api_url": api_url,
            "temporal_address": stack.temporal_address,
            "temporal_ui": stack.temporal_ui_url or None,
            "s3_endpoint": stack.s3_endpoint,
            "model_path": str(model_path),
        }
        (home / "run").mkdir(parents=True, exist_ok=True)
        (home / "run" / "serve.json").write_text(json.dumps(info, indent=2) + "\n")
        console.print(f"kiln api      {api_url}")
        console.print(f"temporal      {stack.temporal_address}")
        if stack.temporal_ui_url:
            console.print(f"web ui        {stack.temporal_ui_url}")
        console.print(f"s3            {stack.s3_endpoint} (bucket {settings.s3_bucket})")
        console.print(f"model         {model_path}")
        console.print(f"logs          {logs}")
        console.print("ready — Ctrl-C stops everything this command started")
        if ready_file is not None:
            ready_file.write_text(json.dumps(info))
        while not stop.is_set():
            for proc in processes:
                if not proc.alive():
                    console.print(f"[red]{proc.name} exited[/]; see {proc.log_path}")
                    stop.set()
            stop.wait(1.0)
    finally:
        for proc in reversed(processes):
            proc.stop()
        if stack is not None:
            stack.stop()
        try:
            (home / "run" / "serve.json").unlink()
        except FileNotFoundError:
            pass
        console.print("stopped")
