"""Chaos for online RL (issue 16): faults in the middle of a multi-iteration run.

A 3-iteration run of the tiny model on the chaos stack's counter environment is disturbed:

- the gpu worker is SIGKILLed in iteration 2 (once mid-collection, once mid-training) and a new one
  started: the run completes, and every published artifact — each iteration's rollouts, summary,
  replay and adapter, and the final adapter bytes — is byte-identical to an undisturbed reference
  run of the same request;
- the control worker is SIGKILLed while it stores iteration 1 (``store_iteration``), and the
  Temporal dev server restarts (same db) right after iteration 1 is stored: same artifacts;
- the run is cancelled in iteration 3: it ends ``cancelled``, no manifest, the adapter name is not
  promoted, and no environment session is left open.

Train receipts and ``metrics.jsonl`` hold wall-clock figures and are not compared; every other
manifest entry is, by digest.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

from tests.chaos.conftest import _heal, train_request
from tests.support.chaos.assertions import manifest_absent, read_uri, record, sha256_of
from tests.support.chaos.environments import wait_env_idle
from tests.support.chaos.faults import PARK_ACTIVITY, SAMPLE_DELAY, TRAIN_STEP_DELAY
from tests.support.chaos.runs import (
    connect,
    last_details,
    result_within,
    start_run,
    wait_activity,
    wait_status,
    wait_until_async,
)
from tests.support.chaos.stack import ChaosStack

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(420)]

ITERATIONS = 3
ADAPTER = "chaos-online"
# Wall-clock figures (timings) live in these; everything else a manifest lists is reproducible.
NOT_COMPARED = ("train_receipt.json", "metrics.jsonl")


def online_request(env_url: str, **overrides: Any) -> dict[str, Any]:
    """The chaos train request, run as ITERATIONS online-RL iterations."""
    return train_request(env_url, **{"iterations": ITERATIONS, "output_adapter": ADAPTER, **overrides})


@dataclass
class OnlineOutcome:
    """A completed online run: its final status, its manifest, and the digests compared."""

    run_id: str
    status: dict[str, Any]
    manifest: dict[str, Any]
    digests: dict[str, str]  # manifest entry name -> sha256, NOT_COMPARED entries left out
    seconds: float

    @classmethod
    def of(cls, stack: ChaosStack, run_id: str, status: dict[str, Any], seconds: float) -> "OnlineOutcome":
        from kiln.core.artifacts.manifest import manifest_key

        store = stack.store()
        keys = [k for k in store.list_keys(f"runs/{run_id}/") if k.endswith("manifest.json")]
        assert keys == [manifest_key(run_id)], f"expected exactly one manifest for {run_id}, found {keys}"
        data = store.get_key(manifest_key(run_id))
        assert status["manifest"]["sha256"] == sha256_of(data), "the manifest in S3 is not the one status names"
        manifest = json.loads(data)
        for entry in manifest["artifacts"]:  # every listed object intact
            blob = read_uri(store, entry["uri"])
            assert len(blob) == entry["bytes"] and sha256_of(blob) == entry["sha256"], entry["name"]
        digests = {a["name"]: a["sha256"] for a in manifest["artifacts"] if not a["name"].endswith(NOT_COMPARED)}
        return cls(run_id, status, manifest, digests, seconds)

    @property
    def adapter_digest(self) -> str:
        return self.digests["adapter/adapter_model.safetensors"]

    def rollouts_digests(self) -> list[str]:
        return [self.digests[f"iterations/{k:06d}/rollouts.jsonl"] for k in range(1, ITERATIONS + 1)]

    def assert_same_artifacts(self, other: "OnlineOutcome") -> None:
        """``other`` (a disturbed run) published exactly this run's artifacts, bytes and chain."""
        assert other.manifest["iterations"] == self.manifest["iterations"] == ITERATIONS
        assert sorted(other.digests) == sorted(self.digests)
        assert other.adapter_digest == self.adapter_digest, "the final adapter bytes differ"
        assert other.rollouts_digests() == self.rollouts_digests(), "an iteration's rollouts differ"
        differing = sorted(name for name, digest in self.digests.items() if other.digests[name] != digest)
        assert not differing, f"artifacts differ from the reference run's: {differing}"
        ours = [(r["behavior_adapter_sha256"], r["adapter_sha256"], r["steps"]) for r in self.status["iterations"]]
        theirs = [(r["behavior_adapter_sha256"], r["adapter_sha256"], r["steps"]) for r in other.status["iterations"]]
        assert theirs == ours, "the iteration chain differs"
        for key in ("adapter_sha256", "stats", "behavior_policy", "reset_plan_sha256", "promoted"):
            assert other.manifest.get(key) == self.manifest.get(key), f"manifest {key} differs"


