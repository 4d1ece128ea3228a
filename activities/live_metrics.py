"""Gpu-worker side of the live metrics stream: group figures, training steps, trackers, Prometheus.

Everything here is best effort for the S3 stream (a failed write never fails the activity), but a
tracker the run asked for that cannot start fails training up front (``tracker_unavailable``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.artifacts.store import S3Store
from kiln.core.records import CollectGroupInput, CollectGroupResult, TrainInput
from kiln.core.telemetry import prometheus as prom
from kiln.core.telemetry.live import TrainStream, group_event, put_group, read_events, step_event
from kiln.core.telemetry.trackers import open_tracker


def publish_group_figures(store: S3Store, inp: CollectGroupInput, result: CollectGroupResult, wall_s: float) -> None:
    """Store one group's figures under the run's live prefix and count it in Prometheus."""
    invalid = int(result.terminations.get("invalid_model_action", 0))
    event = group_event(
        label=inp.label,
        group_index=inp.group_index,
        seed=inp.seed,
        returns=result.returns,
        steps=result.steps,
        invalid_actions=invalid,
        wall_s=wall_s,
        concurrency=inp.settings.concurrency,
    )
    put_group(store.impatient(), inp.run_id, event)  # best effort: an outage is not waited out
    prom.EPISODES.inc(len(result.returns))
    prom.ENV_STEPS.inc(result.steps)
    if result.model_latency_ms > 0:
        prom.SAMPLING_TOKENS_PER_S.set(result.model_tokens / (result.model_latency_ms / 1000.0))


class LiveTraining:
    """Context manager around one training attempt: streams steps to S3, the tracker and Prometheus."""

    def __init__(self, store: S3Store, inp: TrainInput, home: Path) -> None:
        store = store.impatient()  # best effort: an outage is not waited out
        self.tracker = open_tracker(
            inp.report_to,
            run_id=inp.run_id,
            home=home,
            config={"output_adapter": inp.output_adapter, **inp.training_config.model_dump(mode="json", by_alias=True)},
        )
        self.learning_rate = inp.training_config.learning_rate
        self.iteration = inp.iteration
        sinks = [self.tracker.log] if self.tracker is not None else []
        self.stream = TrainStream(store, inp.run_id, sinks=sinks)
        if self.tracker is not None:  # the reward curve so far: one point per collected group
            for event in read_events(store, inp.run_id):
                if event.get("kind") == "group":
                    self.tracker.log(event)

    def step(self, details: dict[str, Any]) -> None:
        event = step_event(details, learning_rate=self.learning_rate)
        if self.iteration is not None:
            event["iteration"] = self.iteration
        self.stream.emit(event)
        prom.TRAIN_STEPS.inc()
        if event.get("tokens_per_s"):
            prom.TRAINING_TOKENS_PER_S.set(float(event["tokens_per_s"]))

    def __enter__(self) -> "LiveTraining":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.flush()
        if self.tracker is not None:
            self.tracker.close()


def open_train_stream(store: S3Store, inp: TrainInput, *, home: Path) -> LiveTraining:
    return LiveTraining(store, inp, Path(home))
