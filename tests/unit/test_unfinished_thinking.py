"""Which completions ended inside <think>, and the words naming the cause and the fix."""

from __future__ import annotations

import pytest

from kiln.core.unfinished_thinking import (
    FIX,
    ended_inside_thinking,
    group_ended_inside_thinking,
    groups_named,
    unfinished_thinking_groups,
    unfinished_thinking_message,
)


def _completion(last_action: str, harness: str | None = "MODEL_ACTION_NO_OUTPUT") -> dict:
    trajectory = [{"kind": "action", "content": "Small steps.</think>\n\n{\"amount\": 1}"},
                  {"kind": "observation", "content": "Count is 1."},
                  {"kind": "action", "content": last_action}]
    return {"harness_code": harness, "trajectory": trajectory}


@pytest.mark.timeout(10)
def test_only_unclosed_reasoning_with_no_answer_counts() -> None:
    assert ended_inside_thinking(_completion("I add an amount"))  # the budget ended the reasoning
    assert not ended_inside_thinking(_completion("Fine.</think>\n\n"))  # closed, then a blank answer
    assert not ended_inside_thinking(_completion("  \n"))  # thinking off: a blank action
    assert not ended_inside_thinking(_completion("I add", harness="MODEL_ACTION_TRUNCATED"))
    assert not ended_inside_thinking(_completion("{\"amount\": 2}", harness=None))
    assert not ended_inside_thinking({"harness_code": "MODEL_ACTION_NO_OUTPUT", "trajectory": []})


@pytest.mark.timeout(10)
def test_a_group_counts_when_every_completion_does() -> None:
    inside, closed = _completion("I add"), _completion("Ok.</think>")
    assert group_ended_inside_thinking([inside, inside])
    assert not group_ended_inside_thinking([inside, closed])
    assert not group_ended_inside_thinking([])
    lines = [{"completions": [inside, inside]}, {"completions": [inside, closed]}, {"completions": [inside]}]
    assert unfinished_thinking_groups(lines) == [0, 2]


@pytest.mark.timeout(10)
def test_the_message_names_the_groups_the_cause_and_the_fix() -> None:
    assert groups_named([3]) == "group 3"
    assert groups_named([0, 2], total=3) == "groups 0, 2"
    assert groups_named([0, 1], total=2) == "every group"
    assert groups_named(list(range(10))) == "groups 0, 1, 2, 3, 4, 5, 6, 7 and 2 more"
    message = unfinished_thinking_message("group 3")
    assert message.startswith("group 3: every completion ended inside <think>")
    assert message.endswith("use --thinking off, or a larger --max-action-tokens / --thinking-budget-tokens")
    assert FIX in message
