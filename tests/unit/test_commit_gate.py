"""The commit gate of a cancellable publication: the first decision wins, the other is refused."""

from __future__ import annotations

import pytest

from activities.common import CommitGate


@pytest.mark.timeout(10)
def test_a_commit_taken_first_refuses_the_abandon() -> None:
    gate = CommitGate()
    assert [gate.may_commit(), gate.abandon(), gate.may_commit(), gate.abandon()] == [True, False, True, False]


@pytest.mark.timeout(10)
def test_an_abandon_taken_first_refuses_the_commit() -> None:
    gate = CommitGate()
    assert [gate.abandon(), gate.may_commit(), gate.abandon(), gate.may_commit()] == [True, False, True, False]
