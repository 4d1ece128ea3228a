"""Dataset completion checks: trajectory, token pieces and ``openenv`` provenance.

Observation, protocol-error and harness segments are rebuilt from the replay with the collector's
own builders (:mod:`kiln.core.rollout.exchange`); provenance with :func:`kiln.core.rollout.provenance.provenance_of`.
"""

from __future__ import annotations

import math
from typing import Any

from kiln.core.openenv.actions import ActionParseError, parse_action_text
from kiln.core.openenv.schema import ActionValidator
from kiln.core.policy import harmony
from kiln.core.rollout.context import CONTEXT_EXHAUSTED, window_turns
from kiln.core.rollout.episode import TURN_BREAK
from kiln.core.rollout.exchange import NO_OUTPUT, exchange_segment, harness_segment, judge_answer, truncation_outcome
from kiln.core.rollout.provenance import provenance_of
from kiln.core.rollout.verify.checks import (
    Where,
    _is_int,
    fail,
    need_dict,
    need_keys,
    need_list,
    need_match,
    same_json,
)
from kiln.core.rollout.verify.replay import CandidateFacts

THINK_CLOSE = "</think>"


def split_answer(content: str, thinking: bool) -> str | None:
    """The final answer of an action segment: text after the first ``</think>`` when thinking; a
    harmony action's (gpt-oss: no ``</think>``, its reasoning closed by the next ``<|message|>``)
    is the final channel's text (:func:`kiln.core.policy.harmony.split_action`)."""
    if not thinking:
        return content.strip()
    cut = content.find(THINK_CLOSE)
    if cut < 0:
        return harmony.split_action(content, thinking=True)[1] if harmony.MESSAGE in content else None
    return content[cut + len(THINK_CLOSE) :].strip()


def check_segment(segment: Any, where: Where, field: str, role: str, kind: str, warning: bool) -> dict:
    segment = need_dict(segment, where, field)
    keys = frozenset({"role", "kind", "content"})
    need_keys(segment, keys | ({"warning_prefix_len"} if warning else frozenset()), where, field)
    if segment["role"] != role or segment["kind"] != kind:
        raise fail(where, f"{field}.kind", f"must be role {role!r}, kind {kind!r}")
    if not isinstance(segment["content"], str):
        raise fail(where, f"{field}.content", "must be a string")
    if warning and segment["warning_prefix_len"] != len(segment["content"].encode("utf-8")):
        raise fail(where, f"{field}.warning_prefix_len", "must be the UTF-8 byte length of the content")
    return segment


def check_trajectory(
    completion: dict,
    facts: CandidateFacts,
    where: Where,
    *,
    thinking: bool,
    validator: ActionValidator,
    max_action_tokens: int | None = None,
) -> None:
    """Structure: actions parse to the exchanged actions, observations are rebuilt."""
    trajectory = need_list(completion["trajectory"], where, "trajectory")
    invalid = facts.termination == "invalid_model_action"
    expected_len = 2 * (len(facts.exchanges) + int(invalid))
    if len(trajectory) != expected_len:
        raise fail(where, "trajectory", f"holds {len(trajectory)} segments, expected {expected_len}")
    actions: list[str] = []
    for step, exchange in enumerate(facts.exchanges):
        at = where.at(step=step)
        answer = _action_answer(trajectory, step, at, thinking, actions)
        field = f"trajectory[{2 * step}].content"
        if answer is None:
            raise fail(at, field, f"has no {THINK_CLOSE} (thinking) but an action was exchanged")
        try:
            parsed = parse_action_text(answer)
        except ActionParseError as exc:
            raise fail(at, field, f"does not parse as the exchanged action ({exc})") from None
        if not same_json(parsed, exchange["action"]):
            raise fail(at, field, "parses to an action other than the exchanged one")
        if validator.validate(parsed):
            raise fail(at, field, "the exchanged action fails the advertised action schema")
        _check_tool_segment(trajectory, step, at, exchange_segment(exchange), "the recorded exchange's")
    harness = completion["harness_code"]
    if invalid:
        step = len(facts.exchanges)
        at = where.at(step=step)
        _action, outcome = judge_answer(_action_answer(trajectory, step, at, thinking, actions), validator)
        if outcome is not None and max_action_tokens is not None:
            outcome = truncation_outcome(*outcome, _last_action_ids(completion), max_action_tokens)
        if outcome is None:
            raise fail(
                at, f"trajectory[{2 * step}].content", "is a valid action, yet the candidate ended invalid_model_action"
            )
        if harness != outcome[0]:
            raise fail(where, "harness_code", f"must be {outcome[0]!r} for the final action text")
        _check_tool_segment(trajectory, step, at, harness_segment(*outcome), "the recomputed harness error")
    elif harness is not None:
        raise fail(where, "harness_code", "must be null unless termination is invalid_model_action")
    if completion["text"] != TURN_BREAK.join(actions):
        raise fail(where, "text", f"must be the action contents joined by {TURN_BREAK}")


