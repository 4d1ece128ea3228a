"""Live replay's drift report: every differing field of every candidate, found in one pass.

Live replay (:mod:`kiln.core.rollout.replay_live`) compares every reply and collects a
:class:`Difference` for each differing leaf instead of stopping at the first. The report
(:func:`drift_error`) names each distinct field with how often it differed, shows the recorded and
the live value of the first occurrences (each value cut to ``MAX_VALUE_CHARS``, at most
``MAX_SHOWN`` occurrences, any bearer token in use redacted), and a hint: the ``--ignore`` options
that would pass, and, when the environment answered two same-payload resets differently, that its
resets are random.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.canonical import canonical_json
from kiln.core.errors import ReplayDrift
from kiln.core.jsondiff import same_json
from kiln.core.openenv.credentials import redact

MAX_SHOWN = 32  # occurrences listed with values in details
MAX_FIELDS = 64  # distinct fields listed
MAX_VALUE_CHARS = 160
_MISSING = "<absent>"


@dataclass(frozen=True)
class Difference:
    """One differing leaf: where, and the two values (already bounded and redacted)."""

    group_index: int
    candidate_index: int
    step_index: int | None
    field: str
    recorded: str
    live: str
    environment_index: int = 0

    def as_details(self) -> dict[str, Any]:
        return {
            "group_index": self.group_index,
            "candidate_index": self.candidate_index,
            "step_index": self.step_index,
            "field": self.field,
            "recorded": self.recorded,
            "live": self.live,
        }


def shown(value: Any, secrets: list[str | None]) -> str:
    """A value as compact JSON, any secret redacted, cut to ``MAX_VALUE_CHARS``."""
    if value is _MISSING:
        return _MISSING
    try:
        text = canonical_json(value).decode("utf-8")
    except (TypeError, ValueError):
        text = repr(type(value).__name__)
    for secret in secrets:
        text = redact(text, secret)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def leaf_differences(recorded: Any, live: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """``(path, recorded, live)`` for every leaf where two JSON values differ (dicts recursed; a
    key on one side only gives ``<absent>`` on the other)."""
    if isinstance(recorded, dict) and isinstance(live, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(recorded) | set(live)):
            path = f"{prefix}.{key}"
            if key not in recorded or key not in live:
                out.append((path, recorded.get(key, _MISSING), live.get(key, _MISSING)))
            elif not same_json(recorded[key], live[key]):
                out.extend(leaf_differences(recorded[key], live[key], path))
        return out
    return [] if same_json(recorded, live) else [(prefix, recorded, live)]


def _message(found: list[Difference], fields: list[tuple[str, int]]) -> str:
    candidates = len({(d.group_index, d.candidate_index) for d in found})
    listed = []
    for field, count in fields[:8]:
        first = next(d for d in found if d.field == field)
        where = f"group {first.group_index} candidate {first.candidate_index}" + (
            f" step {first.step_index}" if first.step_index is not None else ""
        )
        listed.append(f"{field} ({count}x, first at {where}: recorded {first.recorded}, live {first.live})")
    more = f"; and {len(fields) - 8} more fields" if len(fields) > 8 else ""
    return (
        f"replay drift in {len(fields)} field{'s' if len(fields) != 1 else ''} over {candidates} "
        f"candidate{'s' if candidates != 1 else ''}: " + "; ".join(listed) + more
    )


def _hint(fields: list[tuple[str, int]], random_resets: dict[int, list[str]], found: list[Difference]) -> str:
    parts = []
    resets = sorted(
        {d.environment_index for d in found if d.field.startswith("reset_observation")} & set(random_resets)
    )
    for index in resets:
        parts.append(
            f"environment {index} answers two resets with the same payload differently "
            f"({', '.join(random_resets[index][:4])}): its reset is random rather than seeded, so no "
            "replay can match it; make the environment's reset use the seed Kiln sends"
        )
    ignorable = [f for f, _ in fields if f.startswith(("result.observation.", "final_state."))]
    if ignorable:
        options = " ".join(f"--ignore {f}" for f in ignorable[:8])
        parts.append(
            f"if these fields are volatile (clocks, ids), replay with {options} (wildcards: * one "
            "segment, ** any number, e.g. result.observation.**.execution_time), and collect new runs "
            "with --replay-ignore for the same paths"
        )
    return "; ".join(parts) or "the environment no longer answers the recorded actions as it did"


def drift_error(found: list[Difference], random_resets: dict[int, list[str]] | None = None) -> ReplayDrift:
    """One :class:`ReplayDrift` for every difference found (``found`` non-empty, in replay order).

    ``details`` keeps the first occurrence's ``group_index``/``candidate_index``/``step_index``/
    ``field``, and adds ``fields`` (each distinct field and its count), ``drifts`` (the first
    ``MAX_SHOWN`` occurrences with values), ``drift_count`` and ``hint``."""
    ordered = sorted(
        found, key=lambda d: (d.group_index, d.candidate_index, -1 if d.step_index is None else d.step_index)
    )
    counts: dict[str, int] = {}
    for difference in ordered:
        counts[difference.field] = counts.get(difference.field, 0) + 1
    fields = list(counts.items())[:MAX_FIELDS]
    first = ordered[0]
    hint = _hint(fields, random_resets or {}, ordered)
    return ReplayDrift(
        _message(ordered, fields),
        hint=hint,
        details={
            "group_index": first.group_index,
            "candidate_index": first.candidate_index,
            "step_index": first.step_index,
            "field": first.field,
            "fields": [{"field": f, "count": n} for f, n in fields],
            "drift_count": len(ordered),
            "drifts": [d.as_details() for d in ordered[:MAX_SHOWN]],
        },
    )
