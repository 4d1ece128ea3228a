"""Live replay of a verified bundle against its environments.

Steps: verify the bundle offline (:func:`kiln.rollout.verify.load_bundle`); re-inspect every
environment and require an identical identity (else ``EnvironmentIdentityChanged`` naming the
fields); then, per candidate, open a fresh capacity-aware session with the exact recorded reset
payload, compare the reset observation, send every recorded action and compare each reply exactly
(canonical JSON of the wire observation, so the reward TYPE counts: ``1`` ≠ ``1.0``; protocol
errors by their whole error object, code and message first), and compare ``final_state`` via a
``state`` request. Candidates that ended ``invalid_model_action`` replay only their environment
prefix (their last action never reached the environment) and are counted as prefix-only.

The first mismatch raises :class:`ReplayDrift` (``openenv_replay_drift``) with
``details = {group_index, candidate_index, step_index, field}``; "first" is deterministic under
concurrency: the lowest ``(group, candidate)`` that drifts is reported (candidates are started in
order and later ones are skipped once an earlier one has drifted). ``step_index`` is ``None`` for
the reset observation and the final state.

Per-session identifiers (issue 12): many environments put a fresh random ``episode_id`` (or
similar) into their state on every reset. Before replaying, each environment is reset twice with
the same payload and its state read: the fields that differ are per-session identifiers, excluded
from the ``final_state`` comparison and listed in the report (``excluded_fields``), never
silently. Fields the run recorded in its summary's ``replay_ignore`` (a wall-clock figure in a
step observation, say) are left out too, and listed. Ordinary capacity refusals are retried
quietly and counted (``capacity_retries``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.canonical import canonical_json
from kiln.errors import (
    EnvironmentIdentityChanged,
    InvalidRequest,
    ReplayDrift,
    RunCancelled,
)
from kiln.jsondiff import differing_paths, without_paths
from kiln.openenv.discovery import identity_differences, inspect_environment
from kiln.openenv.session import (
    TERMINAL_CODES,
    EnvSession,
    StepResult,
    open_session_and_reset,
)
from kiln.openenv.urls import normalize_url
from kiln.rollout.replay_ignore import STATE_PREFIX, STEP_PREFIX, of
from kiln.rollout.verify import Bundle, load_bundle

REPLAY_RUN_SCHEMA = "kiln.openenv-replay-run.v1"


def drift(group: int, candidate: int, step: int | None, field: str, reason: str) -> ReplayDrift:
    where = f"group {group} candidate {candidate}" + (f" step {step}" if step is not None else "")
    return ReplayDrift(
        f"replay drift at {where}, field {field}: {reason}",
        details={"group_index": group, "candidate_index": candidate, "step_index": step, "field": field},
    )


def _same(a: Any, b: Any) -> bool:
    return canonical_json(a) == canonical_json(b)


def first_difference(recorded: Any, live: Any, prefix: str) -> str:
    """A dotted path to the first differing key of two JSON values (for drift messages)."""
    if isinstance(recorded, dict) and isinstance(live, dict):
        for key in sorted(set(recorded) | set(live)):
            if key not in recorded or key not in live or not _same(recorded[key], live[key]):
                return first_difference(recorded.get(key), live.get(key), f"{prefix}.{key}")
    return prefix


def compare_result(
    recorded: dict, live: StepResult, group: int, candidate: int, step: int | None, ignore: list[str] | None = None
) -> None:
    """Compare one live reply with its recorded ``result`` (or reset observation when step is None);
    ``ignore``: ``result.observation.…`` paths left out of a step observation (``replay_ignore``)."""
    if step is None:
        if live.kind != "observation":
            code = (live.error or {}).get("code")
            raise drift(group, candidate, None, "reset_observation", f"reset answered protocol error {code}")
        if not _same(recorded, live.observation):
            field = first_difference(recorded, live.observation, "reset_observation")
            raise drift(group, candidate, None, field, "the reset observation differs from the recording")
        return
    if recorded["kind"] != live.kind:
        raise drift(
            group, candidate, step, "result.kind",
            f"recorded {recorded['kind']}, the environment answered {live.kind}",
        )
    if live.kind == "observation":
        mine = without_paths(recorded["observation"], ignore or [], STEP_PREFIX)
        theirs = without_paths(live.observation, ignore or [], STEP_PREFIX)
        if not _same(mine, theirs):
            field = first_difference(mine, theirs, STEP_PREFIX)
            raise drift(group, candidate, step, field, "the step observation differs from the recording")
        return
    error = live.error or {}
    for key in ("code", "message"):
        if recorded["error"].get(key) != error.get(key):
            raise drift(group, candidate, step, f"result.error.{key}", "the protocol error differs from the recording")
    if not _same(recorded["error"], error):
        field = first_difference(recorded["error"], error, "result.error")
        raise drift(group, candidate, step, field, "the protocol error differs from the recording")


async def reinspect(bundle: Bundle, credentials: list[str | None]) -> None:
    """Every environment's identity must be exactly the recorded one."""
    for index, recorded in enumerate(bundle.summary["environments"]):
        base_url = recorded["identity"]["base_url"]
        live = await inspect_environment(base_url, bearer_token=credentials[index])
        changed = identity_differences(recorded, live)
        if changed:
            raise EnvironmentIdentityChanged(
                f"environment {index} ({base_url}) differs from the recorded identity: " + ", ".join(changed),
                details={"environment_index": index, "environment_url": base_url, "changed_fields": changed},
            )