def _last_action_ids(completion: dict) -> int:
    """How many ids the final action piece holds (a cut-off action used all max_action_tokens)."""
    pieces = (completion.get("tokens") or {}).get("pieces") or []
    last = [p for p in pieces if isinstance(p, dict) and p.get("kind") == "action"]
    return len(last[-1].get("ids") or []) if last else 0


def _action_answer(trajectory: list, step: int, at: Where, thinking: bool, actions: list[str]) -> str | None:
    """Check turn ``step``'s action segment, collect its text, return its final answer."""
    segment = check_segment(trajectory[2 * step], at, f"trajectory[{2 * step}]", "assistant", "action", False)
    actions.append(segment["content"])
    return split_answer(segment["content"], thinking)


def _check_tool_segment(trajectory: list, step: int, at: Where, expected: dict, what: str) -> None:
    """Turn ``step``'s observation segment equals the one the collector's builder makes."""
    field = f"trajectory[{2 * step + 1}]"
    warning = "warning_prefix_len" in expected
    segment = check_segment(trajectory[2 * step + 1], at, field, "tool", "observation", warning)
    if segment["content"] != expected["content"]:
        raise fail(at, f"{field}.content", f"is not {what} observation content")


def check_pieces(
    completion: dict,
    facts: CandidateFacts,
    where: Where,
    *,
    model_tokens: int,
    max_action_tokens: int,
    context_limit: int | None = None,
) -> None:
    """Token pieces: context, then per turn action [+ context, observation, context] (the final
    turn left out when the candidate's context record says so), inside the recorded context."""
    tokens = need_dict(completion["tokens"], where, "tokens")
    need_keys(tokens, frozenset({"pieces"}), where, "tokens")
    pieces = need_list(tokens["pieces"], where, "tokens.pieces")
    window = (facts.context or {}).get("window")
    folded = window["turn_tokens"] if window else []  # turns before the last slide: in pieces[0]
    layout: list[tuple[str, bool | None]] = [("context", None)]
    for exchange in facts.exchanges[len(folded) :]:
        warn = exchange["result"]["kind"] == "protocol_error"
        layout += [("action", None), ("context", None), ("observation", warn), ("context", None)]
    if facts.termination == "invalid_model_action":
        layout.append(("action", None))
        if completion["harness_code"] != NO_OUTPUT:
            layout += [("context", None), ("observation", True), ("context", None)]
    if facts.context is not None and facts.context["omitted_turn_tokens"] > 0:
        if layout[-1][0] != "context":
            raise fail(where, "context.omitted_turn_tokens", "the episode has no final turn to leave out")
        del layout[-3:]
    if len(pieces) != len(layout):
        raise fail(where, "tokens.pieces", f"holds {len(pieces)} pieces, expected {len(layout)}")
    total = 0
    for index, ((kind, warning), piece) in enumerate(zip(layout, pieces)):
        field = f"tokens.pieces[{index}]"
        piece = need_dict(piece, where, field)
        keys = (
            {"kind", "ids"}
            | ({"logprobs"} if kind == "action" else set())
            | ({"warning"} if kind == "observation" else set())
        )
        need_keys(piece, frozenset(keys), where, field)
        if piece["kind"] != kind:
            raise fail(where, f"{field}.kind", f"must be {kind!r}")
        ids = need_list(piece["ids"], where, f"{field}.ids")
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise fail(where, f"{field}.ids", "must be non-negative integers")
        if kind == "observation" and piece["warning"] is not warning:
            raise fail(where, f"{field}.warning", f"must be {str(warning).lower()}")
        if kind == "action":
            logprobs = need_list(piece["logprobs"], where, f"{field}.logprobs")
            if len(logprobs) != len(ids) or not all(
                isinstance(x, float) and math.isfinite(x) and x <= 0.0 for x in logprobs
            ):
                raise fail(where, f"{field}.logprobs", "must be one finite log-probability <= 0 per id")
            if not 1 <= len(ids) <= max_action_tokens:
                raise fail(where, f"{field}.ids", f"must hold 1..max_action_tokens ({max_action_tokens}) ids")
            total += len(ids)
    total += sum(turn[0] for turn in folded)
    if total != model_tokens:
        raise fail(where, "model_tokens", f"must be {total} (the action token ids)")
    if context_limit is not None:
        check_context(pieces, facts, where, context_limit, max_action_tokens)


