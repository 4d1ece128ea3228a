"""Replay-ignore wildcards (kiln.core.rollout.replay_ignore) and the drift report's bounds."""

from __future__ import annotations

import pytest

from kiln.core.rollout.replay_drift import MAX_VALUE_CHARS, Difference, drift_error, leaf_differences, shown
from kiln.core.rollout.replay_ignore import check_paths, matches, path_error, without_matching

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("pattern", "path", "expected"), [
    ("result.observation.**.execution_time", "result.observation.metadata.execution_time", True),
    ("result.observation.**.execution_time", "result.observation.observation.metadata.execution_time", True),
    ("result.observation.**.execution_time", "result.observation.execution_time", True),  # ** may be empty
    ("result.observation.*.execution_time", "result.observation.execution_time", False),  # * is one segment
    ("result.observation.*.execution_time", "result.observation.metadata.execution_time", True),
    ("result.observation.*.execution_time", "result.observation.a.b.execution_time", False),
    ("final_state.clock", "final_state.clock.ms", False),
    ("final_state.**", "final_state.clock.ms", True),
])
def test_wildcards(pattern: str, path: str, expected: bool) -> None:
    assert matches(pattern, path) is expected


def test_partial_wildcards_are_refused_and_whole_ones_pass() -> None:
    assert "whole segment" in path_error("result.observation.exec*")
    assert check_paths(["result.observation.**.execution_time"]) == ["result.observation.**.execution_time"]


def test_without_matching_drops_every_covered_key() -> None:
    wire = {"observation": {"metadata": {"execution_time": 1, "x": 2}}, "metadata": {"execution_time": 3}, "reward": 1}
    assert without_matching(wire, ["result.observation.**.execution_time"], "result.observation") == {
        "observation": {"metadata": {"x": 2}}, "metadata": {}, "reward": 1}


def test_the_report_bounds_values_and_redacts_the_token() -> None:
    token = "sk-secret-token-123"
    assert shown("x" * 1000, []) == '"' + "x" * (MAX_VALUE_CHARS - 2) + "…"
    assert token not in shown({"echo": f"Bearer {token}"}, [token])
    found = [Difference(0, c, 1, f"result.observation.f{c % 3}", '"a"', '"b"') for c in range(100)]
    error = drift_error(found)
    assert error.details["drift_count"] == 100 and len(error.details["drifts"]) == 32
    assert [f["count"] for f in error.details["fields"]] == [34, 33, 33]
    assert leaf_differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 0}, "x") == [
        ("x.a.c", 2, 3), ("x.d", "<absent>", 0)]
