"""The embedded default stack: start what ``settings`` does not point elsewhere, stop it by PID.

PID files under ``<home>/run`` let a second ``kiln serve`` of the same home explain a port clash.
"""

from __future__ import annotations

import time
from functools import partial
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.devstack.common import GRPC_OFFSET, DevStackError
from kiln.devstack.isolation import choose_exposure
from kiln.devstack.processes import LOOPBACK, ManagedProcess, ProcessStartError, port_is_free
from kiln.devstack.seaweedfs import start_seaweedfs
from kiln.devstack.temporal import start_temporal
from kiln.core.home import make_private_dir, secure_home, write_private
from kiln.core.settings import Settings


@dataclass
class DevStack:
    """The running embedded stack (only the parts this process started are in ``processes``)."""

    temporal_address: str
    temporal_ui_url: str  # "" when Temporal is external
    s3_endpoint: str
    #: who can reach the embedded Temporal (``owner_only`` / ``open_to_local_users``); "" when external
    temporal_exposure: str = ""
    processes: list[ManagedProcess] = field(default_factory=list)
    pid_files: list[Path] = field(default_factory=list)
    #: how to start each embedded server again (same ports, same data), by process name
    starters: dict[str, Callable[[], ManagedProcess]] = field(default_factory=dict)

    def restart(self, name: str) -> ManagedProcess:
        """Start the embedded server ``name`` again (after it died) and track the new process."""
        self.processes = [proc for proc in self.processes if proc.name != name]
        proc = self.starters[name]()
        self.processes.append(proc)
        return proc

    def stop(self) -> None:
        """Stop every process this stack started, by PID, in reverse start order. Idempotent."""
        for proc in reversed(self.processes):
            proc.stop()
        for pid_file in self.pid_files:
            try:
                pid_file.unlink()
            except FileNotFoundError:
                pass
        self.pid_files = []

    def __enter__(self) -> DevStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _pid_alive_with(pid: int, marker: str) -> bool:
    """True when process ``pid`` exists and its command line mentions ``marker``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", errors="replace")
    except OSError:
        return False
    return marker in cmdline


def _check_port_for_home(port: int, *, what: str, setting: str, home: Path, pid_file: Path, marker: str) -> None:
    if port_is_free(port, reuse_addr=True):
        return
    previous = None
    try:
        previous = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    if previous is not None and _pid_alive_with(previous, marker):
        raise DevStackError(
            f"port {port} ({what}) is in use by a previous `kiln serve` of this home ({home}): "
            f"pid {previous} still runs. Stop that `kiln serve` first (Ctrl-C it, or "
            f"`kill {previous}`), or point {setting} at another free port."
        )
    raise DevStackError(
        f"port {port} ({what}) is already in use by another program; stop it, or set "
        f"{setting} to a free port"
        + (
            " (or set KILN_TEMPORAL_ADDRESS to use that server)"
            if setting == "KILN_TEMPORAL_PORT"
            else " (or set KILN_S3_ENDPOINT to use that server)"
            if setting == "KILN_S3_PORT"
            else ""
        )
    )


def _port_checks(settings: Settings) -> list[tuple[int, str, str, Path, str]]:
    """Every port the embedded stack would bind: (port, what, setting, pid file, marker)."""
    home = Path(settings.home).resolve()
    run_dir = home / "run"
    checks: list[tuple[int, str, str, Path, str]] = []
    if not settings.temporal_address:
        marker = str(home / "temporal" / "temporal.db")
        checks += [
            (settings.temporal_port, "Temporal frontend", "KILN_TEMPORAL_PORT", run_dir / "temporal.pid", marker),
            (settings.temporal_ui_port, "Temporal Web UI", "KILN_TEMPORAL_UI_PORT", run_dir / "temporal.pid", marker),
        ]
    if not settings.s3_endpoint:
        marker = f"-dir={home / 'seaweedfs'}"
        checks += [
            (settings.s3_port, "SeaweedFS S3", "KILN_S3_PORT", run_dir / "seaweedfs.pid", marker),
            (
                settings.s3_port + GRPC_OFFSET,
                "SeaweedFS S3 gRPC (S3 port + 10000)",
                "KILN_S3_PORT",
                run_dir / "seaweedfs.pid",
                marker,
            ),
        ]
    return checks


def check_stack_config(settings: Settings, extra_ports: tuple[tuple[int, str, str], ...] = ()) -> None:
    """Refuse (``DevStackError``, one line) a configuration that can not start, before anything
    starts: every port (the stack's, its +10000 gRPC twins, and ``extra_ports`` such as the API's)
    must be in 1-65535, distinct, and free."""
    home = Path(settings.home).resolve()
    checks = _port_checks(settings)
    ports = [(port, what, setting) for port, what, setting, _pid, _marker in checks]
    ports += list(extra_ports)
    seen: dict[int, str] = {}
    for port, what, setting in ports:
        if not 0 < port < 65536:
            raise DevStackError(f"{setting}: port {port} ({what}) is outside 1-65535")
        if port in seen:
            raise DevStackError(f"{setting}: port {port} ({what}) is also used by {seen[port]}; choose distinct ports")
        seen[port] = what
    for port, what, setting, pid_file, marker in checks:
        _check_port_for_home(port, what=what, setting=setting, home=home, pid_file=pid_file, marker=marker)
    for port, what, setting in extra_ports:
        if not port_is_free(port, reuse_addr=True):
            raise DevStackError(
                f"port {port} ({what}) is already in use by another program; stop it, or set {setting} to a free port"
            )


def start_devstack(settings: Settings) -> DevStack:
    """Start whatever part of the embedded stack ``settings`` does not point elsewhere.

    With ``KILN_TEMPORAL_ADDRESS`` set no Temporal is started; with ``KILN_S3_ENDPOINT`` set no
    SeaweedFS is started. Data lives under ``settings.home`` (``temporal/``, ``seaweedfs/``,
    ``logs/``; PID files in ``run/``). Every port is checked before anything starts; a start that
    still fails stops whatever this call had started.
    """
    home = Path(settings.home).resolve()
    run_dir = home / "run"
    log_dir = home / "logs"
    temporal_dir = home / "temporal"
    seaweed_dir = home / "seaweedfs"
    start_temporal_here = not settings.temporal_address
    start_s3_here = not settings.s3_endpoint
    check_stack_config(settings)
    secure_home(home)
    access_key, secret_key = settings.s3_key_pair() if start_s3_here else ("", "")

    stack = DevStack(
        temporal_address=settings.effective_temporal_address,
        temporal_ui_url="",
        s3_endpoint=settings.effective_s3_endpoint,
    )
    if start_temporal_here:
        exposure = choose_exposure(settings.temporal_isolation)
        temporal = partial(start_temporal, temporal_dir, port=settings.temporal_port, ui_port=settings.temporal_ui_port)
        _add_starter(stack, "temporal", run_dir, partial(temporal, log_dir=log_dir, exposure=exposure))
        stack.temporal_address = f"{LOOPBACK}:{settings.temporal_port}"
        stack.temporal_ui_url = f"http://{LOOPBACK}:{settings.temporal_ui_port}"
        stack.temporal_exposure = exposure
    if start_s3_here:
        seaweedfs = partial(start_seaweedfs, seaweed_dir, s3_port=settings.s3_port, bucket=settings.s3_bucket)
        _add_starter(
            stack,
            "seaweedfs",
            run_dir,
            partial(seaweedfs, access_key=access_key, secret_key=secret_key, log_dir=log_dir),
        )
        stack.s3_endpoint = f"http://{LOOPBACK}:{settings.s3_port}"
    try:
        for start in stack.starters.values():
            stack.processes.append(start())
    except BaseException:
        stack.stop()
        raise
    return stack


def _add_starter(stack: DevStack, name: str, run_dir: Path, start: Callable[[], ManagedProcess]) -> None:
    """Register ``start`` as the stack's ``name`` process, writing ``<run_dir>/<name>.pid`` once it runs."""
    pid_file = run_dir / f"{name}.pid"

    def starter() -> ManagedProcess:
        proc = start()
        _write_pid(pid_file, proc)
        return proc

    stack.starters[name] = starter
    stack.pid_files.append(pid_file)


def _write_pid(path: Path, proc: ManagedProcess) -> Path:
    make_private_dir(path.parent)
    write_private(path, f"{proc.pid} {int(time.time())}\n")
    return path


# Re-exported so callers can catch start failures from one place.
StartError = (DevStackError, ProcessStartError)
