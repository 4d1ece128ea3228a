"""The live metrics stream against real S3 (SeaweedFS): throttled writes, retries, read order."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from kiln.core.artifacts.store import S3Store
from kiln.core.telemetry.live import (
    TrainStream,
    group_event,
    metrics_jsonl,
    progress_key,
    put_group,
    read_events,
    read_progress,
    train_key,
)


def _step(step: int, loss: float) -> dict[str, Any]:
    return {"kind": "train_step", "step": step, "loss": loss}


@pytest.mark.timeout(60)
def test_stream_throttles_keeps_retried_steps_and_orders_events(kiln_settings: Any) -> None:
    store = S3Store.from_settings(kiln_settings())
    run_id = str(uuid.uuid4())
    now = [100.0]
    seen: list[int] = []
    stream = TrainStream(store, run_id, interval_s=0.5, clock=lambda: now[0], sinks=[lambda e: seen.append(e["step"])])
    stream.emit(_step(1, 1.0))  # first event: written at once
    assert read_progress(store, run_id)["step"] == 1
    now[0] += 0.1
    stream.emit(_step(2, 0.9))  # inside the interval: kept, not yet written
    assert read_progress(store, run_id)["step"] == 1
    now[0] += 0.5
    stream.emit(_step(3, 0.8))  # interval passed: written with everything before it
    progress = read_progress(store, run_id)
    assert progress["step"] == 3 and progress["lines"] == 3
    assert seen == [1, 2, 3]  # sinks (trackers) see every event, unthrottled

    # A retried attempt resumes from step 2: step 3 is re-run and replaces the old line.
    retry = TrainStream(store, run_id, interval_s=0.5, clock=lambda: now[0])
    retry.emit(_step(3, 0.7))
    retry.emit(_step(4, 0.6))
    retry.flush()
    steps = [e for e in read_events(store, run_id) if e["kind"] == "train_step"]
    assert [(e["step"], e["loss"]) for e in steps] == [(1, 1.0), (2, 0.9), (3, 0.7), (4, 0.6)]
    assert len(store.get_key(train_key(run_id)).splitlines()) == 5  # the raw stream keeps history

    for label, index in (("eval candidate", 0), ("group", 1), ("group", 0), ("eval baseline", 0)):
        put_group(store, run_id, group_event(label=label, group_index=index, seed=10 + index, returns=[1.0],
                                             steps=2, invalid_actions=0, wall_s=0.1, concurrency=1))
    events = read_events(store, run_id)
    groups = [(e["label"], e["group_index"]) for e in events if e["kind"] == "group"]
    assert groups == [("group", 0), ("group", 1), ("eval baseline", 0), ("eval candidate", 0)]
    lines = [json.loads(line) for line in metrics_jsonl(store, run_id).splitlines()]
    assert lines[0] == {"schema": "kiln.run-metrics.v1", "run_id": run_id}
    assert len(lines) == 1 + 4 + 4
    assert store.get_key(progress_key(str(uuid.uuid4()))) is None
