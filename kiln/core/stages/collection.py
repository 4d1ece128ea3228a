"""Collection of one seed group on a gpu worker: verify the policy, run the group, store it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Callable

from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import canonical_json
from kiln.core.errors import PolicyIdentityChanged, RunInterrupted
from kiln.core.rollout.group import GroupCollector, GroupTask
from kiln.core.rollout.policy_port import PolicyPort
from kiln.core.records import AdapterRef, CollectGroupInput, CollectGroupResult, StoredObject
from kiln.core.openenv.capacity import ATTEMPT_CAPACITY_WAIT_S
from kiln.core.openenv.credential_config import resolve_bearer_token
from kiln.core.policy.engine import decode_tile_of
from kiln.core.policy.identity import with_inference
from kiln.core.train.selection import select_groups
from kiln.core.unfinished_thinking import group_ended_inside_thinking


def behavior_policy_of(
    policy: PolicyPort,
    adapter_ref: AdapterRef | None,
    adapter_dir: Path | None,
    inference: dict[str, Any] | None = None,
    decode_tile: int | None = None,
) -> dict[str, Any]:
    """The identity every action of a run is bound to (base digest + runtime + adapter digest,
    plus the sampling settings and their ``inference_config_sha256`` when ``inference`` is given),
    at the hf engine's ``decode_tile`` when given (else the worker's own)."""
    tile = {"decode_tile": decode_tile} if decode_tile is not None else {}
    identity = dict(policy.identity(adapter_dir, **tile))
    identity["adapter"] = adapter_ref.name if adapter_ref is not None else None
    return with_inference(identity, inference)


def require_same_policy(expected: dict[str, Any], live: dict[str, Any]) -> None:
    if canonical_json(expected) != canonical_json(live):
        changed = sorted(k for k in set(expected) | set(live) if expected.get(k) != live.get(k))
        raise PolicyIdentityChanged(
            "the gpu worker's policy differs from the one this run was admitted with: " + ", ".join(changed),
            hint="all gpu workers of a run must serve the same model folder and adapter",
            details={"changed_fields": changed},
        )


async def collect(
    inp: CollectGroupInput,
    *,
    store: S3Store,
    policy: PolicyPort,
    adapter_dir: Path | None,
    attempt: int = 1,
    heartbeat: Callable[[dict[str, Any]], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    credentials: dict[str, Any] | None = None,
) -> CollectGroupResult:
    if attempt > 1 and inp.on_interrupt == "fail":
        raise RunInterrupted(
            f"group {inp.group_index} was interrupted (attempt {attempt}) and the run asked on_interrupt='fail'",
            hint="submit a new run, or use on_interrupt 'resume' to re-collect interrupted groups",
            stage="collection",
            retryable=False,
        )
    # The group's sampling settings must be the ones the identity names (identities admitted before
    # inference_config_sha256 existed carry none and are checked on the model part only).
    sampling = inp.settings.model_dump() if "inference_config_sha256" in inp.behavior_policy else None
    # The run is served at the decode tile it was admitted at, even by a worker whose default
    # changed since (an upgrade): same identity, same bytes.
    tile = decode_tile_of(inp.behavior_policy)
    require_same_policy(inp.behavior_policy, behavior_policy_of(policy, inp.adapter_ref, adapter_dir, sampling, tile))
    inspection_raw = await asyncio.to_thread(
        store.get_bytes,
        inp.inspection.ref(),
    )
    inspection = json.loads(inspection_raw)
    task = GroupTask(
        run_id=inp.run_id,
        group_index=inp.group_index,
        environment_index=inp.environment_index,
        seed=inp.seed,
        reset_payload=inp.reset_payload,
        inspection=inspection,
        settings=inp.settings,
        behavior_policy=inp.behavior_policy,
        adapter_dir=adapter_dir,
        bearer_token=resolve_bearer_token(credentials or {}, inp.credential_id, inspection["identity"]["base_url"]),
        decode_tile=tile,
    )
    collector = GroupCollector(
        task,
        policy,
        should_cancel=should_cancel,
        heartbeat=heartbeat,
        attempt_capacity_wait_s=ATTEMPT_CAPACITY_WAIT_S,
    )
    document = await collector.run()
    ref = await asyncio.to_thread(store.put_blob, canonical_json(document))
    records = document["records"]
    terminations: dict[str, int] = {}
    for record in records:
        terminations[record["termination"]] = terminations.get(record["termination"], 0) + 1
    return CollectGroupResult(
        group_index=inp.group_index,
        group=StoredObject.of(ref),
        returns=[float(r["episode_return"]) for r in records],
        steps=sum(r["steps"] for r in records),
        terminations=terminations,
        model_tokens=sum(r["model_tokens"] for r in records),
        model_latency_ms=collector.timings()["model_latency_ms"],
        attempt=attempt,
        capacity=collector.capacity_observed(),
        reset_differences=sorted(collector.nondeterministic_fields)[:64],
        interruption_code="executor_interrupted" if attempt > 1 else None,
        unfinished_thinking=group_ended_inside_thinking(document["line"]["completions"]),
        signal=bool(select_groups([document["line"]], inp.signal_on_no_output)[0]) if inp.signal_on_no_output else None,
    )
