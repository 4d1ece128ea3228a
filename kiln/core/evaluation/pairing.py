"""Pair the baseline and candidate evaluation bundles seed group by seed group.

Both sides were collected with the same URLs, reset plan, seeds, group size and candidate indices,
so their replay transcripts and summaries must line up exactly. Any drift means the comparison is
not paired any more and the evaluation fails (``environment_evaluation_failed``) with a message
naming the group and the field:

- replay ``environments`` equal (canonical JSON);
- per replay group (in order): ``group_index``, ``environment_index``, ``seed``, ``reset_payload``,
  ``reset_observation``, candidate count and candidate indices equal; when both summaries record
  ``reset_determinism: warn`` (the user declared that the environment ignores the seed for part of
  its reset) the reset observations may differ: the groups are then paired by seed and reset payload,
  and each paired group lists the reset fields that differed (``reset_differences``);
- per summary episode (``rollouts`` records, in order): ``group_index``, ``candidate_index``,
  ``environment_name``, ``environment_url`` and ``seed`` equal;
- every ``episode_return`` is a finite number.

Each side is also checked for internal consistency (an episode belongs to a replay group of the same
seed, and each group's episodes are exactly its replay candidates), and the collection settings a
summary records (group size, max steps, temperature, ...) must agree where both sides record them.

The means of a group are over its ``group_size`` episodes (``math.fsum``): replications within a
seed average into one paired observation and never add significance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kiln.core.canonical import canonical_json
from kiln.core.errors import EnvironmentEvaluationFailed
from kiln.core.jsondiff import differing_paths

_MISSING = object()

# Summary fields that describe how episodes were collected; equal on both sides.
SETTING_FIELDS = (
    "groups",
    "group_size",
    "rollout_count",
    "seed_start",
    "max_steps",
    "max_action_tokens",
    "thinking_budget_tokens",
    "temperature",
    "thinking",
    "protocol_error_reward",
    "max_recoverable_errors",
    "capacity_wait_seconds",
    "reset_determinism",
    "reset_plan_sha256",
)
EPISODE_FIELDS = ("group_index", "candidate_index", "environment_name", "environment_url", "seed")
GROUP_FIELDS = ("group_index", "environment_index", "seed", "reset_payload", "reset_observation")


@dataclass(frozen=True)
class PairedGroup:
    """One held-out seed group seen by both policies."""

    group_index: int
    seed: int
    baseline_mean: float
    candidate_mean: float
    baseline_returns: tuple[float, ...] = ()
    candidate_returns: tuple[float, ...] = ()
    # Reset fields the two sides saw differently (only under ``reset_determinism: warn``).
    reset_differences: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.baseline_returns) != len(self.candidate_returns):
            raise ValueError("a paired group needs as many baseline as candidate returns")
        for value in (self.baseline_mean, self.candidate_mean, *self.baseline_returns, *self.candidate_returns):
            if not math.isfinite(value):
                raise ValueError("paired returns must be finite")

    @property
    def episodes(self) -> int:
        """Paired episodes in this group (1 when only the means were given)."""
        return len(self.candidate_returns) or 1

    def returns(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``(baseline, candidate)`` episode returns; the means stand in when none were given."""
        if self.candidate_returns:
            return self.baseline_returns, self.candidate_returns
        return (self.baseline_mean,), (self.candidate_mean,)

    @property
    def sign(self) -> int:
        """``+1`` improved, ``-1`` regressed, ``0`` tied (exact comparison of the group means)."""
        if self.candidate_mean > self.baseline_mean:
            return 1
        if self.candidate_mean < self.baseline_mean:
            return -1
        return 0


_RESET_HINT = (
    'the environment\'s reset is not a function of the seed; set reset_determinism: "warn" to pair '
    "the held-out groups by seed and reset payload anyway (the differing fields are recorded)"
)


def _drift(message: str, hint: str | None = None, **details: Any) -> EnvironmentEvaluationFailed:
    return EnvironmentEvaluationFailed(
        "paired evaluation drift: " + message, retryable=False, hint=hint, details=details
    )