async def session_identifiers(
    base_url: str, payload: dict, *, bearer_token: str | None, capacity_wait_s: float,
    should_cancel: Callable[[], bool] | None,
) -> tuple[list[str], int]:
    """Fields of ``state`` that differ between two sessions reset with the same payload."""
    states: list[dict] = []
    retries_total = 0
    for _ in range(2):
        session, _reset, retries = await open_session_and_reset(
            normalize_url(base_url), payload, capacity_wait_s=capacity_wait_s,
            bearer_token=bearer_token, should_cancel=should_cancel,
        )
        retries_total += retries
        try:
            states.append(await session.state())
        finally:
            await session.close()
    return differing_paths(states[0], states[1], "final_state"), retries_total


async def replay_candidate(
    group: dict,
    candidate: dict,
    *,
    base_url: str,
    bearer_token: str | None,
    capacity_wait_s: float,
    should_cancel: Callable[[], bool] | None,
    excluded: list[str] | None = None,
    ignore: list[str] | None = None,
) -> int:
    """Replay one candidate; return its capacity retries. Raises ``ReplayDrift`` on a mismatch.

    ``excluded``: ``final_state.*`` paths of per-session identifiers, left out of the comparison;
    ``ignore``: the recorded ``replay_ignore`` paths (step observation and final state fields).
    """
    g, c = group["group_index"], candidate["candidate_index"]
    session: EnvSession
    session, reset, retries = await open_session_and_reset(
        normalize_url(base_url),
        group["reset_payload"],
        capacity_wait_s=capacity_wait_s,
        bearer_token=bearer_token,
        should_cancel=should_cancel,
    )
    try:
        # Under reset_determinism: warn the recording lists the fields resets differed in.
        loose = list(group.get("reset_nondeterministic_fields") or [])
        recorded_reset = without_paths(candidate.get("reset_observation", group["reset_observation"]), loose, "reset_observation")
        if loose and reset.kind == "observation":
            reset = StepResult(kind="observation", observation=without_paths(reset.observation, loose, "reset_observation"))
        compare_result(recorded_reset, reset, g, c, None)
        for exchange in candidate["exchanges"]:
            if should_cancel is not None and should_cancel():
                raise RunCancelled("replay cancelled")
            live = await session.step(exchange["action"])
            compare_result(exchange["result"], live, g, c, exchange["step_index"], of(ignore or [], STEP_PREFIX))
        last = candidate["exchanges"][-1]["result"] if candidate["exchanges"] else None
        ended_terminal = (
            last is not None and last["kind"] == "protocol_error" and last["error"].get("code") in TERMINAL_CODES
        )
        if not ended_terminal:
            skip = list(excluded or []) + of(ignore or [], STATE_PREFIX)
            state = without_paths(await session.state(), skip, "final_state")
            recorded = without_paths(candidate.get("final_state"), skip, "final_state")
            if not _same(recorded, state):
                field = first_difference(recorded, state, "final_state")
                raise drift(g, c, None, field, "the final state differs from the recording")
    finally:
        await session.close()
    return retries


