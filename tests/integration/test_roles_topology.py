"""Worker roles on real processes: 1 trainer + 2 sampler workers on one Temporal dev server.

The trainer (``python -m workers trainer``) trains across 2 gloo ranks (``KILN_TRAIN_DEVICES=2``)
and loads no policy runtime; the samplers (``python -m workers sampler``) collect and never
train. A 3-iteration online run, submitted through the API exactly as to one gpu worker, completes;
the downloaded run verifies offline (``verify --run``: every bundle, and the on-policy chain — the
adapter each iteration sampled with is the previous iteration's); Temporal's history shows every
``collect_group`` on a sampler (both of them) and every ``train_adapter`` on the trainer, on the
trainers' queue ``<gpu queue>@train``. The same run again, with one sampler killed once iteration 2
has begun and a fresh one (empty adapter cache) started: it completes with artifacts identical to
the first run's (but the receipts' wall-clock timings and metrics.jsonl), the fresh sampler
collects, and it fetched only adapters the run's iterations produced (by digest).
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from kiln.core.rollout.verify.run import verify_run
from kiln.core.settings import Settings
from tests.support.run_folders import download_run
from tests.support.stack import assert_nothing_listening
from tests.support.topology import Topology
from workers.client import connect_client
from workflows.names import train_task_queue

RUN = {
    "kind": "train",
    "groups": 8,
    "group_size": 4,
    "max_steps": 6,
    "max_action_tokens": 48,
    "thinking": False,
    # valid counter actions from the random tiny model, amounts spread by a hot temperature: some
    # episodes overshoot the target, so rewards vary within groups and every iteration trains
    "constrained_actions": True,
    "temperature": 4.0,
    "iterations": 3,
    "output_adapter": "counter-roles",
    "training_config": {"echo": None, "epochs": 1, "learning_rate": 5e-2},
}


def _identity(pid: int) -> str:
    return f"{pid}@{socket.gethostname()}"


async def _executions(topo: Topology, run_id: str) -> list[tuple[str, str, str]]:
    """``(activity type, task queue, worker identity)`` of every started activity of the run, over
    every execution of its chain (continue-as-new)."""
    from temporalio.api.enums.v1 import EventType

    client = await connect_client(Settings(temporal_address=topo.temporal_address))
    rows: list[tuple[str, str, str]] = []
    async for execution in client.list_workflows(f"WorkflowId = '{run_id}'"):
        history = await client.get_workflow_handle(run_id, run_id=execution.run_id).fetch_history()
        scheduled: dict[int, tuple[str, str]] = {}
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                attrs = event.activity_task_scheduled_event_attributes
                scheduled[event.event_id] = (attrs.activity_type.name, attrs.task_queue.name)
            elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                attrs = event.activity_task_started_event_attributes
                rows.append((*scheduled[attrs.scheduled_event_id], attrs.identity))
    return rows


def _wait_iteration(topo: Topology, run_id: str, iteration: int, timeout_s: float = 600) -> None:
    """Poll the run's status until it works on ``iteration`` (1-based)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code, status = topo.api_call("GET", f"/v1/openenv/runs/{run_id}")
        if code == 200 and (status.get("iteration") or 0) >= iteration:
            return
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} did not reach iteration {iteration}")


def _reproducible(status: dict) -> dict[str, str]:
    """Artifact digests but the wall-clock ones (metrics.jsonl, the receipts' phase timings)."""
    return {a["name"]: a["sha256"] for a in status["artifacts"]
            if a["name"] != "metrics.jsonl" and not a["name"].endswith("train_receipt.json")}


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_trainer_and_two_samplers_run_an_online_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    topo = Topology(root=tmp_path / "topology", model_path=tiny_model_dir, heartbeat_timeout_s=15.0)
    try:
        topo.start_servers().start_kiln(roles=["trainer", "sampler", "sampler"],
                                        role_env={"trainer": {"KILN_TRAIN_DEVICES": "2"}})
        trainer, *samplers = topo.gpus
        code, body = topo.api_call("POST", "/v1/openenv/runs", {**RUN, "environment_urls": [topo.env_url]})
        assert code == 202, body
        run_id = body["run_id"]
        final = topo.wait_run(run_id, timeout_s=800)
        assert final["state"] == "completed", json.dumps(final.get("failure"))[:2000]

        rows = asyncio.run(_executions(topo, run_id))
        gpu_queue = f"topo-gpu-{topo.queue_suffix}"
        collected = [(queue, who) for name, queue, who in rows if name == "collect_group"]
        trained = [(queue, who) for name, queue, who in rows if name == "train_adapter"]
        assert len(collected) >= 24 and {q for q, _ in collected} == {gpu_queue}
        assert {who for _, who in collected} == {_identity(p.pid) for p in samplers}  # both samplers worked
        assert len(trained) == 3 and set(trained) == {(train_task_queue(gpu_queue), _identity(trainer.pid))}

        store = topo.store()
        manifest = json.loads(store.get_key(f"runs/{run_id}/manifest.json"))
        assert manifest["iterations"] == 3
        folder = download_run(store, run_id, manifest, tmp_path / "run")
        report = verify_run(folder)
        chain = report["iterations"]
        assert len(chain) == 3 and chain[0]["sampled_by"] is None
        for previous, current in zip(chain, chain[1:]):
            assert current["sampled_by"] == previous["adapter_sha256"] is not None
        receipt = json.loads((folder / "iterations/000003/train_receipt.json").read_bytes())
        assert receipt["runtime"]["world_size"] == 2

        # The same run again, one sampler replaced between iterations by a fresh one (its own
        # KILN_HOME: no adapter cached): it fetches the adapters it is given by digest and goes on.
        code, body = topo.api_call("POST", "/v1/openenv/runs", {**RUN, "environment_urls": [topo.env_url]})
        assert code == 202, body
        again = body["run_id"]
        _wait_iteration(topo, again, 2)
        samplers[0].kill()
        fresh = topo.start_worker("sampler", "sampler-fresh")
        rerun = topo.wait_run(again, timeout_s=800)
        assert rerun["state"] == "completed", json.dumps(rerun.get("failure"))[:2000]
        assert _reproducible(rerun) == _reproducible(final)  # the hf engine: byte-identical artifacts
        fresh_collected = {who for name, _, who in asyncio.run(_executions(topo, again)) if name == "collect_group"}
        assert _identity(fresh.pid) in fresh_collected
        cached = {p.name for p in (topo.root / "home-sampler-fresh" / "cache" / "adapters").iterdir()}
        produced = {r["adapter_sha256"].removeprefix("sha256:") for r in chain}
        assert cached and cached <= produced  # it fetched only adapters the run's iterations produced
    finally:
        for proc in topo.close():
            assert_nothing_listening(proc)
