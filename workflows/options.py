"""Timeouts and retry policies of each stage, in one place (tests shorten them via the input)."""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import RetryPolicy

WORKFLOW_NAME = "OpenEnvRunWorkflow"
MAX_PARALLEL_GROUPS = 4

CONTROL_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
)
GROUP_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=5,
)
# Publication must outlive an S3 restart: unlimited attempts, bounded by PUBLISH_TIMEOUT.
PUBLISH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=0,
    non_retryable_error_types=[
        "retained_budget_exceeded",
        "artifact_publication_failed",
        "openenv_artifact_integrity_failed",
    ],
)
TRAIN_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=2),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
)

ADMISSION_TIMEOUT = timedelta(seconds=30)
DISCOVERY_TIMEOUT = timedelta(minutes=3)
POLICY_TIMEOUT = timedelta(minutes=5)
GROUP_TIMEOUT = timedelta(hours=2)
GROUP_HEARTBEAT = timedelta(seconds=30)
TRAIN_TIMEOUT = timedelta(hours=12)
PUBLISH_TIMEOUT = timedelta(minutes=30)
PUBLISH_HEARTBEAT = timedelta(seconds=30)