def _show(value: Any, limit: int = 120) -> str:
    try:
        text = canonical_json(value).decode("utf-8")
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _same(a: Any, b: Any) -> bool:
    if a is _MISSING or b is _MISSING:
        return a is b
    try:
        return canonical_json(a) == canonical_json(b)
    except (TypeError, ValueError):
        return False


def _list(doc: Any, key: str, side: str, kind: str) -> list[Any]:
    if not isinstance(doc, dict):
        raise _drift(f"{side} {kind} is not a JSON object", side=side, field=kind)
    value = doc.get(key)
    if not isinstance(value, list):
        raise _drift(f"{side} {kind} has no '{key}' list", side=side, field=key)
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise _drift(f"{side} {kind} {key}[{index}] is not an object", side=side, field=key)
    return value


def _finite_return(record: dict[str, Any], side: str) -> float:
    value = record.get("episode_return")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _drift(
            f"group {record.get('group_index')} candidate {record.get('candidate_index')}: "
            f"{side} episode_return {value!r} is not a finite number",
            group_index=record.get("group_index"),
            field="episode_return",
            side=side,
        )
    return float(value)


def _check_settings(baseline: dict[str, Any], candidate: dict[str, Any]) -> None:
    for name in SETTING_FIELDS:
        a, b = baseline.get(name, _MISSING), candidate.get(name, _MISSING)
        if a is _MISSING and b is _MISSING:
            continue
        if not _same(a, b):
            raise _drift(f"summary {name} differs (baseline {_show(a)}, candidate {_show(b)})", field=name)


def _check_groups(base_groups: list[dict], cand_groups: list[dict], *, reset_warn: bool) -> dict[Any, tuple[str, ...]]:
    """Check the groups line up; return the reset fields that differed, per group (warn mode)."""
    differences: dict[Any, tuple[str, ...]] = {}
    if len(base_groups) != len(cand_groups):
        raise _drift(
            f"replay group count differs (baseline {len(base_groups)}, candidate {len(cand_groups)})",
            field="groups",
        )
    for position, (a, b) in enumerate(zip(base_groups, cand_groups)):
        label = a.get("group_index", position)
        for name in GROUP_FIELDS:
            va, vb = a.get(name, _MISSING), b.get(name, _MISSING)
            if va is _MISSING or not _same(va, vb):
                if name == "reset_observation" and reset_warn and va is not _MISSING and vb is not _MISSING:
                    differences[label] = tuple(differing_paths(va, vb, name))
                    continue
                raise _drift(
                    f"group {label}: {name} differs (baseline {_show(va)}, candidate {_show(vb)})",
                    _RESET_HINT if name == "reset_observation" else None,
                    group_index=label,
                    field=name,
                )
        ca, cb = a.get("candidates"), b.get("candidates")
        if not isinstance(ca, list) or not isinstance(cb, list):
            raise _drift(f"group {label}: replay candidates missing", group_index=label, field="candidates")
        if len(ca) != len(cb):
            raise _drift(
                f"group {label}: candidate_count differs (baseline {len(ca)}, candidate {len(cb)})",
                group_index=label,
                field="candidate_count",
            )
        ia = [c.get("candidate_index") if isinstance(c, dict) else None for c in ca]
        ib = [c.get("candidate_index") if isinstance(c, dict) else None for c in cb]
        if ia != ib:
            raise _drift(
                f"group {label}: candidate_index values differ (baseline {ia}, candidate {ib})",
                group_index=label,
                field="candidate_index",
            )
    return differences


