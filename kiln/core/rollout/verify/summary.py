"""Summary checks: the settings, the behaviour policy, the inspections and each rollout record."""

from __future__ import annotations

from typing import Any

from kiln.core.canonical import digest_json, is_digest
from kiln.core.request_fields import MAX_SEED, MAX_STALENESS
from kiln.core.openenv.discovery import CLIENT_PROFILE, IDENTITY_SCHEMA
from kiln.core.rollout.bundle import MAX_ARTIFACT_BYTES, SUMMARY_SCHEMA
from kiln.core.rollout.prompts import PROMPT_VERSION
from kiln.core.rollout.replay_ignore import check_paths
from kiln.core.rollout.provenance import rollout_record
from kiln.core.rollout.verify.checks import (
    SUMMARY_FILE,
    Where,
    _is_number,
    fail,
    need_bool,
    need_dict,
    need_digest,
    need_float,
    need_int,
    need_keys,
    need_list,
    need_match,
)

#: Summary settings that nothing else in the bundle records: only their type/range is checked
#: (``max_action_tokens`` is also held to the context rule when the summary records ``context_tokens``).
UNBOUND_SUMMARY_FIELDS = (
    "concurrency",
    "temperature",
    "capacity_wait_seconds",
    "max_action_tokens",
    "thinking_budget_tokens",
    "max_recoverable_errors",
    "constrained_actions",
)

_SUMMARY_KEYS = frozenset(
    {
        "schema",
        "prompt_version",
        "adapter",
        "adapter_label",
        "behavior_policy",
        "environments",
        "groups",
        "group_size",
        "rollout_count",
        "seed_start",
        "max_steps",
        "concurrency",
        "max_action_tokens",
        "thinking_budget_tokens",
        "temperature",
        "thinking",
        "constrained_actions",
        "protocol_error_reward",
        "max_recoverable_errors",
        "capacity_wait_seconds",
        "reset_plan_sha256",
        "dataset_sha256",
        "dataset_bytes",
        "replay_sha256",
        "replay_bytes",
        "stats",
        "rollouts",
    }
)
_SUMMARY_OPTIONAL = frozenset(
    {
        "training_selection",
        "reset_determinism",
        "replay_ignore",
        "context_tokens",
        "context_policy",
        "dynamic_sampling",
        "staleness",
    }
)
_STALENESS_KEYS = frozenset({"max_staleness", "behavior_version", "lag"})
_DYNAMIC_KEYS = frozenset({"target_groups", "max_refill_rounds", "rounds", "signal_groups", "capped"})


