"""The canonical representation of one exchange — built by the collector, rebuilt by the verifier.

An exchange is one action sent to the environment and its result: an observation or an OpenEnv
protocol error. A harness error is a final action text that never reached the environment (no
answer, not JSON, or failing the advertised schema). For each, this module owns the replay record
and the trajectory segment the policy saw.

The replay record is built from the exchange's canonical copy (:func:`kiln.core.canonical.canonical_copy`
— exactly what ``replay.json`` gives back: the key order a server sent is not part of the value),
and the segment is derived from that record only. The collector (:mod:`kiln.core.rollout.episode`) and
the offline verifier (:mod:`kiln.core.rollout.verify`) call the same functions, so every bundle Kiln
writes verifies by construction.
"""

from __future__ import annotations

from typing import Any

from kiln.core.canonical import canonical_copy, compact_json
from kiln.core.errors import EnvironmentProtocolError
from kiln.core.openenv.actions import ActionParseError, parse_action_text
from kiln.core.openenv.schema import ActionValidator
from kiln.core.openenv.tool_calls import ToolCallValidator
from kiln.core.openenv.replies import RECOVERABLE_CODES
from kiln.core.rollout.prompts import harness_error_content, observation_content, protocol_error_content

NO_OUTPUT = "MODEL_ACTION_NO_OUTPUT"
INVALID_ACTION = "INVALID_MODEL_ACTION"
SCHEMA_FAILED = "ACTION_SCHEMA_VALIDATION_FAILED"
TRUNCATED = "MODEL_ACTION_TRUNCATED"
HARNESS_CODES = frozenset({NO_OUTPUT, INVALID_ACTION, SCHEMA_FAILED, TRUNCATED})
NO_OUTPUT_MESSAGE = "the policy produced no final answer"
SCHEMA_FAILED_PREFIX = "action failed the advertised schema: "


def _canonical(record: dict[str, Any]) -> dict[str, Any]:
    try:
        return canonical_copy(record)
    except (TypeError, ValueError) as exc:  # e.g. an unpaired surrogate in a server string
        raise EnvironmentProtocolError(
            f"the environment sent a value that is not representable as JSON text ({type(exc).__name__})"
        ) from None


def observation_exchange(step_index: int, action: dict[str, Any], wire: dict[str, Any]) -> dict[str, Any]:
    """The replay record of an action answered by an observation (canonical copy)."""
    return _canonical(
        {"step_index": step_index, "action": action, "result": {"kind": "observation", "observation": wire}}
    )


def protocol_error_exchange(
    step_index: int, action: dict[str, Any], error: dict[str, Any], continued: bool
) -> dict[str, Any]:
    """The replay record of an action answered by an OpenEnv error frame (canonical copy)."""
    return _canonical(
        {
            "step_index": step_index,
            "action": action,
            "result": {"kind": "protocol_error", "error": error, "continued": continued},
        }
    )


def protocol_error_continues(code: Any, recoverable_so_far: int, max_recoverable_errors: int) -> bool:
    """An episode continues after a protocol error iff its code is recoverable and fewer
    than ``max_recoverable_errors`` recoverable errors came before it (any other code ends it)."""
    return code in RECOVERABLE_CODES and recoverable_so_far < max_recoverable_errors


def action_segment(text: str) -> dict[str, Any]:
    """The trajectory segment of one sampled action (the decoded text, verbatim)."""
    return {"role": "assistant", "kind": "action", "content": text}


def tool_segment(content: str, *, warning: bool) -> dict[str, Any]:
    """An observation segment; a warning (error) segment marks its whole content as prefix."""
    segment: dict[str, Any] = {"role": "tool", "kind": "observation", "content": content}
    if warning:
        segment["warning_prefix_len"] = len(content.encode("utf-8"))
    return segment


def exchange_segment(exchange: dict[str, Any]) -> dict[str, Any]:
    """The observation segment the policy saw for a replay record."""
    result = exchange["result"]
    if result["kind"] == "observation":
        return tool_segment(observation_content(result["observation"], "step result"), warning=False)
    return tool_segment(protocol_error_content(result["error"], result["continued"]), warning=True)


def harness_segment(code: str, message: str) -> dict[str, Any]:
    """The observation segment of a harness error (the action never reached the environment)."""
    return tool_segment(harness_error_content(code, message), warning=True)


def truncation_outcome(code: str, message: str, action_ids: int, max_action_tokens: int) -> tuple[str, str]:
    """An unparsable or schema-failing action that used all ``max_action_tokens`` ids was cut
    off, not wrong: it gets its own code (the one rule the collector and verify share)."""
    if code in (INVALID_ACTION, SCHEMA_FAILED) and action_ids >= max_action_tokens:
        return TRUNCATED, f"the action was cut at max_action_tokens ({max_action_tokens}): {message}"
    return code, message


def judge_answer(
    answer: str | None, validator: ActionValidator | ToolCallValidator
) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """``(action, None)`` for a valid final answer, else ``(None, (harness code, message))``."""
    if answer is None or not answer.strip():
        return None, (NO_OUTPUT, NO_OUTPUT_MESSAGE)
    try:
        action = parse_action_text(answer)
    except ActionParseError as exc:
        return None, (INVALID_ACTION, str(exc))
    issues = validator.validate(action)
    if issues:
        return None, (SCHEMA_FAILED, SCHEMA_FAILED_PREFIX + compact_json(issues).decode("utf-8"))
    return action, None