def _index_side(groups: list[dict], records: list[dict], side: str) -> dict[int, list[float]]:
    """Check one side's summary against its own replay; return returns per group index."""
    by_index: dict[int, dict] = {}
    for group in groups:
        index = group["group_index"]
        if isinstance(index, bool) or not isinstance(index, int) or index in by_index:
            raise _drift(f"{side} replay has a bad or duplicate group_index {index!r}", side=side, field="group_index")
        by_index[index] = group
    returns: dict[int, list[float]] = {index: [] for index in by_index}
    seen: dict[int, list[Any]] = {index: [] for index in by_index}
    for record in records:
        index = record.get("group_index")
        if not isinstance(index, int) or index not in by_index:
            raise _drift(
                f"{side} episode names group {index!r}, which its replay does not have",
                side=side,
                group_index=index,
                field="group_index",
            )
        group = by_index[index]
        if not _same(record.get("seed", _MISSING), group["seed"]):
            raise _drift(
                f"group {index}: {side} episode seed {_show(record.get('seed'))} differs from its "
                f"replay group seed {_show(group['seed'])}",
                side=side,
                group_index=index,
                field="seed",
            )
        seen[index].append(record.get("candidate_index"))
        returns[index].append(_finite_return(record, side))
    for index, group in by_index.items():
        candidates = group["candidates"]
        expected = [c.get("candidate_index") if isinstance(c, dict) else None for c in candidates]
        if sorted(seen[index], key=repr) != sorted(expected, key=repr):
            raise _drift(
                f"group {index}: {side} episode candidate_index values {seen[index]} do not "
                f"match its replay candidates {expected}",
                side=side,
                group_index=index,
                field="candidate_index",
            )
    return returns


def pair_summaries(
    baseline_summary: dict[str, Any],
    candidate_summary: dict[str, Any],
    baseline_replay: dict[str, Any],
    candidate_replay: dict[str, Any],
) -> list[PairedGroup]:
    """Check the two bundles are paired and return one ``PairedGroup`` per seed group,
    ordered as in the replay. Raises ``EnvironmentEvaluationFailed`` on any drift."""
    base_records = _list(baseline_summary, "rollouts", "baseline", "summary")
    cand_records = _list(candidate_summary, "rollouts", "candidate", "summary")
    base_groups = _list(baseline_replay, "groups", "baseline", "replay")
    cand_groups = _list(candidate_replay, "groups", "candidate", "replay")
    if not base_groups:
        raise _drift("the evaluation bundles contain no seed groups", field="groups")

    if not _same(baseline_replay.get("environments", _MISSING), candidate_replay.get("environments", _MISSING)):
        raise _drift("replay environments differ between baseline and candidate", field="environments")
    _check_settings(baseline_summary, candidate_summary)
    differences = _check_groups(
        base_groups, cand_groups, reset_warn=baseline_summary.get("reset_determinism") == "warn"
    )

    if len(base_records) != len(cand_records):
        raise _drift(
            f"episode count differs (baseline {len(base_records)}, candidate {len(cand_records)})",
            field="rollouts",
        )
    for position, (a, b) in enumerate(zip(base_records, cand_records)):
        for name in EPISODE_FIELDS:
            va, vb = a.get(name, _MISSING), b.get(name, _MISSING)
            if va is _MISSING or not _same(va, vb):
                raise _drift(
                    f"group {a.get('group_index')} candidate {a.get('candidate_index')} "
                    f"(episode {position}): {name} differs (baseline {_show(va)}, "
                    f"candidate {_show(vb)})",
                    group_index=a.get("group_index"),
                    episode=position,
                    field=name,
                )

    base_returns = _index_side(base_groups, base_records, "baseline")
    cand_returns = _index_side(cand_groups, cand_records, "candidate")
    paired: list[PairedGroup] = []
    for group in base_groups:
        index = group["group_index"]
        br, cr = base_returns[index], cand_returns[index]
        if not br:
            raise _drift(f"group {index} has no episodes", group_index=index, field="candidates")
        paired.append(
            PairedGroup(
                group_index=index,
                seed=group["seed"],
                baseline_mean=math.fsum(br) / len(br),
                candidate_mean=math.fsum(cr) / len(cr),
                baseline_returns=tuple(br),
                candidate_returns=tuple(cr),
                reset_differences=differences.get(index, ()),
            )
        )
    return paired


__all__ = ["EnvironmentEvaluationFailed", "PairedGroup", "pair_summaries"]