async def replay_bundle(
    summary_path: Path,
    *,
    dataset_path: Path | None = None,
    replay_path: Path | None = None,
    concurrency: int = 4,
    credentials: list[str | None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> dict:
    """Verify offline, then replay every candidate live; return a ``kiln.openenv-replay-run.v1`` report.

    ``credentials`` holds one bearer token (or None) per environment position; the recorded
    ``authentication`` must match (a rotated token value is fine). Raises ``VerificationFailed``,
    ``EnvironmentIdentityChanged``, ``ReplayDrift``, ``RunCancelled`` or a transport ``KilnError``.
    """
    if not 1 <= concurrency <= 256:
        raise InvalidRequest("replay concurrency must be in 1..256")
    bundle = load_bundle(Path(summary_path), dataset_path=dataset_path, replay_path=replay_path)
    environments = bundle.summary["environments"]
    tokens = list(credentials) if credentials else [None] * len(environments)
    if len(tokens) != len(environments):
        raise InvalidRequest(
            f"credentials must have one entry per environment ({len(environments)}), got {len(tokens)}"
        )
    await reinspect(bundle, tokens)
    capacity_wait_s = float(bundle.summary["capacity_wait_seconds"])
    ignore = list(bundle.summary.get("replay_ignore") or [])  # recorded by the run (verified)
    retries_total = 0
    excluded: dict[int, list[str]] = {}
    for group in bundle.replay["groups"]:
        index = group["environment_index"]
        if index not in excluded:
            excluded[index], retries = await session_identifiers(
                environments[index]["identity"]["base_url"], group["reset_payload"],
                bearer_token=tokens[index], capacity_wait_s=capacity_wait_s, should_cancel=should_cancel,
            )
            retries_total += retries

    work = [
        (group, candidate)
        for group in bundle.replay["groups"]
        for candidate in group["candidates"]
    ]
    semaphore = asyncio.Semaphore(concurrency)
    failures: dict[tuple[int, int], BaseException] = {}

    async def run_one(group: dict, candidate: dict) -> None:
        nonlocal retries_total
        key = (group["group_index"], candidate["candidate_index"])
        async with semaphore:
            if any(other < key for other in failures):
                return  # an earlier candidate already drifted; it is the one reported
            if should_cancel is not None and should_cancel():
                raise RunCancelled("replay cancelled")
            try:
                retries_total += await replay_candidate(
                    group,
                    candidate,
                    base_url=environments[group["environment_index"]]["identity"]["base_url"],
                    bearer_token=tokens[group["environment_index"]],
                    capacity_wait_s=capacity_wait_s,
                    should_cancel=should_cancel,
                    excluded=excluded[group["environment_index"]],
                    ignore=ignore,
                )
            except ReplayDrift as exc:
                failures[key] = exc

    results = await asyncio.gather(*(run_one(g, c) for g, c in work), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    if failures:
        raise failures[min(failures)]
    prefix_only = sum(1 for _, c in work if c["termination"] == "invalid_model_action")
    return {
        "schema": REPLAY_RUN_SCHEMA,
        "replay_sha256": bundle.summary["replay_sha256"],
        "environments": len(environments),
        "groups": len(bundle.replay["groups"]),
        "rollouts": len(work),
        "environment_exchanges": bundle.report["environment_exchanges"],
        "capacity_retries": retries_total,
        "environment_prefix_only_rollouts": prefix_only,
        # Per-session identifiers found by two same-payload resets: not compared, always listed.
        "excluded_fields": [
            {"environment_index": index, "field": field, "reason": "differs between two resets with the same payload"}
            for index in sorted(excluded)
            for field in excluded[index]
        ]
        + [
            {"environment_index": group["environment_index"], "group_index": group["group_index"], "field": field,
             "reason": "recorded as non-deterministic (reset_determinism: warn)"}
            for group in bundle.replay["groups"]
            for field in group.get("reset_nondeterministic_fields") or []
        ]
        + [
            {"environment_index": index, "field": field, "reason": "recorded in the summary's replay_ignore"}
            for index in range(len(environments))
            for field in ignore
        ],
    }
