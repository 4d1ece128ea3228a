"""Canonical JSON and ``sha256:<hex>`` digests — the one implementation used everywhere.

Canonical form: object keys sorted recursively (by their UTF-8 bytes, which equals code-point order
for Python strings), arrays keep their order, compact separators ``,`` and ``:``, non-ASCII written
as UTF-8, only mandatory escapes, NaN/Infinity rejected. Numbers are rendered by Python's ``json``
module (``1.0`` stays ``1.0``; ``1e-07`` stays ``1e-07``): this is Kiln's documented choice.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, TypeGuard

DIGEST_PREFIX = "sha256:"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def canonical_json(value: Any) -> bytes:
    """Serialise ``value`` to canonical JSON bytes."""
    return json.dumps(
        value,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def compact_json(value: Any) -> bytes:
    """Compact JSON that keeps the caller's key order (used where order is part of the format)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def pretty_json(value: Any) -> bytes:
    """Byte-stable human-readable JSON (sorted keys, two-space indent, trailing newline)."""
    return (json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def strict_loads(text: str | bytes, *, max_depth: int | None = None) -> Any:
    """Untrusted JSON through the one bounded parser (``kiln.core.boundedjson``): no NaN/Infinity, no
    overflowing numbers, nesting bounded. Raises ``ValueError`` (``JsonBoundsError`` names the
    path) and never ``RecursionError``."""
    from kiln.core import boundedjson

    return boundedjson.loads(text, max_depth=max_depth or boundedjson.MAX_DEPTH)


def canonical_copy(value: Any) -> Any:
    """``value`` exactly as a canonical-JSON file gives it back: every object's keys in sorted
    order (an object's key order as a server sent it is not part of its value)."""
    return json.loads(canonical_json(value))


def sha256_bytes(data: bytes) -> str:
    """``sha256:<hex>`` of raw bytes."""
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def file_sha256(path: Any) -> str:
    """``sha256:<hex>`` of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return DIGEST_PREFIX + h.hexdigest()


def digest_json(value: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``value``."""
    return sha256_bytes(canonical_json(value))


def is_digest(text: Any) -> TypeGuard[str]:
    """True when ``text`` is a well-formed ``sha256:`` digest string."""
    return isinstance(text, str) and bool(_DIGEST_RE.match(text))


def hex_of(digest: str) -> str:
    """The 64 hex characters of a ``sha256:`` digest."""
    if not is_digest(digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return digest[len(DIGEST_PREFIX) :]
