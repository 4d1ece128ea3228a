"""Fields live replay must not compare (``replay_ignore``): the rule for their paths, in one place.

A path is dotted and named exactly as a replay drift names a field: ``result.observation.…`` for a
field of a step's observation (e.g. ``result.observation.metadata.execution_time``, a wall-clock
figure) or ``final_state.…`` for a field of the state read after the episode. OpenEnv sends a
step's ``metadata`` twice (beside the observation and inside it), so a
``result.observation.metadata.…`` path covers both copies. A run records its
paths in the rollout summary, so ``kiln openenv replay`` leaves them out without being told again,
and lists every one in its report. ``kiln openenv replay --ignore PATH`` adds paths at replay time
(reported apart from the sealed ones).

Wildcards: a segment ``*`` matches exactly one segment, ``**`` any number of segments (none
included), so ``result.observation.**.execution_time`` covers ``execution_time`` at any depth of
a step observation, both metadata copies included.
"""

from __future__ import annotations

import re
from typing import Any

STEP_PREFIX = "result.observation"
STATE_PREFIX = "final_state"
MAX_PATHS = 64
MAX_PATH_CHARS = 256
_SEGMENT = re.compile(r"[^.\s]+")


def path_error(path: Any) -> str | None:
    """Why ``path`` is not a replay-ignore path (None: it is one)."""
    if not isinstance(path, str) or not 1 <= len(path) <= MAX_PATH_CHARS:
        return f"must be a dotted path of 1..{MAX_PATH_CHARS} characters"
    prefix = next((p for p in (STEP_PREFIX, STATE_PREFIX) if path.startswith(p + ".")), None)
    if prefix is None:
        return f"{path!r} must start with {STEP_PREFIX}. (a step observation field) or {STATE_PREFIX}. (a final state field)"
    parts = path[len(prefix) + 1 :].split(".")
    if not all(_SEGMENT.fullmatch(part) for part in parts):
        return f"{path!r} has an empty or blank segment"
    if any("*" in part and part not in ("*", "**") for part in parts):
        return f"{path!r}: a wildcard is a whole segment, * (one segment) or ** (any number)"
    return None


def matches(pattern: str, path: str) -> bool:
    """Whether dotted ``path`` is covered by ``pattern`` (``*``: one segment, ``**``: any number)."""
    return _match(pattern.split("."), path.split("."))


def _match(pattern: list[str], path: list[str]) -> bool:
    if not pattern:
        return not path
    head = pattern[0]
    if head == "**":
        return any(_match(pattern[1:], path[cut:]) for cut in range(len(path) + 1))
    return bool(path) and (head == "*" or head == path[0]) and _match(pattern[1:], path[1:])


def without_matching(value: Any, patterns: list[str], prefix: str) -> Any:
    """A copy of ``value`` without the keys whose dotted path (from ``prefix``) a pattern covers."""
    if not isinstance(value, dict) or not patterns:
        return value
    return {
        key: without_matching(item, patterns, f"{prefix}.{key}")
        for key, item in value.items()
        if not any(matches(pattern, f"{prefix}.{key}") for pattern in patterns)
    }


def check_paths(paths: list[str]) -> list[str]:
    """``paths`` sorted and unique; ValueError naming the first bad one."""
    if len(paths) > MAX_PATHS:
        raise ValueError(f"at most {MAX_PATHS} paths")
    for path in paths:
        problem = path_error(path)
        if problem:
            raise ValueError(problem)
    return sorted(set(paths))


def of(paths: list[str], prefix: str) -> list[str]:
    """The paths under ``prefix`` (``STEP_PREFIX`` or ``STATE_PREFIX``); a step's top-level
    ``metadata`` path brings the copy nested in the observation along."""
    out = [path for path in paths if path.startswith(prefix + ".")]
    metadata = f"{STEP_PREFIX}.metadata."
    twins = [f"{STEP_PREFIX}.observation.metadata." + p[len(metadata) :] for p in out if p.startswith(metadata)]
    return out + twins
