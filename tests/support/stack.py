"""Pytest-usable helpers that start real servers on free loopback ports (not a conftest).

Owns: starting a throw-away Temporal dev server and SeaweedFS for a test, and checking that a
stopped process left nothing listening. Every helper returns the :class:`ManagedProcess` so the
caller stops it by PID (``proc.stop()``), typically in a fixture's teardown.
"""

from __future__ import annotations

from pathlib import Path

from kiln.devstack import start_seaweedfs, start_temporal
from kiln.devstack.processes import ManagedProcess, ProcessStartError, free_port_block, port_accepts

TEST_ACCESS_KEY = "kiln-test-access"
TEST_SECRET_KEY = "kiln-test-secret-key"

__all__ = [
    "TEST_ACCESS_KEY",
    "TEST_SECRET_KEY",
    "start_test_temporal",
    "start_test_seaweedfs",
    "listening_ports",
    "assert_nothing_listening",
    "pid_listening_sockets",
]


def start_test_temporal(
    tmp_dir: Path, *, headless: bool = True, attempts: int = 3
) -> tuple[ManagedProcess, str]:
    """A Temporal dev server with a db file under ``tmp_dir``; returns (process, address).

    Retries on a fresh port block if another process grabbed the chosen port meanwhile.
    """
    tmp_dir = Path(tmp_dir)
    last: Exception | None = None
    for _ in range(attempts):
        port, ui_port = free_port_block(2, grpc_offset=None)
        try:
            proc = start_temporal(
                tmp_dir / "temporal",
                port=port,
                ui_port=ui_port,
                log_dir=tmp_dir / "logs",
                headless=headless,
            )
        except ProcessStartError as exc:  # most likely a port race; try another block
            last = exc
            continue
        return proc, f"127.0.0.1:{port}"
    raise RuntimeError(f"could not start a test Temporal server: {last}")


def start_test_seaweedfs(
    tmp_dir: Path, bucket: str = "kiln-test", *, attempts: int = 3
) -> tuple[ManagedProcess, str, str, str]:
    """A SeaweedFS S3 server with data under ``tmp_dir`` and ``bucket`` created.

    Returns (process, endpoint, access_key, secret_key).
    """
    tmp_dir = Path(tmp_dir)
    last: Exception | None = None
    for _ in range(attempts):
        (s3_port,) = free_port_block(1)
        try:
            proc = start_seaweedfs(
                tmp_dir / "seaweedfs",
                s3_port=s3_port,
                access_key=TEST_ACCESS_KEY,
                secret_key=TEST_SECRET_KEY,
                bucket=bucket,
                log_dir=tmp_dir / "logs",
            )
        except ProcessStartError as exc:
            last = exc
            continue
        return proc, f"http://127.0.0.1:{s3_port}", TEST_ACCESS_KEY, TEST_SECRET_KEY
    raise RuntimeError(f"could not start a test SeaweedFS server: {last}")


def listening_ports(proc: ManagedProcess) -> list[int]:
    """Those of ``proc.ports`` that still accept TCP connections."""
    return [p for p in proc.ports if port_accepts(p, timeout_s=0.2)]


def pid_listening_sockets(pid: int) -> int:
    """Number of listening TCP sockets owned by ``pid`` (0 when it no longer exists)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return 0
    inodes = set()
    for fd in fds:
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                count += 1
    return count


def assert_nothing_listening(proc: ManagedProcess) -> None:
    """Fail when ``proc`` is still alive or any of its known ports still accepts connections."""
    assert not proc.alive(), f"{proc.name} (pid {proc.pid}) is still running"
    left = listening_ports(proc)
    assert not left, f"{proc.name} (pid {proc.pid}) left ports listening: {left}"
