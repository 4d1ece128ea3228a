"""Per-rollout provenance: the ``openenv`` block of a dataset completion and the summary record.

One builder for each, used by the collector (:mod:`kiln.core.rollout.group`), which writes them, and
by the offline verifier (:mod:`kiln.core.rollout.verify`), which rebuilds them from the replay and the
inspection and compares.
"""

from __future__ import annotations

from typing import Any

from kiln.core.canonical import digest_json

ROLLOUT_SCHEMA = "kiln.openenv-rollout.v1"


def environment_name(identity: dict[str, Any]) -> str:
    """The advertised environment name (``/list_environments``), else ``metadata.name``."""
    names = identity.get("environments") or []
    if names:
        return str(names[0])
    return str((identity.get("metadata") or {}).get("name", ""))


def provenance_of(
    inspection: dict[str, Any],
    *,
    reset_payload: dict[str, Any],
    seed: int,
    steps: int,
    episode_return: float,
    termination: str | None,
    protocol_error_code: str | None,
    behavior_policy: dict[str, Any],
    context_policy: str = "end",
) -> dict[str, Any]:
    """``openenv`` provenance of one rollout (``protocol_error_code`` only when it ended so; the
    run's ``context_policy`` only when it ended at the model's context, which training reads)."""
    identity = inspection["identity"]
    out: dict[str, Any] = {
        "schema": ROLLOUT_SCHEMA,
        "environment_name": environment_name(identity),
        "environment_base_url": identity["base_url"],
        "openapi_version": identity.get("openapi_version"),
        "discovery_sha256": identity.get("discovery_sha256"),
        "environment_schema_sha256": identity["schema_sha256"],
        "action_schema_sha256": digest_json(inspection["schema"]["action"]),
        "reset_sha256": digest_json(reset_payload),
        "seed": seed,
        "steps": steps,
        "episode_return": episode_return,
        "terminal_done": termination == "done",
        "termination": termination,
        "behavior_policy": behavior_policy,
    }
    if termination == "protocol_error":
        out["protocol_error_code"] = protocol_error_code
    if termination == "context_exhausted":
        out["context_policy"] = context_policy
    return out


def rollout_record(
    identity: dict[str, Any],
    *,
    group_index: int,
    candidate_index: int,
    seed: int,
    steps: int,
    episode_return: float,
    termination: str | None,
    protocol_error_code: str | None,
    recoverable_protocol_errors: int,
    model_tokens: int,
    harness_code: str | None = None,
    capacity_retries: int | None = None,
) -> dict[str, Any]:
    """One summary ``rollouts`` record (``protocol_error_code`` only when it ended so;
    ``harness_code`` only when the episode ended on a harness error). ``capacity_retries`` is only
    rebuilt for bundles written before capacity refusals left the artifacts (docs/openenv.md)."""
    record: dict[str, Any] = {
        "group_index": group_index,
        "candidate_index": candidate_index,
        "environment_name": environment_name(identity),
        "environment_url": identity["base_url"],
        "seed": seed,
        "steps": steps,
        "episode_return": episode_return,
        "terminal_done": termination == "done",
        "termination": termination,
        "recoverable_protocol_errors": recoverable_protocol_errors,
        "model_tokens": model_tokens,
    }
    if capacity_retries is not None:
        record["capacity_retries"] = capacity_retries
    if termination == "protocol_error":
        record["protocol_error_code"] = protocol_error_code
    if harness_code is not None:
        record["harness_code"] = harness_code
    return record
