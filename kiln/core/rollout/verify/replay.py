"""Replay checks: the header, each group's manifest rules per candidate, the reset plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.core.openenv.discovery import CLIENT_PROFILE
from kiln.core.openenv.rewards import is_valid_wire_reward, training_reward
from kiln.core.openenv.replies import RECOVERABLE_CODES, TERMINAL_CODES
from kiln.core.rollout.bundle import REPLAY_SCHEMA
from kiln.core.rollout.exchange import protocol_error_continues
from kiln.core.rollout.verify.checks import (
    REPLAY_FILE,
    Where,
    _is_int,
    fail,
    need_bool,
    need_dict,
    need_float,
    need_int,
    need_keys,
    need_list,
    same_float,
    same_json,
)

_REPLAY_KEYS = frozenset(
    {"schema", "client_profile", "dataset_sha256", "protocol_error_reward", "max_steps", "environments", "groups"}
)
_GROUP_KEYS = frozenset(
    {"group_index", "environment_index", "seed", "reset_payload", "reset_observation", "candidates"}
)
_CANDIDATE_KEYS = frozenset(
    {
        "candidate_index",
        "exchanges",
        "episode_return",
        "terminal_done",
        "termination",
        "recoverable_protocol_errors",
        "model_tokens",
    }
)
# ``capacity_retries``: bundles written before capacity refusals left the artifacts (a wall-clock
# fact, counted in run status as ``environment_capacity.<url>.refusals``) carry it; newer ones never.
_OPTIONAL_CANDIDATE_KEYS = frozenset({"final_state", "reset_observation", "context", "capacity_retries"})
_EXCHANGE_KEYS = frozenset({"step_index", "action", "result"})
_TERMINATIONS = frozenset({"done", "max_steps", "invalid_model_action", "protocol_error", "context_exhausted"})
_CONTEXT_KEYS = frozenset({"code", "limit_tokens", "tokens", "omitted_turn_tokens"})


def check_replay_header(replay: dict, summary: dict, dataset_sha256: str) -> None:
    where = Where(REPLAY_FILE)
    need_keys(replay, _REPLAY_KEYS, where, "")
    if replay["schema"] != REPLAY_SCHEMA:
        raise fail(where, "schema", f"must be {REPLAY_SCHEMA!r}")
    if replay["client_profile"] != CLIENT_PROFILE:
        raise fail(where, "client_profile", f"must be {CLIENT_PROFILE!r}")
    if replay["dataset_sha256"] != dataset_sha256:
        raise fail(where, "dataset_sha256", "does not link the dataset (its sha256 differs)")
    if not same_float(replay["protocol_error_reward"], summary["protocol_error_reward"]):
        raise fail(where, "protocol_error_reward", "differs (bitwise) from the summary")
    if replay["max_steps"] != summary["max_steps"] or not _is_int(replay["max_steps"]):
        raise fail(where, "max_steps", "differs from the summary")
    if not same_json(replay["environments"], summary["environments"]):
        raise fail(where, "environments", "differ from the summary's environments")
    groups = need_list(replay["groups"], where, "groups")
    if len(groups) != summary["groups"]:
        raise fail(where, "groups", f"holds {len(groups)} groups, the summary says {summary['groups']}")


def check_wire_observation(value: Any, where: Where, field: str) -> dict:
    """A wire observation ``{observation, reward, done[, metadata]}`` with a valid reward."""
    wire = need_dict(value, where, field)
    need_keys(wire, frozenset({"observation", "reward", "done"}), where, field, frozenset({"metadata"}))
    if not isinstance(wire["done"], bool):
        raise fail(where, f"{field}.done", "must be a boolean")
    if not is_valid_wire_reward(wire["reward"]):
        raise fail(where, f"{field}.reward", "must be null, a boolean or a finite number")
    if wire.get("metadata") is not None and not isinstance(wire["metadata"], dict):
        raise fail(where, f"{field}.metadata", "must be an object or null")
    return wire


@dataclass
class CandidateFacts:
    """What the replay says about one candidate, after its manifest rules passed."""

    exchanges: list[dict]
    episode_return: float
    termination: str
    protocol_error_code: str | None
    context: dict | None = None  # the candidate's context record (it hit the model's context)

    def outcome(self) -> dict[str, Any]:
        """The episode's outcome as the record builders take it (steps, return, termination, code)."""
        return {
            "steps": len(self.exchanges),
            "episode_return": self.episode_return,
            "termination": self.termination,
            "protocol_error_code": self.protocol_error_code,
        }