@pytest.fixture(scope="module")
def reference_online(chaos_stack: ChaosStack) -> Iterator[OnlineOutcome]:
    """The undisturbed online run every disturbed one is compared with."""
    _heal(chaos_stack)

    async def run() -> OnlineOutcome:
        client = await connect(chaos_stack)
        started = time.monotonic()
        handle = await start_run(client, chaos_stack, online_request(chaos_stack.env_url))
        state, final = await result_within(handle, 300)
        assert state == "completed", final
        return OnlineOutcome.of(chaos_stack, handle.id, final, time.monotonic() - started)

    outcome = asyncio.run(run())
    curve = outcome.status["iterations"]
    # Every iteration trained, and sampled with the adapter the previous one produced.
    assert [r["iteration"] for r in curve] == list(range(1, ITERATIONS + 1))
    assert all(r["trained"] and r["steps"] > 0 for r in curve), curve
    assert curve[0]["behavior_adapter_sha256"] is None
    assert [r["behavior_adapter_sha256"] for r in curve[1:]] == [r["adapter_sha256"] for r in curve[:-1]]
    assert outcome.status["interruptions"] == []
    yield outcome


async def _complete(stack: ChaosStack, handle: Any, started: float) -> OnlineOutcome:
    state, final = await result_within(handle, 300)
    assert state == "completed", final
    assert final["iteration"] == ITERATIONS
    return OnlineOutcome.of(stack, handle.id, final, time.monotonic() - started)


async def test_gpu_worker_killed_mid_collection_of_iteration_2(
    stack: ChaosStack, reference_online: OnlineOutcome
) -> None:
    hooks = stack.hooks
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, online_request(stack.env_url))
    await wait_status(handle, lambda s: s["iteration"] == 1 and s["phase"] == "training", timeout_s=120,
                      what="iteration 1's training")
    hooks.set(SAMPLE_DELAY, 0.4)  # iteration 2's groups stay in flight > 1 s: the kill lands mid-episode
    iteration_2_from = time.time()  # group indexes restart at 0 each iteration: later events are iteration 2's
    act = await wait_activity(
        client, handle,
        lambda a: a["type"] == "collect_group" and a["state"] == "STARTED" and a["attempt"] == 1
        and bool(last_details(a).get("step")),
        timeout_s=120, what="an iteration-2 collect_group mid-episode",
    )
    status = await wait_status(handle, lambda s: True, timeout_s=10, what="status")
    assert status["iteration"] == 2 and status["phase"] == "collection", (status["iteration"], status["phase"])
    assert len(status["iterations"]) == 1
    pid = stack.kill_worker("gpu")
    hooks.clear(SAMPLE_DELAY)
    starts = [e for e in hooks.events("collect_start", run_id=handle.id, pid=pid) if e["t"] >= iteration_2_from]
    ends = {(e["group_index"], e["attempt"]) for e in hooks.events("collect_end", run_id=handle.id, pid=pid)
            if e["t"] >= iteration_2_from}
    in_flight = {e["group_index"] for e in starts if (e["group_index"], e["attempt"]) not in ends}
    assert last_details(act)["group_index"] in in_flight

    stack.start_worker("gpu")
    outcome = await _complete(stack, handle, started)
    interruptions = [i for i in outcome.status["interruptions"] if i["activity"] == "collect_group"]
    assert all(i["stage"] == "iteration 2 group" and i["code"] == "executor_interrupted" for i in interruptions)
    interrupted = {i["group_index"] for i in interruptions}
    # Only the groups in flight on the killed worker (at most its activity slots) were re-done, once
    # each, from reset, by the new worker — not the queued ones its first attempts picked up.
    assert in_flight <= interrupted, (in_flight, interruptions)
    assert len(interrupted) <= stack.settings().gpu_max_concurrent_activities, interruptions
    assert all(i["attempts"] == 2 for i in interruptions), interruptions
    redone = {e["group_index"] for e in hooks.events("collect_end", run_id=handle.id, outcome="ok")
              if e["pid"] != pid and e["attempt"] == 2}
    assert redone == interrupted, (redone, interruptions)
    reference_online.assert_same_artifacts(outcome)
    record(
        "16a gpu worker SIGKILL mid-collection of iteration 2",
        groups_in_flight_at_kill=sorted(in_flight),
        interruptions=[(i["stage"], i["group_index"], i["attempts"]) for i in interruptions],
        final_adapter=outcome.adapter_digest,
        rollouts=outcome.rollouts_digests(),
        run_s=outcome.seconds,
        reference_run_s=reference_online.seconds,
    )


