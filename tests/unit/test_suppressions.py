"""Every ``noqa`` and ``type: ignore`` in the product folders names its codes and says why.

A suppression reads ``# noqa: CODE - why`` (or ``(why)``) and ``# type: ignore[code]  # why``.
``PENDING`` held the files whose bare suppressions predated this rule; every one now carries its
reason, and it stays empty.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("kiln", "api", "activities", "workers", "workflows")
NOQA = re.compile(r"#\s*noqa(?P<codes>:\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(?P<rest>.*)$")
TYPE_IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]+\])?(?P<rest>.*)$")

# Bare suppressions that predate this rule (file: count). Each has been given its reason; the list
# stays empty: a new bare suppression fails the test.
PENDING: dict[str, int] = {}


def bare_suppressions(text: str) -> list[int]:
    """Line numbers of suppressions without codes or without a reason after them."""
    bare = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in (NOQA, TYPE_IGNORE):
            match = pattern.search(line)
            if match is None:
                continue
            reason = match.group("rest").strip().lstrip("-—:#(").strip()
            if not match.group("codes") or len(reason) < 3:
                bare.append(number)
    return bare


def _counts() -> dict[str, int]:
    counts = {}
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            bare = bare_suppressions(path.read_text(encoding="utf-8"))
            if bare:
                counts[path.relative_to(ROOT).as_posix()] = len(bare)
    return counts


@pytest.mark.timeout(60)
def test_every_suppression_names_its_codes_and_its_reason() -> None:
    counts = _counts()
    grown = {path: n for path, n in counts.items() if n > PENDING.get(path, 0)}
    assert grown == {}, "give each suppression its codes and a reason: # noqa: CODE - why"


@pytest.mark.timeout(30)
def test_the_rule_reads_the_forms_it_asks_for() -> None:
    good = (
        "x = 1  # noqa: BLE001 - best effort\n"
        "y = f()  # type: ignore[arg-type]  # the SDK's stub is too narrow\n"
        "import z  # noqa: F401 (re-exported)\n"
    )
    assert bare_suppressions(good) == []
    planted = "a = 1  # noqa\nb = 2  # noqa: E402\nc = g()  # type: ignore\nd = h()  # type: ignore[misc]\n"
    assert bare_suppressions(planted) == [1, 2, 3, 4]