def recompute_return(values: list[float], protocol_errors: int, penalty: float, invalid: bool) -> float:
    """Exactly :attr:`kiln.core.rollout.episode.CandidateEpisode.episode_return`'s float order."""
    total = 0.0
    for value in values:
        total += value
    total += penalty * protocol_errors
    if invalid:
        total += penalty
    return total


@dataclass
class _Walk:
    """What the exchanges of one candidate add up to, while they are walked in order."""

    values: list[float] = field(default_factory=list)
    protocol_errors: int = 0
    recoverable: int = 0
    ended: str | None = None
    code: str | None = None
    last_terminal_code: bool = False


def _check_exchange(exchange: Any, step: int, at: Where, walk: _Walk, max_recoverable: int) -> None:
    """One exchange: indices, result shape, the ``continued`` rule; updates ``walk``."""
    if walk.ended is not None:
        raise fail(at, "exchanges", f"an exchange follows a terminal result ({walk.ended})")
    exchange = need_dict(exchange, at, "exchange")
    need_keys(exchange, _EXCHANGE_KEYS, at, "")
    if exchange["step_index"] != step or not _is_int(exchange["step_index"]):
        raise fail(at, "step_index", f"must be {step} (contiguous step indices)")
    need_dict(exchange["action"], at, "action")
    result = need_dict(exchange["result"], at, "result")
    kind = result.get("kind")
    if kind == "observation":
        need_keys(result, frozenset({"kind", "observation"}), at, "result")
        wire = check_wire_observation(result["observation"], at, "result.observation")
        walk.values.append(training_reward(wire["reward"]))
        if wire["done"]:
            walk.ended = "done"
        return
    if kind != "protocol_error":
        raise fail(at, "result.kind", "must be 'observation' or 'protocol_error'")
    need_keys(result, frozenset({"kind", "error", "continued"}), at, "result")
    error = need_dict(result["error"], at, "result.error")
    if not isinstance(error.get("code"), str):
        raise fail(at, "result.error.code", "must be a string")
    if not isinstance(result["continued"], bool):
        raise fail(at, "result.continued", "must be a boolean")
    is_recoverable = error["code"] in RECOVERABLE_CODES
    expected = protocol_error_continues(error["code"], walk.recoverable, max_recoverable)
    if result["continued"] != expected:
        raise fail(
            at,
            "result.continued",
            f"must be {str(expected).lower()}: code {error['code']} with {walk.recoverable} "
            f"recoverable errors before it and a budget of {max_recoverable}",
        )
    walk.recoverable += int(is_recoverable)
    walk.protocol_errors += 1
    if not expected:
        walk.ended, walk.code = "protocol_error", error["code"]
        walk.last_terminal_code = error["code"] in TERMINAL_CODES


def _check_termination(candidate: dict, where: Where, walk: _Walk, exchanges: int, max_steps: int) -> str:
    termination = candidate["termination"]
    if termination not in _TERMINATIONS:
        raise fail(where, "termination", f"must be one of {sorted(_TERMINATIONS)}")
    if walk.ended is not None and termination != walk.ended:
        raise fail(where, "termination", f"must be {walk.ended!r} after the last exchange's result")
    if walk.ended is None:
        if termination == "max_steps" and exchanges != max_steps:
            raise fail(where, "termination", f"max_steps needs exactly {max_steps} exchanges, found {exchanges}")
        if termination == "invalid_model_action" and exchanges >= max_steps:
            raise fail(where, "termination", "invalid_model_action after max_steps exchanges")
        if termination == "context_exhausted" and exchanges > max_steps:
            raise fail(where, "termination", "context_exhausted after more than max_steps exchanges")
        if termination in ("done", "protocol_error"):
            raise fail(where, "termination", f"{termination!r} does not match the last exchange's result")
    if need_bool(candidate, "terminal_done", where) != (termination == "done"):
        raise fail(where, "terminal_done", "must be true exactly when termination is 'done'")
    return termination