async def test_gpu_worker_killed_mid_training_of_iteration_2(
    stack: ChaosStack, reference_online: OnlineOutcome
) -> None:
    hooks = stack.hooks
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, online_request(stack.env_url))
    await wait_status(handle, lambda s: s["iteration"] == 2, timeout_s=180, what="iteration 2")
    hooks.set(TRAIN_STEP_DELAY, 1.5)  # iteration 2's steps are slowed: room to see a checkpoint
    act = await wait_activity(
        client, handle,
        lambda a: a["type"] == "train_adapter" and a["attempt"] == 1 and bool(last_details(a).get("checkpoint")),
        timeout_s=120, what="a heartbeated checkpoint of iteration 2's training",
    )
    status = await wait_status(handle, lambda s: True, timeout_s=10, what="status")
    assert status["iteration"] == 2 and status["phase"] == "training", (status["iteration"], status["phase"])
    pid = stack.kill_worker("gpu")
    hooks.clear(TRAIN_STEP_DELAY)
    attempt_1 = [e for e in hooks.events("train_start", run_id=handle.id) if e["pid"] == pid]
    assert len(attempt_1) == 2  # iteration 1's and iteration 2's trainings ran on the killed worker
    steps_before_kill = [e["step"] for e in hooks.events("train_step", run_id=handle.id, pid=pid)
                         if e["t"] >= attempt_1[1]["t"]]
    # The kill interrupted iteration 2's training attempt: it never ended on the killed worker.
    assert [e for e in hooks.events("train_end", run_id=handle.id, pid=pid) if e["t"] >= attempt_1[1]["t"]] == []

    stack.start_worker("gpu")
    outcome = await _complete(stack, handle, started)
    reference_online.assert_same_artifacts(outcome)
    later = [e for e in hooks.events("train_start", run_id=handle.id) if e["pid"] != pid]
    # Iteration 2's training was retried once, on the new worker, from the heartbeated checkpoint.
    assert later and (later[0]["attempt"], later[0]["resumed"]) == (2, True), later
    receipt_entry = next(a for a in outcome.manifest["artifacts"] if a["name"] == "iterations/000002/train_receipt.json")
    receipt = json.loads(read_uri(stack.store(), receipt_entry["uri"]))
    resumed_from = receipt.get("resumed_from_step")
    assert last_details(act)["checkpoint_step"] <= resumed_from <= max(steps_before_kill), resumed_from
    record(
        "16b gpu worker SIGKILL mid-training of iteration 2",
        checkpoint_seen=last_details(act)["checkpoint_step"],
        steps_done_before_kill=max(steps_before_kill),
        total_steps=hooks.events("train_step", run_id=handle.id, pid=pid)[-1]["total_steps"],
        resumed_from_step=resumed_from,
        later_attempts=[{"attempt": e["attempt"], "resumed": e["resumed"]} for e in later],
        final_adapter=outcome.adapter_digest,
        run_s=outcome.seconds,
    )


