"""Kiln's own Prometheus series (API and workers), in prometheus-client's default registry.

Fixed-cardinality labels only: run states, request kinds, error codes — never URLs or run ids.
The exposition (with the Temporal SDK's runtime metrics) is ``workers.metrics``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

RUNS = Gauge("kiln_runs", "Runs known to Temporal, by state", ["state"])
QUEUE_DEPTH = Gauge("kiln_run_queue_depth", "Runs waiting for a slot in the FIFO run queue")
EPISODES = Counter("kiln_episodes_collected", "Episodes collected by this worker")
ENV_STEPS = Counter("kiln_environment_steps_collected", "Environment steps collected by this worker")
TRAIN_STEPS = Counter("kiln_training_steps", "Optimizer steps taken by this worker")
ENV_ROUND_TRIP = Histogram(
    "kiln_environment_round_trip_seconds",
    "One request/response exchange with an OpenEnv server",
    ["kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
SAMPLING_TOKENS_PER_S = Gauge("kiln_sampling_tokens_per_second", "Policy tokens/s of the last collected group")
TRAINING_TOKENS_PER_S = Gauge("kiln_training_tokens_per_second", "Tokens/s of the last training step")
S3_BYTES_WRITTEN = Counter("kiln_s3_bytes_written", "Bytes this process wrote to S3")
ERRORS = Counter("kiln_errors", "Kiln errors reported, by code", ["code"])

ROUND_TRIP_KINDS = frozenset({"reset", "step", "state", "close", "list_tools", "call_tool"})


def observe_round_trip(kind: Any, seconds: float) -> None:
    ENV_ROUND_TRIP.labels(kind=kind if kind in ROUND_TRIP_KINDS else "other").observe(seconds)


def count_error(code: str) -> None:
    # Codes come from the fixed KilnError tree; anything else is folded into one label value.
    ERRORS.labels(code=code if code.replace("_", "").isalnum() and len(code) <= 64 else "other").inc()
