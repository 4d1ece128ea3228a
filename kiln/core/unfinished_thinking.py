"""Thinking that cannot finish: a group whose every completion ended inside ``<think>``.

With thinking on, an action is the reasoning, ``</think>``, then the final answer. When the action
budget (``max_action_tokens``) or the thinking budget (``thinking_budget_tokens``) ends every
completion of a group before ``</think>``, no action reaches the environment, every reward is the
no-output penalty and the group has no reward variation: training cannot learn from it, and the
usual "no reward variation" names no cause the user can act on. This module recognises that case
from a group's completions (pure: the collection warning and the training failure share it) and
words the cause and the fix. Harmony (gpt-oss) reasoning is the analysis channel, and it closes
where the model opens its next message (``<|message|>``, :mod:`kiln.core.policy.harmony`): an
action with neither ``</think>`` nor ``<|message|>`` ended inside its reasoning.
"""

from __future__ import annotations

from typing import Any, Iterable

NO_OUTPUT_CODE = "MODEL_ACTION_NO_OUTPUT"
THINK_CLOSE = "</think>"
HARMONY_MESSAGE = "<|message|>"  # harmony's reasoning closes at the next message's opening
FIX = "use --thinking off, or a larger --max-action-tokens / --thinking-budget-tokens"


def ended_inside_thinking(completion: dict[str, Any]) -> bool:
    """The completion's last action is reasoning that never produced ``</think>`` (harmony: never
    opened its next message; it ended with no final answer, and its text is not blank: with
    thinking off a no-output action is blank)."""
    if completion.get("harness_code") != NO_OUTPUT_CODE:
        return False
    actions = [seg.get("content") or "" for seg in completion.get("trajectory") or [] if seg.get("kind") == "action"]
    last = actions[-1] if actions else ""
    return bool(last.strip()) and THINK_CLOSE not in last and HARMONY_MESSAGE not in last


def group_ended_inside_thinking(completions: Iterable[dict[str, Any]]) -> bool:
    """Every completion of the group (at least one) ended inside ``<think>``."""
    completions = list(completions)
    return bool(completions) and all(ended_inside_thinking(c) for c in completions)


def unfinished_thinking_groups(lines: Iterable[dict[str, Any]]) -> list[int]:
    """Positions (0-based, as in selection warnings) of the group lines whose every completion
    ended inside ``<think>``."""
    return [i for i, line in enumerate(lines) if group_ended_inside_thinking(line.get("completions") or [])]


def groups_named(groups: list[int], total: int | None = None, label: str = "group") -> str:
    """``group 3`` / ``groups 0, 1`` / ``every group`` (``total``: how many groups there were)."""
    if total is not None and len(groups) == total and total > 1:
        return f"every {label}"
    shown = ", ".join(str(g) for g in groups[:8]) + (f" and {len(groups) - 8} more" if len(groups) > 8 else "")
    return f"{label}{'s' if len(groups) > 1 else ''} {shown}"


def unfinished_thinking_message(subject: str) -> str:
    """The cause and the fix, for ``subject`` (e.g. :func:`groups_named`'s words)."""
    return (
        f"{subject}: every completion ended inside <think> (the reasoning never closed with </think> "
        "within the action or thinking budget), so no action reached the environment and every "
        f"reward is the no-output penalty; {FIX}"
    )


__all__ = [
    "FIX",
    "ended_inside_thinking",
    "group_ended_inside_thinking",
    "groups_named",
    "unfinished_thinking_groups",
    "unfinished_thinking_message",
]
