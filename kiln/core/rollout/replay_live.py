"""Live replay of a verified bundle against its environments.

Steps: verify the bundle offline (:func:`kiln.core.rollout.verify.load_bundle`); re-inspect every
environment and require an identical identity (else ``EnvironmentIdentityChanged`` naming the
fields); then, per candidate, open a fresh capacity-aware session with the exact recorded reset
payload, compare the reset observation, send every recorded action and compare each reply exactly
(canonical JSON of the wire observation, so the reward TYPE counts: ``1`` ≠ ``1.0``; protocol
errors by their whole error object, code and message first), and compare ``final_state`` via a
``state`` request. Candidates that ended ``invalid_model_action`` replay only their environment
prefix (their last action never reached the environment) and are counted as prefix-only.

Every candidate is replayed to its end whatever drifts, and every differing leaf is collected:
one :class:`~kiln.core.rollout.replay_drift.ReplayDrift` (``openenv_replay_drift``) then lists every
field with its count and the recorded and live values (bounded, tokens redacted) and a hint
(:mod:`kiln.core.rollout.replay_drift`); its ``details`` keep the first occurrence's
``group_index``/``candidate_index``/``step_index``/``field`` (lowest group, candidate, step).
``step_index`` is ``None`` for the reset observation and the final state.

Per-session identifiers (issue 12): many environments put a fresh random ``episode_id`` (or
similar) into their state on every reset. Before replaying, each environment is reset twice with
the same payload and its state read: the fields that differ are per-session identifiers, excluded
from the ``final_state`` comparison and listed in the report (``excluded_fields``), never
silently. Fields the run recorded in its summary's ``replay_ignore`` (a wall-clock figure in a
step observation, say) are left out too, and listed; so are the patterns given to this replay
(``--ignore``), listed apart as replay-time ignores. The two same-payload resets also tell a
random-reset environment (its reset observations differ), which a reset drift's hint then names.
Ordinary capacity refusals are retried
quietly and counted per environment: ``environment_capacity.<url>.refusals``, the same name and
meaning as in run status (``CAPACITY_REACHED`` refusals met opening this replay's sessions).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.core.canonical import canonical_json
from kiln.core.errors import EnvironmentIdentityChanged, InvalidRequest, RunCancelled
from kiln.core.jsondiff import differing_paths, without_paths
from kiln.core.openenv.discovery import identity_differences, inspect_environment
from kiln.core.openenv.replies import TERMINAL_CODES, StepResult
from kiln.core.openenv.session import EnvSession
from kiln.core.openenv.session_open import open_session_and_reset
from kiln.core.openenv.urls import normalize_url
from kiln.core.rollout.replay_drift import (  # noqa: F401  (ReplayDrift re-exported: callers catch it here)
    Difference,
    ReplayDrift,
    drift_error,
    leaf_differences,
    shown,
)
from kiln.core.rollout.replay_ignore import STATE_PREFIX, STEP_PREFIX, check_paths, of, without_matching
from kiln.core.rollout.verify import Bundle, load_bundle

REPLAY_RUN_SCHEMA = "kiln.openenv-replay-run.v1"


def _same(a: Any, b: Any) -> bool:
    return canonical_json(a) == canonical_json(b)


@dataclass
class Comparer:
    """Collects every :class:`Difference` of one candidate's replies (values shown redacted)."""

    group: int
    candidate: int
    environment: int = 0
    secrets: list[str | None] = field(default_factory=list)
    found: list[Difference] = field(default_factory=list)

    def values(self, recorded: Any, live: Any, prefix: str, step: int | None) -> None:
        for path, mine, theirs in leaf_differences(recorded, live, prefix):
            self.add(step, path, mine, theirs)

    def add(self, step: int | None, path: str, recorded: Any, live: Any) -> None:
        self.found.append(
            Difference(
                self.group,
                self.candidate,
                step,
                path,
                shown(recorded, self.secrets),
                shown(live, self.secrets),
                self.environment,
            )
        )

    def result(self, recorded: dict, live: StepResult, step: int | None, ignore: list[str] | None = None) -> None:
        """Compare one live reply with its recorded ``result`` (the reset observation when step is
        None); ``ignore``: ``result.observation.…`` patterns left out of a step observation."""
        if step is None:
            if live.kind != "observation":
                self.add(None, "reset_observation", recorded, {"protocol_error": (live.error or {}).get("code")})
            else:
                self.values(recorded, live.observation, "reset_observation", None)
            return
        if recorded["kind"] != live.kind:
            self.add(step, "result.kind", recorded["kind"], live.kind)
            return
        if live.kind == "observation":
            patterns = ignore or []
            mine = without_matching(recorded["observation"], patterns, STEP_PREFIX)
            theirs = without_matching(live.observation, patterns, STEP_PREFIX)
            self.values(mine, theirs, STEP_PREFIX, step)
            return
        self.values(recorded["error"], live.error or {}, "result.error", step)


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
    base_url: str,
    payload: dict,
    *,
    bearer_token: str | None,
    capacity_wait_s: float,
    should_cancel: Callable[[], bool] | None,
) -> tuple[list[str], list[str], int]:
    """``(state fields, reset observation fields, capacity retries)``: what differs between two
    sessions reset with the same payload (per-session identifiers; a random reset)."""
    states: list[dict] = []
    resets: list[Any] = []
    retries_total = 0
    for _ in range(2):
        session, reset, retries = await open_session_and_reset(
            normalize_url(base_url),
            payload,
            capacity_wait_s=capacity_wait_s,
            bearer_token=bearer_token,
            should_cancel=should_cancel,
        )
        retries_total += retries
        resets.append(reset.observation if reset.kind == "observation" else reset.error)
        try:
            states.append(await session.state())
        finally:
            await session.close()
    return (
        differing_paths(states[0], states[1], "final_state"),
        differing_paths(resets[0], resets[1], "reset_observation"),
        retries_total,
    )


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
    environment_index: int = 0,
) -> tuple[int, list[Difference]]:
    """Replay one candidate; return its capacity retries and every difference found (all its steps
    are replayed whatever drifts).

    ``excluded``: ``final_state.*`` paths of per-session identifiers, left out of the comparison;
    ``ignore``: ``replay_ignore`` patterns (step observation and final state fields).
    """
    g, c = group["group_index"], candidate["candidate_index"]
    compare = Comparer(g, c, environment_index, [bearer_token])
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
        recorded_reset = without_paths(
            candidate.get("reset_observation", group["reset_observation"]), loose, "reset_observation"
        )
        if loose and reset.kind == "observation":
            reset = StepResult(
                kind="observation", observation=without_paths(reset.observation, loose, "reset_observation")
            )
        compare.result(recorded_reset, reset, None)
        for exchange in candidate["exchanges"]:
            if should_cancel is not None and should_cancel():
                raise RunCancelled("replay cancelled")
            live = await session.step(exchange["action"])
            compare.result(exchange["result"], live, exchange["step_index"], of(ignore or [], STEP_PREFIX))
        last = candidate["exchanges"][-1]["result"] if candidate["exchanges"] else None
        ended_terminal = (
            last is not None and last["kind"] == "protocol_error" and last["error"].get("code") in TERMINAL_CODES
        )
        if not ended_terminal:
            skip = of(ignore or [], STATE_PREFIX)
            state = without_matching(
                without_paths(await session.state(), excluded or [], "final_state"), skip, "final_state"
            )
            recorded = without_matching(
                without_paths(candidate.get("final_state"), excluded or [], "final_state"), skip, "final_state"
            )
            compare.values(recorded, state, "final_state", None)
    finally:
        await session.close()
    return retries, compare.found