def _check_context(
    candidate: dict, where: Where, termination: str, limit: int | None, window: bool = False
) -> dict | None:
    """A candidate's ``context`` record: present exactly when it hit the group's recorded context
    (ended, left out a turn, or, under ``context_policy: window``, slid its window)."""
    if "context" not in candidate:
        if termination == "context_exhausted":
            raise fail(where, "context", "is missing (required when termination is context_exhausted)")
        return None
    record = need_dict(candidate["context"], where, "context")
    need_keys(record, _CONTEXT_KEYS, where, "context", frozenset({"window"}))
    slid = "window" in record
    if slid and not window:
        raise fail(where, "context.window", "only a run with context_policy window slides a window")
    ended = termination == "context_exhausted" or record.get("omitted_turn_tokens") != 0
    if record["code"] != ("CONTEXT_EXHAUSTED" if ended or not slid else "CONTEXT_WINDOWED"):
        raise fail(where, "context.code", "must be 'CONTEXT_EXHAUSTED' (ended) or 'CONTEXT_WINDOWED' (slid, went on)")
    if limit is None or record["limit_tokens"] != limit:
        raise fail(where, "context.limit_tokens", f"must be the group's context_tokens ({limit})")
    for key in ("tokens", "omitted_turn_tokens"):
        need_int(record, key, where, 0)
    if not slid and termination != "context_exhausted" and record["omitted_turn_tokens"] == 0:
        raise fail(where, "context", "only a context_exhausted episode or a left-out final turn has one")
    if slid:
        _check_window_shape(record, where)
    return record


def _check_window_shape(record: dict, where: Where) -> None:
    window = need_dict(record["window"], where, "context.window")
    need_keys(
        window,
        frozenset({"prompt_tokens", "turn_tokens", "kept_from_turn", "dropped_tokens", "slides"}),
        where,
        "context.window",
    )
    for key in ("prompt_tokens", "kept_from_turn", "dropped_tokens", "slides"):
        need_int(window, key, where, 0)
    turns = need_list(window["turn_tokens"], where, "context.window.turn_tokens")
    if not all(
        isinstance(t, list) and len(t) == 2 and all(_is_int(n) and n >= 0 for n in t) and t[0] >= 1 for t in turns
    ):
        raise fail(where, "context.window.turn_tokens", "must be [action ids, observation ids] counts per turn")


def check_replay_candidate(
    candidate: Any,
    index: int,
    where: Where,
    *,
    max_steps: int,
    penalty: float,
    max_recoverable: int,
    context_limit: int | None = None,
    penalise_context: bool = False,
    window: bool = False,
) -> CandidateFacts:
    """Manifest rules for one candidate (``window``: the run's context_policy is window)."""
    where = where.at(candidate=index)
    candidate = need_dict(candidate, where, "candidate")
    need_keys(candidate, _CANDIDATE_KEYS, where, "", _OPTIONAL_CANDIDATE_KEYS)
    if candidate["candidate_index"] != index or not _is_int(candidate["candidate_index"]):
        raise fail(where, "candidate_index", f"must be {index} (contiguous candidate indices)")
    exchanges = need_list(candidate["exchanges"], where, "exchanges")
    if len(exchanges) > max_steps:
        raise fail(where, "exchanges", f"holds {len(exchanges)} exchanges, more than max_steps {max_steps}")
    walk = _Walk()
    for step, exchange in enumerate(exchanges):
        _check_exchange(exchange, step, where.at(step=step), walk, max_recoverable)
    termination = _check_termination(candidate, where, walk, len(exchanges), max_steps)
    context = _check_context(candidate, where, termination, context_limit, window)
    if need_int(candidate, "recoverable_protocol_errors", where) != walk.recoverable:
        raise fail(
            where, "recoverable_protocol_errors", f"must be {walk.recoverable} (recoverable errors in the exchanges)"
        )
    if "capacity_retries" in candidate:
        need_int(candidate, "capacity_retries", where)
    need_int(candidate, "model_tokens", where)
    returned = need_float(candidate, "episode_return", where)
    expected_return = recompute_return(
        walk.values,
        walk.protocol_errors,
        penalty,
        termination == "invalid_model_action" or (termination == "context_exhausted" and penalise_context),
    )
    if not same_float(returned, expected_return):
        raise fail(
            where,
            "episode_return",
            f"{returned!r} is not the recomputed return {expected_return!r} (bitwise)",
        )
    if walk.last_terminal_code:
        if "final_state" in candidate:
            raise fail(where, "final_state", "must be absent after a terminal-code protocol error")
    else:
        if "final_state" not in candidate:
            raise fail(where, "final_state", "is missing (required unless the episode ended on a terminal-code error)")
        need_dict(candidate["final_state"], where, "final_state")
    return CandidateFacts(exchanges, returned, termination, walk.code, context)


