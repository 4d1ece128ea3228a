"""Worker start against a Temporal that Kiln did not start: search attributes, retries, one-line errors.

The Temporal dev servers here are started by the test itself with their own db file and without
Kiln's search attributes (like a fresh compose cluster or an existing company cluster).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

from kiln.core.errors import TemporalUnavailable
from kiln.core.search_attributes import SEARCH_ATTRIBUTES
from kiln.core.settings import Settings
from kiln.devstack.processes import free_port_block, start_process, wait_until
from tests.support.topology import REPO_ROOT, child_env, start_bare_temporal
from workers.client import connect_client, connect_with_retry
from workers.search_attributes import ensure_search_attributes

KEYWORD = IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD


async def _custom(address: str) -> dict[str, int]:
    client = await connect_client(Settings(temporal_address=address))
    listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace="default"))
    return dict(listed.custom_attributes)


def _workers(role: str, address: str, home: Path, timeout_s: float = 90, **extra: str) -> subprocess.CompletedProcess:
    env = child_env({"KILN_TEMPORAL_ADDRESS": address, "KILN_HOME": str(home), **extra})
    return subprocess.run([sys.executable, "-m", "workers", role], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(180)
def test_ensure_creates_missing_attributes_idempotently(tmp_path: Path) -> None:
    proc, address = start_bare_temporal(tmp_path, search_attributes={"KilnPhase": "Keyword"})
    try:
        assert set(asyncio.run(_custom(address))) & set(SEARCH_ATTRIBUTES) == {"KilnPhase"}
        first = _workers("ensure-search-attributes", address, tmp_path / "home")
        assert first.returncode == 0, first.stderr
        missing = sorted(set(SEARCH_ATTRIBUTES) - {"KilnPhase"})
        assert f"created search attributes {', '.join(sorted(missing, key=list(SEARCH_ATTRIBUTES).index))}" in first.stdout
        custom = asyncio.run(_custom(address))
        assert {name: custom[name] for name in SEARCH_ATTRIBUTES} == {name: KEYWORD for name in SEARCH_ATTRIBUTES}
        again = _workers("ensure-search-attributes", address, tmp_path / "home")
        assert again.returncode == 0 and "created" not in again.stdout, again.stdout + again.stderr

        async def racing() -> list[list[str]]:  # several workers starting at once: all succeed
            client = await connect_client(Settings(temporal_address=address))
            return await asyncio.gather(*(ensure_search_attributes(client, "default") for _ in range(3)))

        assert asyncio.run(racing()) == [[], [], []]
    finally:
        proc.stop()


@pytest.mark.timeout(180)
def test_refusing_namespace_fails_with_one_line_naming_the_command(tmp_path: Path) -> None:
    # The dev server allows 10 Keyword attributes: a full table refuses Kiln's, like a namespace
    # where the worker lacks the permission (Temporal Cloud).
    fillers = {f"Other{i}": "Keyword" for i in range(10)}
    proc, address = start_bare_temporal(tmp_path, search_attributes=fillers)
    try:
        out = _workers("gpu", address, tmp_path / "home")
        assert out.returncode == 1, out.stdout + out.stderr
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, out.stderr
        names = " ".join(f"--name {name}" for name in SEARCH_ATTRIBUTES)
        expected = f"temporal operator search-attribute create --namespace default {names} --type Keyword"
        assert lines[0].startswith("error: temporal_search_attributes_missing: ") and expected in lines[0]
        assert "Traceback" not in out.stderr and "polling" not in out.stdout
        assert not set(asyncio.run(_custom(address))) & set(SEARCH_ATTRIBUTES)  # nothing half-created
    finally:
        proc.stop()


@pytest.mark.timeout(60)
def test_connect_retry_is_bounded_and_names_the_address() -> None:
    (port,) = free_port_block(1, grpc_offset=None)
    settings = Settings(temporal_address=f"127.0.0.1:{port}", temporal_api_key=None)
    with pytest.raises(TemporalUnavailable) as failed:
        asyncio.run(connect_with_retry(settings, timeout_s=1.5))
    assert failed.value.code == "temporal_unavailable"
    assert f"127.0.0.1:{port}" in failed.value.message and "attempts" in failed.value.message


@pytest.mark.timeout(180)
def test_worker_started_before_temporal_waits_then_polls(tmp_path: Path) -> None:
    (port,) = free_port_block(1, grpc_offset=None)
    env = child_env({"KILN_TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "KILN_HOME": str(tmp_path / "home"),
                     "KILN_S3_ENDPOINT": "http://127.0.0.1:9", "KILN_TEMPORAL_CONNECT_TIMEOUT_S": "120"})
    log = tmp_path / "logs" / "worker.log"
    worker = start_process("worker-control", [sys.executable, "-m", "workers", "control"], log_path=log,
                           env=env, cwd=REPO_ROOT)
    server = None
    try:
        wait_until(lambda: log.read_text().count("not reachable") >= 2, timeout_s=60,
                   what="two logged connection retries", process=worker)
        server, _ = start_bare_temporal(tmp_path, port=port)
        wait_until(lambda: "polling" in log.read_text(), timeout_s=90, what="the worker to poll", process=worker)
        text = log.read_text()
        assert "created search attributes KilnPhase" in text and "Traceback" not in text
    finally:
        worker.stop()
        if server is not None:
            server.stop()


@pytest.mark.timeout(120)
def test_visibility_probe_finds_missing_attributes(tmp_path: Path) -> None:
    """Where listing is denied (Temporal Cloud keys), visibility queries tell present from missing."""
    from workers.search_attributes import missing_by_query

    proc, address = start_bare_temporal(tmp_path, search_attributes={"KilnPhase": "Keyword", "KilnStatus": "Keyword"})
    try:
        async def probe() -> dict[str, str]:
            client = await connect_client(Settings(temporal_address=address))
            return await missing_by_query(client, "default")

        assert asyncio.run(probe()) == {n: k for n, k in SEARCH_ATTRIBUTES.items() if n not in ("KilnPhase", "KilnStatus")}
    finally:
        proc.stop()
