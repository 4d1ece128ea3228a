"""Verification failures and the typed value checks every verifier module uses.

A failure names its location (:class:`Where`: file, group, candidate, step) and the field; the
``need_*`` helpers check one JSON value's type and bounds, ``same_*`` compare values exactly.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, TypeGuard

from kiln.core.canonical import is_digest
from kiln.core.jsondiff import same_json
from kiln.core.errors import VerificationFailed

SUMMARY_FILE, DATASET_FILE, REPLAY_FILE = "summary", "dataset", "replay"


@dataclass(frozen=True)
class Where:
    """Location of a check, rendered into messages and ``details``."""

    file: str
    group: int | None = None
    candidate: int | None = None
    step: int | None = None

    def at(self, **changes: int | None) -> "Where":
        values = {"file": self.file, "group": self.group, "candidate": self.candidate, "step": self.step}
        values.update(changes)
        return Where(**values)  # type: ignore[arg-type]  # file is a str, the rest int | None


def fail(where: Where, field: str, reason: str) -> VerificationFailed:
    """Build the error for a violation of ``field`` at ``where``."""
    parts = [where.file]
    if where.group is not None:
        parts.append(f"group {where.group}")
    if where.candidate is not None:
        parts.append(f"candidate {where.candidate}")
    if where.step is not None:
        parts.append(f"step {where.step}")
    parts.append(f"field {field}")
    return VerificationFailed(
        " ".join(parts) + f": {reason}",
        details={
            "file": where.file,
            "group_index": where.group,
            "candidate_index": where.candidate,
            "step_index": where.step,
            "field": field,
        },
    )


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def same_float(a: Any, b: Any) -> bool:
    """Bitwise equality of two JSON floats (ints and bools never equal a float here)."""
    return isinstance(a, float) and isinstance(b, float) and _bits(a) == _bits(b)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def need_int(doc: dict, key: str, where: Where, lo: int = 0, hi: int | None = None) -> int:
    value = doc.get(key)
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise fail(where, key, f"must be an integer in {bound}")
    return value


def need_float(doc: dict, key: str, where: Where) -> float:
    value = doc.get(key)
    if not isinstance(value, float) or not math.isfinite(value):
        raise fail(where, key, "must be a finite JSON float")
    return value


def need_bool(doc: dict, key: str, where: Where) -> bool:
    value = doc.get(key)
    if not isinstance(value, bool):
        raise fail(where, key, "must be a boolean")
    return value


def need_digest(doc: dict, key: str, where: Where) -> str:
    value = doc.get(key)
    if not is_digest(value):
        raise fail(where, key, "must be a 'sha256:<64 lowercase hex>' digest")
    return value


def need_dict(value: Any, where: Where, field: str) -> dict:
    if not isinstance(value, dict):
        raise fail(where, field, "must be a JSON object")
    return value


def need_list(value: Any, where: Where, field: str) -> list:
    if not isinstance(value, list):
        raise fail(where, field, "must be a JSON array")
    return value


def need_keys(doc: dict, required: frozenset, where: Where, field: str, optional: frozenset = frozenset()) -> None:
    missing = sorted(required - set(doc))
    if missing:
        raise fail(where, f"{field}.{missing[0]}" if field else missing[0], "is missing")
    extra = sorted(set(doc) - required - optional)
    if extra:
        raise fail(where, f"{field}.{extra[0]}" if field else extra[0], "is not a known field")


def need_equal(actual: Any, expected: Any, where: Where, field: str, what: str) -> None:
    if not same_json(actual, expected):
        raise fail(where, field, f"does not match {what}")


def need_match(doc: Any, expected: dict, where: Where, field: str, what: str) -> dict:
    """``doc`` is an object with exactly ``expected``'s keys and values; floats compare bitwise."""
    doc = need_dict(doc, where, field)
    need_keys(doc, frozenset(expected), where, field)
    for key, value in expected.items():
        if isinstance(value, float):
            if not same_float(doc[key], value):
                raise fail(where, f"{field}.{key}", f"is not bit-identical to {what}")
        else:
            need_equal(doc[key], value, where, f"{field}.{key}", what)
    return doc