def check_reset_determinism(group: dict, summary: dict, where: Where) -> None:
    """Per-candidate resets are allowed only under ``reset_determinism: warn``, listed by field."""
    own = [c for c in group.get("candidates") or [] if isinstance(c, dict) and "reset_observation" in c]
    if summary.get("reset_determinism", "strict") != "warn":
        if "reset_nondeterministic_fields" in group or own:
            raise fail(where, "reset_nondeterministic_fields", "only allowed with reset_determinism: warn")
        return
    if own and not group.get("reset_nondeterministic_fields"):
        raise fail(where, "reset_nondeterministic_fields", "must list the fields in which resets differed")
    for candidate in own:
        check_wire_observation(candidate["reset_observation"], where, "candidates[].reset_observation")


def check_replay_group(g: int, group: Any, summary: dict) -> tuple[dict, dict]:
    """One group's replay header: indices, seed, reset payload and observation, candidate count.
    Returns ``(group, reset observation)``."""
    rwhere = Where(REPLAY_FILE, group=g)
    group = need_dict(group, rwhere, "group")
    need_keys(group, _GROUP_KEYS, rwhere, "", frozenset({"reset_nondeterministic_fields", "context_tokens"}))
    if group.get("context_tokens") != summary.get("context_tokens"):
        raise fail(rwhere, "context_tokens", f"must be the summary's context_tokens ({summary.get('context_tokens')})")
    check_reset_determinism(group, summary, rwhere)
    environments = summary["environments"]
    if group["group_index"] != g or not _is_int(group["group_index"]):
        raise fail(rwhere, "group_index", f"must be {g} (contiguous group indices)")
    if group["environment_index"] != g % len(environments) or not _is_int(group["environment_index"]):
        raise fail(rwhere, "environment_index", f"must be {g % len(environments)} (g mod environments)")
    seed = group["seed"]
    if not _is_int(seed) or seed != summary["seed_start"] + g:
        raise fail(rwhere, "seed", f"must be seed_start + {g} = {summary['seed_start'] + g}")
    payload = need_dict(group["reset_payload"], rwhere, "reset_payload")
    if not _is_int(payload.get("seed")) or payload["seed"] != seed:
        raise fail(rwhere, "reset_payload.seed", "must hold the group's seed")
    reset = check_wire_observation(group["reset_observation"], rwhere, "reset_observation")
    if reset["done"]:
        raise fail(rwhere, "reset_observation.done", "the reset observation must not be done")
    candidates = need_list(group["candidates"], rwhere, "candidates")
    if len(candidates) != summary["group_size"]:
        raise fail(rwhere, "candidates", f"holds {len(candidates)} candidates, group_size is {summary['group_size']}")
    return group, reset


def rebuild_reset_plan(groups: list[dict], environment_count: int) -> list[dict]:
    """Seed-free templates per environment from the replay's reset payloads."""
    templates: list[dict | None] = [None] * environment_count
    for group in groups:
        where = Where(REPLAY_FILE, group=group["group_index"])
        template = {k: v for k, v in group["reset_payload"].items() if k != "seed"}
        index = group["environment_index"]
        if templates[index] is None:
            templates[index] = template
        elif not same_json(templates[index], template):
            raise fail(where, "reset_payload", f"differs from environment {index}'s earlier reset template")
    unused = [index for index, template in enumerate(templates) if template is None]
    if unused:
        raise fail(Where(REPLAY_FILE), "groups", f"environment {unused[0]} is never exercised")
    return [template for template in templates if template is not None]
