"""The served model's context and the one rule every episode keeps inside it.

A turn is sampled only when its prompt leaves room for a whole action: ``prompt + max_action_tokens
<= context``. After each environment turn the collector appends the turn's tokens only when the
context still leaves that room afterwards; otherwise the turn's tokens are left out (the policy
never sees them, so nothing trains on them) and a live episode ends with ``CONTEXT_EXHAUSTED``
(termination ``context_exhausted``). So every id a bundle trains on lies inside the context, and
the offline verifier re-checks the same rule from the piece lengths (:func:`check_context`).

The run's ``context_policy`` says what training does with such an episode: ``end`` leaves it out
of training (it stays in the bundle), ``end_penalised`` keeps it with ``protocol_error_reward``
added to its return once.
"""

from __future__ import annotations

from typing import Any

CONTEXT_EXHAUSTED = "CONTEXT_EXHAUSTED"
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


def context_record(limit: int, tokens: int, omitted: int) -> dict[str, Any]:
    """The replay record of an episode that hit the context: its limit, the ids the policy saw,
    and how many ids the left-out final turn held (0: it ended before sampling)."""
    return {"code": CONTEXT_EXHAUSTED, "limit_tokens": limit, "tokens": tokens, "omitted_turn_tokens": omitted}


def trained_on(completion: dict[str, Any]) -> bool:
    """Whether training sees a dataset completion (``context_policy: end`` leaves out episodes that
    hit the context)."""
    openenv = completion.get("openenv") or {}
    return not (openenv.get("termination") == TERMINATION and openenv.get("context_policy", "end") == "end")


def context_warning(stats: dict[str, Any]) -> str | None:
    """The status warning of a run where most episodes hit the model's context (None otherwise),
    from a bundle's ``stats``."""
    total = int(stats.get("rollouts") or 0)
    hit = int(stats.get("context_exhausted_count") or 0)
    if total == 0 or hit <= WARN_SHARE * total:
        return None
    return (
        f"{hit} of {total} episodes ended at the model's context ({stats.get('context_tokens')} "
        f"tokens, {CONTEXT_EXHAUSTED}) and were cut short: lower --max-steps or --max-action-tokens, "
        "use an environment with shorter observations, or serve a model with a longer context "
        "(its config's max_position_embeddings)"
    )