async def replay_bundle(
    summary_path: Path,
    *,
    dataset_path: Path | None = None,
    replay_path: Path | None = None,
    concurrency: int = 4,
    credentials: list[str | None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    ignore: list[str] | None = None,
) -> dict:
    """Verify offline, then replay every candidate live; return a ``kiln.openenv-replay-run.v1`` report.

    ``credentials`` holds one bearer token (or None) per environment position; the recorded
    ``authentication`` must match (a rotated token value is fine). ``ignore``: patterns given at
    replay time (``--ignore``), left out like the sealed ``replay_ignore`` and reported apart.
    Every candidate is replayed; all their differences raise one ``ReplayDrift``. Raises
    ``VerificationFailed``, ``EnvironmentIdentityChanged``, ``ReplayDrift``, ``RunCancelled`` or a
    transport ``KilnError``.
    """
    if not 1 <= concurrency <= 256:
        raise InvalidRequest("replay concurrency must be in 1..256")
    try:
        extra = check_paths(list(ignore or []))
    except ValueError as exc:
        raise InvalidRequest(f"--ignore: {exc}", hint="paths start with result.observation. or final_state.") from None
    bundle = load_bundle(Path(summary_path), dataset_path=dataset_path, replay_path=replay_path)
    environments = bundle.summary["environments"]
    tokens: list[str | None] = list(credentials) if credentials else [None] * len(environments)
    if len(tokens) != len(environments):
        raise InvalidRequest(
            f"credentials must have one entry per environment ({len(environments)}), got {len(tokens)}"
        )
    await reinspect(bundle, tokens)
    capacity_wait_s = float(bundle.summary["capacity_wait_seconds"])
    sealed = list(bundle.summary.get("replay_ignore") or [])  # recorded by the run (verified)
    refusals = dict.fromkeys(range(len(environments)), 0)  # per environment index
    excluded: dict[int, list[str]] = {}
    random_resets: dict[int, list[str]] = {}
    for group in bundle.replay["groups"]:
        index = group["environment_index"]
        if index not in excluded:
            excluded[index], reset_fields, retries = await session_identifiers(
                environments[index]["identity"]["base_url"],
                group["reset_payload"],
                bearer_token=tokens[index],
                capacity_wait_s=capacity_wait_s,
                should_cancel=should_cancel,
            )
            if reset_fields:
                random_resets[index] = reset_fields
            refusals[index] += retries

    work = [(group, candidate) for group in bundle.replay["groups"] for candidate in group["candidates"]]
    semaphore = asyncio.Semaphore(concurrency)
    found: list[Difference] = []

    async def run_one(group: dict, candidate: dict) -> None:
        async with semaphore:
            if should_cancel is not None and should_cancel():
                raise RunCancelled("replay cancelled")
            index = group["environment_index"]
            retries, differences = await replay_candidate(
                group,
                candidate,
                base_url=environments[index]["identity"]["base_url"],
                bearer_token=tokens[index],
                capacity_wait_s=capacity_wait_s,
                should_cancel=should_cancel,
                excluded=excluded[index],
                ignore=sealed + extra,
                environment_index=index,
            )
            refusals[index] += retries
            found.extend(differences)

    results = await asyncio.gather(*(run_one(g, c) for g, c in work), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    if found:
        raise drift_error(found, random_resets)
    return _report(bundle, work, refusals, excluded, sealed, extra)


def _report(
    bundle: Bundle,
    work: list,
    refusals: dict[int, int],
    excluded: dict[int, list[str]],
    sealed: list[str],
    extra: list[str],
) -> dict:
    environments = bundle.summary["environments"]
    prefix_only = sum(1 for _, c in work if c["termination"] == "invalid_model_action")
    return {
        "schema": REPLAY_RUN_SCHEMA,
        "replay_sha256": bundle.summary["replay_sha256"],
        "environments": len(environments),
        "groups": len(bundle.replay["groups"]),
        "rollouts": len(work),
        "environment_exchanges": bundle.report["environment_exchanges"],
        # CAPACITY_REACHED refusals per environment (its URL), named as in run status.
        "environment_capacity": {
            env["identity"]["base_url"]: {"refusals": refusals[index]} for index, env in enumerate(environments)
        },
        "environment_prefix_only_rollouts": prefix_only,
        "replay_ignore": {"sealed": sealed, "replay_time": extra},
        # Per-session identifiers found by two same-payload resets: not compared, always listed.
        "excluded_fields": [
            {"environment_index": index, "field": field, "reason": "differs between two resets with the same payload"}
            for index in sorted(excluded)
            for field in excluded[index]
        ]
        + [
            {
                "environment_index": group["environment_index"],
                "group_index": group["group_index"],
                "field": field,
                "reason": "recorded as non-deterministic (reset_determinism: warn)",
            }
            for group in bundle.replay["groups"]
            for field in group.get("reset_nondeterministic_fields") or []
        ]
        + [
            {"environment_index": index, "field": field, "reason": "recorded in the summary's replay_ignore"}
            for index in range(len(environments))
            for field in sealed
        ]
        + [
            {
                "environment_index": index,
                "field": field,
                "reason": "given to this replay (--ignore), not sealed in the bundle",
            }
            for index in range(len(environments))
            for field in extra
        ],
    }