def check_context(pieces: list, facts: CandidateFacts, where: Where, limit: int, max_action_tokens: int) -> None:
    """The collector's context rule (:mod:`kiln.core.rollout.context`), re-checked from piece lengths:
    every action was sampled from a prompt with room for ``max_action_tokens``, every appended turn
    left that room, and a context record's figures are the ones the pieces add up to. A slid
    window's recorded turns are replayed through the same rule (:func:`window_turns`)."""
    if facts.context is not None and "window" in facts.context:
        _check_window(pieces, facts.context, where, limit, max_action_tokens)
    seen = len(pieces[0]["ids"])
    index = 1
    while index < len(pieces):
        piece = pieces[index]
        if piece["kind"] == "action":
            if seen + max_action_tokens > limit:
                raise fail(
                    where,
                    f"tokens.pieces[{index}]",
                    f"was sampled from {seen} ids, past the context "
                    f"({limit}) less max_action_tokens ({max_action_tokens})",
                )
            seen += len(piece["ids"])
            index += 1
            continue
        seen += sum(len(p["ids"]) for p in pieces[index : index + 3])
        if seen + max_action_tokens > limit:
            raise fail(
                where,
                f"tokens.pieces[{index + 1}]",
                f"the turn brings the prompt to {seen} ids, past "
                f"the context ({limit}) less max_action_tokens ({max_action_tokens})",
            )
        index += 3
    record = facts.context
    if record is None:
        return
    if record["tokens"] != seen:
        raise fail(where, "context.tokens", f"must be {seen} (the ids of the pieces)")
    omitted = record["omitted_turn_tokens"]
    if record["code"] == CONTEXT_EXHAUSTED and seen + omitted + max_action_tokens <= limit:
        raise fail(where, "context", f"{seen} + {omitted} ids leave room for an action in {limit}: nothing had to end")


def check_provenance(
    provenance: Any,
    where: Where,
    *,
    inspection: dict,
    group: dict,
    facts: CandidateFacts,
    behavior_policy: dict,
    context_policy: str = "end",
) -> None:
    """``openenv`` provenance, rebuilt by the collector's builder from the inspection, the
    replay and the summary."""
    expected = provenance_of(
        inspection,
        reset_payload=group["reset_payload"],
        seed=group["seed"],
        **facts.outcome(),
        behavior_policy=behavior_policy,
        context_policy=context_policy,
    )
    need_match(provenance, expected, where, "openenv", "the replay / inspection / summary")


def _check_window(pieces: list, record: dict, where: Where, limit: int, max_action_tokens: int) -> None:
    """The dropped span of a slid window: its turns replay the rule to the recorded slides and
    first kept turn, and the policy's view after the last slide is ``pieces[0]``."""
    window = record["window"]
    turns = window["turn_tokens"]
    try:
        first, slides = window_turns(window["prompt_tokens"], turns, max_action_tokens, limit)
    except ValueError as exc:
        raise fail(where, "context.window.turn_tokens", str(exc)) from None
    if (window["kept_from_turn"], window["slides"]) != (first, slides):
        raise fail(where, "context.window", f"must keep from turn {first} after {slides} slides (the rule replayed)")
    if window["dropped_tokens"] != sum(sum(t) for t in turns[:first]):
        raise fail(where, "context.window.dropped_tokens", "must be the ids of the turns before kept_from_turn")
    view = window["prompt_tokens"] + sum(sum(t) for t in turns[first:])
    if len(pieces[0]["ids"]) != view:
        raise fail(where, "tokens.pieces[0]", f"must hold the {view} ids the policy saw after the last slide")
