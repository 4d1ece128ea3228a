"""``kiln openenv runs``: the PROMOTED column never contradicts status's ``promoted`` (issue 41)."""

from __future__ import annotations

import pytest

from kiln.cli.control_cmds import promotion_label, runs_row
from kiln.core.run_view import RunSummary

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("promoted", "evaluated", "state", "label"), [
    (True, False, "completed", "yes"),  # promoted without an evaluation (auto_load): status says true
    (True, True, "completed", "yes"),
    (False, True, "completed", "no"),
    (False, False, "completed", "not evaluated"),
    (None, None, "running", "-"),
])
def test_the_column_follows_promoted(promoted: bool | None, evaluated: bool | None, state: str, label: str) -> None:
    run = RunSummary(run_id="r" * 12, state=state, promoted=promoted, evaluated=evaluated)
    assert promotion_label(run) == label
    short = runs_row(run).split()
    assert ("no eval" in runs_row(run)) == (label == "not evaluated")
    assert label == "not evaluated" or label in short
