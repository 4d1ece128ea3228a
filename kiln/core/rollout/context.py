"""The served model's context and the one rule every episode keeps inside it.

A turn is sampled only when its prompt leaves room for a whole action: ``prompt + max_action_tokens
<= context``. After each environment turn the collector appends the turn's tokens only when the
context still leaves that room afterwards; otherwise the turn's tokens are left out (the policy
never sees them, so nothing trains on them) and a live episode ends with ``CONTEXT_EXHAUSTED``
(termination ``context_exhausted``). So every id a bundle trains on lies inside the context, and
the offline verifier re-checks the same rule from the piece lengths (:func:`check_context`).

The run's ``context_policy`` says what training does with such an episode: ``end`` leaves it out
of training (it stays in the bundle), ``end_penalised`` keeps it with ``protocol_error_reward``
added to its return once. ``window`` keeps a live episode going instead: when a turn does not fit,
the oldest turns leave the policy's view (:func:`window_drop`) and everything the policy still sees
becomes one context piece, so the ids trained on are the one sequence it saw since (the actions
sampled after that slide); the dropped span is recorded (:func:`window_turns`, which the offline
verifier replays). A turn that does not fit even alone ends the episode as under ``end``.
"""

from __future__ import annotations

from typing import Any

CONTEXT_EXHAUSTED = "CONTEXT_EXHAUSTED"
CONTEXT_WINDOWED = "CONTEXT_WINDOWED"
TERMINATION = "context_exhausted"
# A run where more than this share of episodes hit the context gets a status warning.
WARN_SHARE = 0.5


def model_context(model: Any, engine: Any) -> int | None:
    """The smaller of ``model.config.max_position_embeddings`` and ``engine.config.max_model_len``
    (None when neither is known)."""
    limits = []
    for value in (
        getattr(getattr(model, "config", None), "max_position_embeddings", None),
        getattr(getattr(engine, "config", None), "max_model_len", None),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            limits.append(value)
    return min(limits) if limits else None


def served_context(policy: Any) -> int | None:
    """The context of the model ``policy`` serves: its ``context_tokens()`` when it has one (the
    policy runtime, also behind a wrapper), else read from its ``model`` and ``engine``."""
    getter = getattr(policy, "context_tokens", None)
    if callable(getter):
        value = getter()
        return value if isinstance(value, int) and value > 0 else None
    return model_context(getattr(policy, "model", None), getattr(policy, "engine", None))


def has_room(tokens: int, max_action_tokens: int, limit: int | None) -> bool:
    """Whether a prompt of ``tokens`` ids leaves room for one whole action."""
    return limit is None or tokens + max_action_tokens <= limit


def window_drop(prompt: int, kept: list[int], turn: int, max_action_tokens: int, limit: int) -> int | None:
    """How many of the oldest ``kept`` turns (their id counts, oldest first) leave the policy's view
    so that ``prompt`` + the rest + this ``turn`` (its action and observation ids) leave room for
    one more action; None when the turn does not fit even alone."""
    for drop in range(len(kept) + 1):
        if has_room(prompt + sum(kept[drop:]) + turn, max_action_tokens, limit):
            return drop
    return None


def window_turns(prompt: int, turns: list[list[int]], max_action_tokens: int, limit: int) -> tuple[int, int]:
    """Replay the window rule over ``turns`` (``[action ids, observation ids]`` per turn, up to and
    including the last turn that slid the window): ``(first kept turn, slides)``. Raises
    ``ValueError`` naming the turn where the recording breaks the rule."""
    kept: list[int] = []  # indices of the turns in view
    slides = 0
    for index, (action, observation) in enumerate(turns):
        if not has_room(prompt + sum(sum(turns[k]) for k in kept), max_action_tokens, limit):
            raise ValueError(f"turn {index} was sampled past the context")
        if has_room(prompt + sum(sum(turns[k]) for k in kept) + action + observation, max_action_tokens, limit):
            kept.append(index)
            continue
        drop = window_drop(prompt, [sum(turns[k]) for k in kept], action + observation, max_action_tokens, limit)
        if drop is None:
            raise ValueError(f"turn {index} does not fit even alone")
        kept = [*kept[drop:], index]
        slides += 1
    if not turns or kept[-1] != len(turns) - 1 or slides == 0:
        raise ValueError("the recorded turns do not end with a slide of the window")
    return kept[0], slides


def context_record(limit: int, tokens: int, omitted: int) -> dict[str, Any]:
    """The replay record of an episode that hit the context: its limit, the ids the policy saw,
    and how many ids the left-out final turn held (0: it ended before sampling)."""
    return {"code": CONTEXT_EXHAUSTED, "limit_tokens": limit, "tokens": tokens, "omitted_turn_tokens": omitted}


def trained_on(completion: dict[str, Any]) -> bool:
    """Whether training sees a dataset completion (``context_policy: end`` and ``window`` leave out
    episodes that ended at the context)."""
    openenv = completion.get("openenv") or {}
    policy = openenv.get("context_policy", "end")
    return not (openenv.get("termination") == TERMINATION and policy in ("end", "window"))


def context_warning(stats: dict[str, Any]) -> str | None:
    """The status warning of a run where most episodes hit the model's context (None otherwise),
    from a bundle's ``stats``."""
    total = int(stats.get("rollouts") or 0)
    hit = int(stats.get("context_exhausted_count") or 0)
    windowed = int(stats.get("context_windowed_count") or 0)
    if total and windowed + hit > WARN_SHARE * total and windowed:
        return (
            f"{windowed + hit} of {total} episodes outgrew the model's context ({stats.get('context_tokens')} "
            f"tokens): {windowed} kept going with their earliest turns dropped ({CONTEXT_WINDOWED}), "
            f"{hit} ended ({CONTEXT_EXHAUSTED}); training sees only what the policy saw after the last "
            "drop. Lower --max-steps or --max-action-tokens, use an environment with shorter "
            "observations, or serve a model with a longer context (its config's max_position_embeddings)"
        )
    if total == 0 or hit <= WARN_SHARE * total:
        return None
    return (
        f"{hit} of {total} episodes ended at the model's context ({stats.get('context_tokens')} "
        f"tokens, {CONTEXT_EXHAUSTED}) and were cut short: lower --max-steps or --max-action-tokens, "
        "use an environment with shorter observations, or serve a model with a longer context "
        "(its config's max_position_embeddings)"
    )
