"""Bounded, strict JSON: the one parser and checker for untrusted JSON (requests, env documents).

Owns the limits every untrusted JSON value must satisfy — nesting depth, integer digits, finite
numbers only (no ``NaN``/``Infinity``/``1e999``) — and reports the first violation with the JSON
path it was found at (``training_config.learning_rate``), never the offending value. Parsing never
recurses past ``MAX_DEPTH`` (the depth is counted on the raw text before ``json.loads`` runs), so a
hostile document can not raise ``RecursionError``.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64
MAX_INT_DIGITS = 40  # every Kiln integer fits in 2^63 (19 digits); 40 leaves room for env data


class JsonBoundsError(ValueError):
    """The document breaks a bound; ``path`` names where (``""`` = the whole document)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path or 'body'}: {reason}")


class _Bad:
    """A placeholder left by the parser where a forbidden number stood (found by the walk)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parse_float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _Bad("must be a finite number (it overflows a 64-bit float)")


def _parse_int(text: str) -> Any:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return _Bad(f"integer has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_constant(name: str) -> Any:
    return _Bad(f"must be a finite number ({name} is not allowed)")


def text_depth(text: str) -> int:
    """The deepest ``[``/``{`` nesting of a JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def loads(raw: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse strict JSON within the bounds; ``JsonBoundsError`` (a ``ValueError``) otherwise.

    A syntax error is a plain ``ValueError`` (``json.JSONDecodeError``), a broken bound a
    ``JsonBoundsError`` naming the path.
    """
    text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
    if text_depth(text) > max_depth:
        raise JsonBoundsError("", f"nesting is deeper than {max_depth} levels")
    value = json.loads(text, parse_float=_parse_float, parse_int=_parse_int, parse_constant=_parse_constant)
    check(value, max_depth=max_depth)
    return value


def check(value: Any, *, max_depth: int = MAX_DEPTH, path: str = "") -> None:
    """Check an already-parsed value: depth, finite floats, integer size; iterative (no recursion)."""
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, _Bad):
            raise JsonBoundsError(where, item.reason)
        if isinstance(item, float) and not math.isfinite(item):
            raise JsonBoundsError(where, "must be a finite number (NaN and Infinity are not JSON)")
        if isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > 133:
            raise JsonBoundsError(where, f"integer has more than {MAX_INT_DIGITS} digits")
        if isinstance(item, (dict, list)):
            if depth >= max_depth:
                raise JsonBoundsError(where, f"nesting is deeper than {max_depth} levels")
            children = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in children:
                stack.append((child, f"{where}.{key}" if where else str(key), depth + 1))
