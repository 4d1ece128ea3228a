"""The rollout bundle: rollouts JSONL, replay transcript and summary, built from group documents.

Everything here is a pure function of the group documents and the ``BundleSpec``, so re-collecting a
group after a crash yields byte-identical files. Wall-clock timings are deliberately absent (they
live in run status) — that is what makes the bundle reproducible.
"""

from __future__ import annotations

from typing import Any

from kiln.core.canonical import canonical_json, pretty_json, sha256_bytes
from kiln.core.rollout.prompts import PROMPT_VERSION
from kiln.core.run_plan import BundleSpec

REPLAY_SCHEMA = "kiln.openenv-replay.v1"
SUMMARY_SCHEMA = "kiln.openenv-rollout-summary.v5"
CLIENT_PROFILE = "openenv-http/1.x"
MAX_ARTIFACT_BYTES = 256 * 1024 * 1024


def dataset_bytes(groups: list[dict[str, Any]]) -> bytes:
    """One canonical compact ``AgenticGroup`` per line, each followed by ``\\n``."""
    ordered = sorted(groups, key=lambda doc: doc["group_index"])
    return b"".join(canonical_json(doc["line"]) + b"\n" for doc in ordered)


def replay_document(
    groups: list[dict[str, Any]],
    *,
    inspections: list[dict[str, Any]],
    dataset_sha256: str,
    protocol_error_reward: float,
    max_steps: int,
) -> dict[str, Any]:
    ordered = sorted(groups, key=lambda doc: doc["group_index"])
    return {
        "schema": REPLAY_SCHEMA,
        "client_profile": CLIENT_PROFILE,
        "dataset_sha256": dataset_sha256,
        "protocol_error_reward": protocol_error_reward,
        "max_steps": max_steps,
        "environments": inspections,
        "groups": [doc["replay"] for doc in ordered],
    }


def rollout_records(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ordered = sorted(groups, key=lambda doc: doc["group_index"])
    return [record for doc in ordered for record in doc["records"]]


def rollout_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures a user looks at first (stats, without wall-clock facts: latency and capacity
    refusals live in run status, so reruns write the same bytes)."""
    returns = [float(r["episode_return"]) for r in records]
    terminations = [r["termination"] for r in records]
    return {
        "rollouts": len(records),
        "mean_episode_return": (sum(returns) / len(returns)) if returns else 0.0,
        "min_episode_return": min(returns) if returns else None,
        "max_episode_return": max(returns) if returns else None,
        "done_count": terminations.count("done"),
        "max_steps_count": terminations.count("max_steps"),
        "invalid_model_action_count": terminations.count("invalid_model_action"),
        "truncated_action_count": sum(1 for r in records if r.get("harness_code") == "MODEL_ACTION_TRUNCATED"),
        "protocol_error_count": terminations.count("protocol_error"),
        "context_exhausted_count": terminations.count("context_exhausted"),
        "context_windowed_count": sum(1 for r in records if r.get("context_windowed")),
        "recoverable_protocol_error_count": sum(r["recoverable_protocol_errors"] for r in records),
        "total_environment_steps": sum(r["steps"] for r in records),
        "total_model_tokens": sum(r["model_tokens"] for r in records),
    }


def context_fields(groups: list[dict[str, Any]], context_policy: str) -> dict[str, Any]:
    """The summary's ``context_tokens`` (the served model's context every group was checked
    against) and ``context_policy``; absent when the policy named no context."""
    limits = sorted({doc["replay"]["context_tokens"] for doc in groups if "context_tokens" in doc["replay"]})
    if not limits:
        return {}
    return {"context_tokens": limits[0], "context_policy": context_policy}


def context_stats(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``context_tokens`` in the stats (where status shows them), when the groups recorded one."""
    fields = context_fields(groups, "end")
    return {"context_tokens": fields["context_tokens"]} if fields else {}


def summary_document(
    groups: list[dict[str, Any]],
    *,
    spec: BundleSpec,
    inspections: list[dict[str, Any]],
    behavior_policy: dict[str, Any],
    reset_plan_sha256: str,
    dataset: bytes,
    replay: bytes,
    training_selection: dict[str, Any] | None = None,
) -> dict[str, Any]:
    records = rollout_records(groups)
    settings = spec.settings
    out: dict[str, Any] = {
        "schema": SUMMARY_SCHEMA,
        "prompt_version": PROMPT_VERSION,
        "adapter": spec.adapter,
        "adapter_label": spec.adapter or "base",
        "behavior_policy": behavior_policy,
        "environments": inspections,
        "groups": len(groups),
        "group_size": settings.group_size,
        "rollout_count": len(records),
        "seed_start": spec.seed_start,
        "max_steps": settings.max_steps,
        "concurrency": settings.concurrency,
        "max_action_tokens": settings.max_action_tokens,
        "thinking_budget_tokens": settings.thinking_budget_tokens,
        "temperature": settings.temperature,
        "thinking": settings.thinking,
        "constrained_actions": settings.constrained_actions,
        "protocol_error_reward": settings.protocol_error_reward,
        "max_recoverable_errors": settings.max_recoverable_errors,
        "capacity_wait_seconds": settings.capacity_wait_seconds,
        **({"reset_determinism": settings.reset_determinism} if settings.reset_determinism != "strict" else {}),
        **({"replay_ignore": list(settings.replay_ignore)} if settings.replay_ignore else {}),
        **context_fields(groups, settings.context_policy),
        "reset_plan_sha256": reset_plan_sha256,
        "dataset_sha256": sha256_bytes(dataset),
        "dataset_bytes": len(dataset),
        "replay_sha256": sha256_bytes(replay),
        "replay_bytes": len(replay),
        "stats": {**rollout_stats(records), **context_stats(groups)},
        "rollouts": records,
    }
    if spec.dynamic_sampling is not None:
        out["dynamic_sampling"] = spec.dynamic_sampling.model_dump(mode="json")
    if spec.staleness is not None:
        out["staleness"] = spec.staleness.model_dump(mode="json")
    if training_selection is not None:
        out["training_selection"] = training_selection
    return out


def build_bundle(
    groups: list[dict[str, Any]],
    *,
    spec: BundleSpec,
    inspections: list[dict[str, Any]],
    behavior_policy: dict[str, Any],
    reset_plan_sha256: str,
    training_selection: dict[str, Any] | None = None,
) -> dict[str, bytes]:
    """``{"rollouts.jsonl", "replay.json", "summary.json"}`` → bytes."""
    dataset = dataset_bytes(groups)
    replay = pretty_json(
        replay_document(
            groups,
            inspections=inspections,
            dataset_sha256=sha256_bytes(dataset),
            protocol_error_reward=spec.settings.protocol_error_reward,
            max_steps=spec.settings.max_steps,
        )
    )
    summary = pretty_json(
        summary_document(
            groups,
            spec=spec,
            inspections=inspections,
            behavior_policy=behavior_policy,
            reset_plan_sha256=reset_plan_sha256,
            dataset=dataset,
            replay=replay,
            training_selection=training_selection,
        )
    )
    return {"rollouts.jsonl": dataset, "replay.json": replay, "summary.json": summary}
