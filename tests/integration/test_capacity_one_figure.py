"""One capacity figure (issue 41): ``environment_capacity.<url>.refusals`` in a collection's
figures (what run status sums) and in the replay report, checked against the server's own count.

The server is the real ``openenv`` counter with ONE session, behind an ASGI wrapper that counts
every ``CAPACITY_REACHED`` frame it sends (``tests.support.refusal_counting_server``): the
brute-force count. The bundle carries no capacity figure (refusals are wall-clock facts; reruns
write the same bytes), and it still verifies.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any, Iterator
from urllib.request import urlopen

import pytest

from kiln.core.canonical import canonical_json
from kiln.core.contracts import reset_payload, reset_plan_sha256
from kiln.core.openenv.capacity import CAPACITY
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.openenv.urls import normalize_url
from kiln.core.rollout.bundle import build_bundle
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from kiln.core.rollout.replay_live import replay_bundle
from kiln.core.rollout.verify import verify_bundle
from tests.support.servers import serve_module
from tests.unit.test_verify_support import spec_for, write_bundle

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_module("tests.support.refusal_counting_server") as base_url:
        yield base_url


def server_refusals(url: str) -> int:
    with urlopen(f"{url}/_refusals", timeout=5) as reply:
        return int(json.loads(reply.read())["refusals"])


async def _collect(url: str, model_dir: Path) -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(model_dir)
    settings = EpisodeSettings(group_size=2, concurrency=2, max_steps=2, max_action_tokens=24, thinking=False)
    inspection = json.loads(canonical_json(await inspect_environment(url)))
    behavior_policy = {**runtime.identity(None), "adapter": None}
    documents, figures = [], []
    for g in range(2):
        task = GroupTask(
            run_id=f"run-{uuid.uuid4().hex[:8]}", group_index=g, environment_index=0, seed=60 + g,
            reset_payload=reset_payload({}, 60 + g), inspection=inspection, settings=settings,
            behavior_policy=behavior_policy,
        )
        collector = GroupCollector(task, runtime)
        documents.append(json.loads(canonical_json(await collector.run())))
        figures.append(collector.capacity_observed())
    files = build_bundle(
        documents, spec=spec_for(settings, seed_start=60), inspections=[inspection],
        behavior_policy=behavior_policy, reset_plan_sha256=reset_plan_sha256([{}]),
    )
    return files, figures


@pytest.mark.slow
def test_collection_and_replay_count_the_refusals_the_server_sent(url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    ws = normalize_url(url).websocket_url
    CAPACITY.forget(ws)  # the limit is learned from the first refusal, in this process
    before = server_refusals(url)
    files, figures = asyncio.run(_collect(url, tiny_model_dir))
    collected = server_refusals(url) - before
    # A first wave of 2 on a 1-session server meets one refusal; later waves are of 1.
    assert collected == 1
    assert sum(f["refusals"] for f in figures) == collected  # what run status adds up
    assert [f["sessions_granted_max"] for f in figures] == [1, 1]

    summary_path = write_bundle(tmp_path, files)
    summary = json.loads(files["summary.json"])
    replay = json.loads(files["replay.json"])
    assert not [key for key in summary["stats"] if "capacity" in key]
    assert all("capacity_retries" not in record for record in summary["rollouts"])
    assert all("capacity_retries" not in c for g in replay["groups"] for c in g["candidates"])
    verify_bundle(summary_path)

    before = server_refusals(url)
    report = asyncio.run(replay_bundle(summary_path, concurrency=4))  # 4 candidates, 1 session
    replayed = server_refusals(url) - before
    assert replayed > 0
    assert report["environment_capacity"] == {url: {"refusals": replayed}}