async def test_control_worker_killed_storing_iteration_1_then_temporal_restart(
    stack: ChaosStack, reference_online: OnlineOutcome
) -> None:
    """Two faults in one run: SIGKILL of the control worker while it stores iteration 1 (the
    ``store_iteration`` activity, parked at its start), then a Temporal restart (same db) right
    after iteration 1 is stored."""
    hooks = stack.hooks
    client = await connect(stack)
    started = time.monotonic()
    hooks.set(PARK_ACTIVITY, "store_iteration")
    handle = await start_run(client, stack, online_request(stack.env_url))
    parked = await wait_until_async(lambda: hooks.events("activity_parked", run_id=handle.id, type="store_iteration"),
                                    timeout_s=180, what="iteration 1's store_iteration to start (parked)")
    assert parked[0]["pid"] == stack.workers["control"].pid
    killed_at = time.time()
    pid = stack.kill_worker("control")
    hooks.clear(PARK_ACTIVITY)
    await asyncio.to_thread(stack.start_worker, "control")
    retried = await wait_until_async(
        lambda: [e for e in hooks.events("activity_start", run_id=handle.id, type="store_iteration")
                 if e["attempt"] == 2 and e["pid"] != pid],
        timeout_s=120, what="store_iteration's retry",
    )
    kill_to_retry_s = retried[0]["t"] - killed_at

    status = await wait_status(handle, lambda s: len(s["iterations"]) == 1, timeout_s=180,
                               what="iteration 1 to be stored", interval_s=0.02)
    stopped_in = (status["iteration"], status["phase"])
    stop_began = time.monotonic()
    stack.stop_temporal()
    await asyncio.sleep(3.0)
    await asyncio.to_thread(stack.start_temporal)
    back_at = time.monotonic()
    workers = dict(stack.workers)

    client = await connect(stack)
    handle = client.get_workflow_handle(handle.id)
    outcome = await _complete(stack, handle, started)
    assert all(proc.alive() for proc in workers.values()) and workers == stack.workers  # reconnected alone
    reference_online.assert_same_artifacts(outcome)
    stored = [i for i in outcome.status["interruptions"] if i["activity"] == "store_iteration"]
    assert [i["attempts"] for i in stored] == [2], outcome.status["interruptions"]
    record(
        "16c control worker SIGKILL in iteration 1's store_iteration, then Temporal restart (same db)",
        kill_to_retry_s=round(kill_to_retry_s, 1),
        stopped_at=stopped_in,
        down_s=back_at - stop_began,
        serving_to_completed_s=time.monotonic() - back_at,
        final_adapter=outcome.adapter_digest,
        run_s=outcome.seconds,
    )


async def test_cancel_in_iteration_3_publishes_nothing(stack: ChaosStack) -> None:
    from kiln.core.artifacts.adapters import pointer_key
    from kiln.core.artifacts.iterations import iteration_key

    hooks = stack.hooks
    adapter = f"chaos-online-cancel-{uuid.uuid4().hex[:6]}"  # a name no other run promotes
    client = await connect(stack)
    handle = await start_run(client, stack, online_request(stack.env_url, output_adapter=adapter))
    await wait_status(handle, lambda s: s["iteration"] == 2 and s["phase"] == "training", timeout_s=180,
                      what="iteration 2's training")
    hooks.set(SAMPLE_DELAY, 0.5)  # iteration 3's episodes stay in flight
    await wait_activity(
        client, handle,
        lambda a: a["type"] == "collect_group" and a["state"] == "STARTED" and bool(last_details(a).get("step")),
        timeout_s=120, what="an iteration-3 collect_group mid-episode",
    )
    status = await wait_status(handle, lambda s: True, timeout_s=10, what="status")
    assert status["iteration"] == 3 and len(status["iterations"]) == 2, (status["iteration"], status["iterations"])
    began = time.monotonic()
    await handle.cancel()
    state, _ = await result_within(handle, 60)
    seconds = time.monotonic() - began
    hooks.clear(SAMPLE_DELAY)
    assert state == "cancelled", state
    final = await handle.query("status")
    assert final["state"] == "cancelled" and final["cancelled_stage"] == "collection"
    assert final["manifest"] is None and final["artifacts"] == []
    store = stack.store()
    assert manifest_absent(store, handle.id)
    assert store.get_key(pointer_key(adapter)) is None  # the adapter name was never promoted
    # Iterations 1 and 2 were stored (internal records, listed by no manifest); iteration 3 was not.
    assert [store.get_key(iteration_key(handle.id, k)) is not None for k in (1, 2, 3)] == [True, True, False]
    idle_s = await wait_env_idle(stack.env_url, stack.env_max_sessions)
    record(
        "16d cancel mid-collection of iteration 3",
        cancel_to_closed_s=seconds,
        iterations_stored_before_cancel=len(final["iterations"]),
        sessions_all_closed_within_s=idle_s,
    )
