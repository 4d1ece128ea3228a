"""Where two JSON values differ, as dotted field paths (used by reset checks and live replay)."""

from __future__ import annotations

from typing import Any

from kiln.core.canonical import canonical_json


def same_json(a: Any, b: Any) -> bool:
    """Equality of canonical bytes: ``1`` ≠ ``1.0`` ≠ ``true``, key order irrelevant. A value with
    no canonical form (a non-finite float, a non-JSON type) equals nothing: False, never an error."""
    try:
        return canonical_json(a) == canonical_json(b)
    except (TypeError, ValueError):
        return False


def differing_paths(a: Any, b: Any, prefix: str) -> list[str]:
    """Dotted paths of every leaf where two JSON values differ (dicts recursed, others compared)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                out.append(f"{prefix}.{key}")
            elif not same_json(a[key], b[key]):
                out.extend(differing_paths(a[key], b[key], f"{prefix}.{key}"))
        return out
    return [] if same_json(a, b) else [prefix]


def without_paths(value: Any, paths: list[str], prefix: str) -> Any:
    """A copy of ``value`` with the dotted ``paths`` (relative to ``prefix``) removed."""
    if not isinstance(value, dict):
        return value
    return {
        key: without_paths(item, paths, f"{prefix}.{key}")
        for key, item in value.items()
        if f"{prefix}.{key}" not in paths
    }