def check_summary(summary: dict) -> None:
    where = Where(SUMMARY_FILE)
    need_keys(summary, _SUMMARY_KEYS, where, "", _SUMMARY_OPTIONAL)
    if summary["schema"] != SUMMARY_SCHEMA:
        raise fail(where, "schema", f"must be {SUMMARY_SCHEMA!r}")
    if summary["prompt_version"] != PROMPT_VERSION:
        raise fail(where, "prompt_version", f"must be {PROMPT_VERSION!r} (the prompt this verifier recomputes)")
    adapter = summary["adapter"]
    if adapter is not None and (not isinstance(adapter, str) or adapter in ("", "base")):
        raise fail(where, "adapter", "must be null (base) or an adapter name")
    if summary["adapter_label"] != (adapter or "base"):
        raise fail(where, "adapter_label", "must be the adapter name, or 'base' when adapter is null")
    check_behavior_policy(summary["behavior_policy"], adapter, where)
    environments = need_list(summary["environments"], where, "environments")
    if not 1 <= len(environments) <= 64:
        raise fail(where, "environments", "must hold 1..64 inspections")
    for index, inspection in enumerate(environments):
        check_inspection(inspection, where, f"environments[{index}]")
    groups = need_int(summary, "groups", where, 1, 16384)
    if groups < len(environments):
        raise fail(where, "groups", "must be >= the number of environments")
    group_size = need_int(summary, "group_size", where, 1, 256)
    if need_int(summary, "rollout_count", where) != groups * group_size:
        raise fail(where, "rollout_count", "must equal groups × group_size")
    seed_start = need_int(summary, "seed_start", where, 0, MAX_SEED)
    if seed_start + groups - 1 > MAX_SEED:
        raise fail(where, "seed_start", "seed_start + groups - 1 exceeds 2^63-1")
    need_int(summary, "max_steps", where, 1, 256)
    need_int(summary, "concurrency", where, 1, 256)
    max_tokens = need_int(summary, "max_action_tokens", where, 1, 16384)
    thinking = need_bool(summary, "thinking", where)
    need_bool(summary, "constrained_actions", where)
    budget = summary["thinking_budget_tokens"]
    if budget is not None:
        need_int(summary, "thinking_budget_tokens", where, 1, max_tokens - 1)
        if not thinking:
            raise fail(where, "thinking_budget_tokens", "requires thinking=true")
    temperature = summary["temperature"]
    if not _is_number(temperature) or temperature < 0:
        raise fail(where, "temperature", "must be a finite number >= 0")
    need_float(summary, "protocol_error_reward", where)
    need_int(summary, "max_recoverable_errors", where, 0, 64)
    need_int(summary, "capacity_wait_seconds", where, 1, 3600)
    for key in ("reset_plan_sha256", "dataset_sha256", "replay_sha256"):
        need_digest(summary, key, where)
    need_int(summary, "dataset_bytes", where, 0, MAX_ARTIFACT_BYTES)
    need_int(summary, "replay_bytes", where, 1, MAX_ARTIFACT_BYTES)
    need_dict(summary["stats"], where, "stats")
    records = need_list(summary["rollouts"], where, "rollouts")
    if len(records) != groups * group_size:
        raise fail(where, "rollouts", "must hold rollout_count records")
    if ("context_tokens" in summary) != ("context_policy" in summary):
        raise fail(where, "context_policy", "context_tokens and context_policy come together")
    if "context_tokens" in summary:
        need_int(summary, "context_tokens", where, 1)
        if summary["context_policy"] not in ("end", "end_penalised", "window"):
            raise fail(where, "context_policy", "must be 'end', 'end_penalised' or 'window'")
    if "training_selection" in summary:
        need_dict(summary["training_selection"], where, "training_selection")
    if "dynamic_sampling" in summary:
        check_dynamic_sampling(summary["dynamic_sampling"], groups, seed_start, where)
    if "staleness" in summary:
        check_staleness(summary["staleness"], where)
    if "replay_ignore" in summary:
        paths = need_list(summary["replay_ignore"], where, "replay_ignore")
        try:
            if not paths or check_paths(paths) != paths:
                raise ValueError("must be a non-empty, sorted list of unique paths")
        except ValueError as exc:
            raise fail(where, "replay_ignore", str(exc)) from None


def check_dynamic_sampling(block: Any, groups: int, seed_start: int, where: Where) -> None:
    """The refill record (``kiln.core.run_plan.DynamicSamplingRecord``) against the bundle: rounds
    1…n (n ≤ the cap) each collected consecutive groups after the ``target_groups`` first ones,
    every seed is ``seed_start`` + its group index, and together they are the bundle's groups."""
    field = "dynamic_sampling"
    block = need_dict(block, where, field)
    need_keys(block, _DYNAMIC_KEYS, where, field)
    target = need_int(block, "target_groups", where, 1, groups)
    cap = need_int(block, "max_refill_rounds", where, 1, 16)
    signal = need_int(block, "signal_groups", where, 0, target)
    rounds = need_list(block["rounds"], where, f"{field}.rounds")
    if len(rounds) > cap:
        raise fail(where, f"{field}.rounds", f"holds {len(rounds)} rounds; the cap is {cap}")
    following = target
    for number, item in enumerate(rounds, start=1):
        item = need_dict(item, where, f"{field}.rounds[{number - 1}]")
        indexes, seeds = item.get("group_indexes"), item.get("seeds")
        if item.get("round") != number or not isinstance(indexes, list) or not isinstance(seeds, list):
            raise fail(where, f"{field}.rounds[{number - 1}]", f"must be round {number} with group_indexes and seeds")
        if not 1 <= len(indexes) <= target or indexes != list(range(following, following + len(indexes))):
            raise fail(where, f"{field}.rounds[{number - 1}].group_indexes", f"must continue at group {following}")
        if seeds != [seed_start + index for index in indexes]:
            raise fail(where, f"{field}.rounds[{number - 1}].seeds", "must be seed_start + each group index")
        following += len(indexes)
    if following != groups:
        raise fail(where, f"{field}.rounds", f"account for {following} groups; the bundle holds {groups}")
    capped = need_bool(block, "capped", where)
    if capped != (signal < target):
        raise fail(where, f"{field}.capped", "must be true exactly when fewer than target_groups carry variation")


