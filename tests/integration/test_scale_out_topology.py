"""The production topology without Docker: two gpu worker processes on one queue, one killed.

Temporal here is a dev server the test started *without* Kiln's search attributes (the control
worker creates them); SeaweedFS runs with an explicit identity file and a random secret; the run is
started and followed through the Kiln API with its bearer token. A run's groups are executed by
both gpu workers (worker identity per group in status); after ``kill -9`` of one gpu worker while
it collects a group, the other finishes the run with artifacts byte-identical to the undisturbed run.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from kiln.core.search_attributes import SEARCH_ATTRIBUTES
from kiln.core.settings import Settings
from tests.support.stack import assert_nothing_listening
from tests.support.topology import Topology
from workers.client import connect_client

GROUPS = 8


def rollout_request(env_url: str, groups: int = GROUPS) -> dict[str, Any]:
    return {
        "kind": "rollout",
        "environment_urls": [env_url],
        "groups": groups,
        "group_size": 2,
        "max_steps": 3,
        "max_action_tokens": 32,
        "thinking": False,
    }


@pytest.fixture(scope="module")
def topology(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    # The chaos stack's short heartbeat timeout: the killed worker's group is retried seconds later.
    topo = Topology(root=tmp_path_factory.mktemp("topology"), model_path=tiny_model_dir, heartbeat_timeout_s=3.0)
    try:
        topo.start_servers().start_kiln(gpu_workers=2)
        yield topo
    finally:
        for proc in topo.close():
            assert_nothing_listening(proc)


def _identity(pid: int) -> str:
    return f"{pid}@{socket.gethostname()}"


def _start(topo: Topology, groups: int = GROUPS) -> str:
    code, body = topo.api_call("POST", "/v1/openenv/runs", rollout_request(topo.env_url, groups))
    assert code == 202, body
    return body["run_id"]


def _digests(status: dict[str, Any]) -> dict[str, str]:
    # metrics.jsonl holds wall-clock figures: the reproducible artifacts are the others.
    return {a["name"]: a["sha256"] for a in status["artifacts"] if a["name"] != "metrics.jsonl"}


async def _victim_collecting(topo: Topology, run_id: str, identity: str, timeout_s: float) -> dict[str, Any]:
    """Wait until ``identity`` runs a collect_group of ``run_id`` mid-episode; returns its details."""
    client = await connect_client(Settings(temporal_address=topo.temporal_address))
    handle = client.get_workflow_handle(run_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        described = await handle.describe()
        for pending in described.raw_description.pending_activities:
            if (pending.activity_type.name == "collect_group" and pending.last_worker_identity == identity
                    and pending.attempt == 1 and pending.heartbeat_details.payloads):
                details = await client.data_converter.decode(pending.heartbeat_details.payloads)
                if isinstance(details[-1], dict) and details[-1].get("step"):
                    return details[-1]
        await asyncio.sleep(0.05)
    raise AssertionError(f"{identity} never collected a group of {run_id} within {timeout_s}s")


@pytest.mark.timeout(900)
def test_two_gpu_workers_share_a_run_and_survive_a_kill(topology: Topology) -> None:
    topo = topology
    # The control worker created Kiln's search attributes on a server that had none.
    async def custom() -> set[str]:
        from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

        client = await connect_client(Settings(temporal_address=topo.temporal_address))
        listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace="default"))
        return set(listed.custom_attributes)

    assert set(SEARCH_ATTRIBUTES) <= asyncio.run(custom())
    identities = {_identity(proc.pid) for proc in topo.gpus}

    # A fresh worker's first group pays its one-time model warm-up (seconds here): warm both up.
    warm = topo.wait_run(_start(topo, groups=4), timeout_s=400)
    assert warm["state"] == "completed", warm.get("failure")

    # 1. Undisturbed: both gpu workers executed groups of the same run.
    started = time.monotonic()
    reference = topo.wait_run(_start(topo), timeout_s=400)
    reference_s = time.monotonic() - started
    assert reference["state"] == "completed", reference.get("failure")
    groups = reference["progress"]["groups"]
    assert sorted(g["group_index"] for g in groups) == list(range(GROUPS))
    by_worker = {g["worker"] for g in groups}
    assert by_worker == identities, (by_worker, identities)
    assert reference["progress"]["groups_completed"] == GROUPS and reference["interruptions"] == []

    # 2. kill -9 one gpu worker while it collects a group: the other one finishes the run.
    victim, survivor = topo.gpus
    topo.delay_file("gpu-0").write_text("0.3")  # the victim's groups now take seconds: the kill lands mid-group
    run_id = _start(topo)
    seen = asyncio.run(_victim_collecting(topo, run_id, _identity(victim.pid), timeout_s=300))
    victim.kill()
    topo.delay_file("gpu-0").unlink()
    final = topo.wait_run(run_id, timeout_s=400)
    assert final["state"] == "completed", final.get("failure")
    assert _digests(final) == _digests(reference)  # byte-identical artifacts
    groups = {g["group_index"]: g for g in final["progress"]["groups"]}
    assert sorted(groups) == list(range(GROUPS))
    redone = groups[seen["group_index"]]
    assert redone["worker"] == _identity(survivor.pid) and redone["attempt"] >= 2, redone
    interrupted = {item["group_index"] for item in final["interruptions"]}
    assert seen["group_index"] in interrupted
    assert all(g["worker"] == _identity(survivor.pid) for i, g in groups.items() if i in interrupted)
    print(f"\n[topology] reference run {reference_s:.1f}s; groups by worker "
          f"{sorted((g['worker'], g['group_index']) for g in reference['progress']['groups'])}; "
          f"killed mid-group {seen['group_index']}, interrupted {sorted(interrupted)}")