def check_staleness(block: Any, where: Where) -> None:
    """The age of the bundle's data (``kiln.core.stale_pipeline.StalenessRecord``): whole numbers,
    a bound of 1 … ``MAX_STALENESS``. The run verifier checks the version against the chain."""
    block = need_dict(block, where, "staleness")
    need_keys(block, _STALENESS_KEYS, where, "staleness")
    for key, lo, hi in (("max_staleness", 1, MAX_STALENESS), ("behavior_version", 0, None), ("lag", 0, None)):
        value = block[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            raise fail(where, f"staleness.{key}", f"must be a whole number in {lo}..{hi if hi is not None else ''}")


def check_behavior_policy(policy: Any, adapter: str | None, where: Where) -> None:
    """v5: a valid behaviour-policy identity whose adapter name equals the summary's ``adapter``."""
    policy = need_dict(policy, where, "behavior_policy")
    if not is_digest(policy.get("base_model_sha256")):
        raise fail(where, "behavior_policy.base_model_sha256", "must be a sha256 digest")
    if not isinstance(policy.get("runtime"), dict):
        raise fail(where, "behavior_policy.runtime", "must be a JSON object")
    adapter_digest = policy.get("adapter_sha256")
    if adapter is None and adapter_digest is not None:
        raise fail(where, "behavior_policy.adapter_sha256", "must be null for the base model")
    if adapter is not None and not is_digest(adapter_digest):
        raise fail(where, "behavior_policy.adapter_sha256", "must be the adapter's sha256 digest")
    if "adapter" in policy and policy["adapter"] != adapter:
        raise fail(where, "behavior_policy.adapter", "differs from the summary's adapter")


def check_inspection(inspection: Any, where: Where, field: str) -> None:
    """An inspection ``{identity, schema}`` whose schema digest matches its schema document."""
    inspection = need_dict(inspection, where, field)
    need_keys(inspection, frozenset({"identity", "schema"}), where, field)
    identity = need_dict(inspection["identity"], where, f"{field}.identity")
    schema = need_dict(inspection["schema"], where, f"{field}.schema")
    if identity.get("schema") != IDENTITY_SCHEMA:
        raise fail(where, f"{field}.identity.schema", f"must be {IDENTITY_SCHEMA!r}")
    if identity.get("client_profile") != CLIENT_PROFILE:
        raise fail(where, f"{field}.identity.client_profile", f"must be {CLIENT_PROFILE!r}")
    for key in ("base_url", "websocket_url"):
        if not isinstance(identity.get(key), str):
            raise fail(where, f"{field}.identity.{key}", "must be a string")
    if identity.get("authentication") not in ("none", "bearer"):
        raise fail(where, f"{field}.identity.authentication", "must be 'none' or 'bearer'")
    if not isinstance(identity.get("metadata"), dict):
        raise fail(where, f"{field}.identity.metadata", "must be a JSON object")
    if not isinstance(identity.get("environments"), list):
        raise fail(where, f"{field}.identity.environments", "must be a JSON array")
    if identity.get("schema_sha256") != digest_json(schema):
        raise fail(where, f"{field}.identity.schema_sha256", "is not the digest of the schema document")
    if "discovery_sha256" in identity and not is_digest(identity["discovery_sha256"]):
        raise fail(where, f"{field}.identity.discovery_sha256", "must be a sha256 digest")
    if not isinstance(schema.get("action"), dict):
        raise fail(where, f"{field}.schema.action", "must be a JSON object")


def check_record(
    record: Any,
    where: Where,
    *,
    group: dict,
    candidate: dict,
    facts: Any,
    inspection: dict,
    harness_code: str | None = None,
) -> None:
    """One summary ``rollouts`` record against the replay candidate (rebuilt by the collector's builder).

    ``harness_code`` (the completion's) is optional in a record: bundles written before it
    existed omit it; when present it must be the completion's."""
    expected = rollout_record(
        inspection["identity"],
        group_index=group["group_index"],
        candidate_index=candidate["candidate_index"],
        seed=group["seed"],
        **facts.outcome(),
        recoverable_protocol_errors=candidate["recoverable_protocol_errors"],
        model_tokens=candidate["model_tokens"],
        harness_code=harness_code if isinstance(record, dict) and "harness_code" in record else None,
        capacity_retries=candidate.get("capacity_retries"),  # bundles written before it left them
        context_windowed="window" in (candidate.get("context") or {}),
    )
    need_match(record, expected, where, "rollouts[]", "the replay")
