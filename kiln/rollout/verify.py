"""Offline verification of a rollout bundle (R4.6): network-free, fail closed.

A bundle is three files written by :func:`kiln.rollout.bundle.build_bundle`:

* the summary (``summary.json``, schema ``kiln.openenv-rollout-summary.v5``, pretty JSON),
* the dataset (``rollouts.jsonl``, one canonical ``AgenticGroup`` per line),
* the replay transcript (``replay.json``, schema ``kiln.openenv-replay.v1``, pretty JSON).

Default paths (when ``dataset_path`` / ``replay_path`` are not given): a summary named
``X.rollout-summary.json`` pairs with ``X.rollouts.jsonl`` and ``X.replay.json`` in the same folder
(the CLI / reference naming, e.g. ``openenv.*``); any other summary name pairs with
``rollouts.jsonl`` and ``replay.json`` beside it (the server's run-folder naming). The summary does
not record paths (a deliberate Kiln deviation), so there is no "recorded path" step.

What is checked (every violation raises :class:`VerificationFailed`, code
``openenv_verification_failed``, whose message names file, group, candidate, step and field):

1. Files: the three paths differ, each is at most 256 MiB, byte count and ``sha256`` of dataset and
   replay equal the summary; every file is in Kiln's canonical serialisation (summary and replay
   byte-equal to ``pretty_json`` of their parse, each dataset line byte-equal to ``canonical_json``
   of its parse + ``\\n``), so no byte can change without changing a parsed value.
2. Summary: schema v5, ``prompt_version``, exact key set, types and bounds of every setting,
   ``adapter_label``, behaviour policy (digests; its ``adapter`` equals ``adapter``),
   ``rollout_count = groups × group_size``, ``groups ≥ #environments``, seed range, environments are
   inspections whose ``schema_sha256`` is the canonical digest of their schema document.
3. Replay (R4.4): schema, client profile, ``dataset_sha256`` links the dataset,
   ``protocol_error_reward`` (bitwise) and ``max_steps`` equal the summary, environments equal the
   summary's, group count; per group contiguous index, ``environment_index = g mod E``,
   ``seed = seed_start + g``, reset payload holds the seed, reset observation is a valid wire
   observation with ``done=false``; per candidate contiguous index and exchange ``step_index``,
   ``len(exchanges) ≤ max_steps``, nothing after a terminal result, every ``continued`` flag equal
   to ``recoverable AND recoverable_so_far < max_recoverable_errors``, recovery count, return
   recomputed bit-identically (Σ step values + penalty × protocol errors + penalty once for
   ``invalid_model_action``), done/termination agreement, ``max_steps`` has exactly ``max_steps``
   exchanges, ``final_state`` absent iff the last result is a terminal-code error.
4. Reset plan: templates rebuilt from the replay (payload without ``seed``, stable per environment,
   every environment exercised) hash to ``reset_plan_sha256`` (canonical JSON, see note below).
5. Per group: the dataset prompt equals the R3.6 prompt recomputed from the inspection and the
   group's reset observation; ``group_size`` completions/candidates.
6. Per candidate: dataset reward == provenance ``episode_return`` == replay return == summary
   record (bitwise); provenance schema, environment name/url/openapi/discovery/schema digests vs the
   inspection, ``action_schema_sha256``, ``reset_sha256``, seed, steps, termination, terminal_done,
   protocol code, behaviour policy; summary record fields incl. recoverable errors, capacity retries
   and model tokens; ``harness_code``; token pieces (layout, ``model_tokens`` = Σ action ids, each
   action ≤ ``max_action_tokens``, logprobs aligned); trajectory (R4.2): each action segment parses
   (after ``</think>`` when thinking) to the exchanged, schema-valid action, each observation
   segment equals the R3.7 content or the protocol-error content, an invalid tail's harness segment
   is recomputed from its action text, ``warning_prefix_len``, ``text`` = actions joined by
   ``<TURN_BREAK>``.
7. Stats recomputed from the records equal the summary's.

Digest note: digests that the verifier recomputes from parsed JSON (reset plan, reset payload,
action schema, prompt schema) are over canonical (sorted-key) JSON, because the stored files are
key-sorted and the original key order is not recoverable. The producer matches this whenever its
inputs are key-sorted (inspections are, since they travel through the store as canonical JSON).

Settings the artifacts do not bind anywhere else (``concurrency``, ``temperature``,
``capacity_wait_seconds``, and beyond their observable bounds ``max_action_tokens``,
``thinking_budget_tokens``, ``max_recoverable_errors``) are checked for type and range only: a
change to them inside their bounds is not detectable offline. See :data:`UNBOUND_SUMMARY_FIELDS`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.canonical import (
    canonical_json,
    compact_json,
    digest_json,
    is_digest,
    pretty_json,
    sha256_bytes,
)
from kiln.contracts import MAX_SEED
from kiln.errors import KilnError
from kiln.openenv.actions import ActionParseError, parse_action_text
from kiln.openenv.discovery import CLIENT_PROFILE, IDENTITY_SCHEMA
from kiln.openenv.rewards import is_valid_wire_reward, training_reward
from kiln.openenv.schema import ActionValidator, policy_action_schema
from kiln.openenv.session import RECOVERABLE_CODES, TERMINAL_CODES
from kiln.rollout.bundle import (
    MAX_ARTIFACT_BYTES,
    REPLAY_SCHEMA,
    SUMMARY_SCHEMA,
    rollout_stats,
)
from kiln.rollout.episode import (
    INVALID_ACTION,
    NO_OUTPUT,
    SCHEMA_FAILED,
    TRUNCATED,
    TURN_BREAK,
    truncation_outcome,
)
from kiln.rollout.group import ROLLOUT_SCHEMA, environment_name
from kiln.rollout.prompts import (
    PROMPT_VERSION,
    harness_error_content,
    initial_messages,
    observation_content,
    protocol_error_content,
)

VERIFICATION_SCHEMA = "kiln.openenv-verification.v1"
THINK_CLOSE = "</think>"
NO_OUTPUT_MESSAGE = "the policy produced no final answer"
SCHEMA_FAILED_PREFIX = "action failed the advertised schema: "

SUMMARY_FILE, DATASET_FILE, REPLAY_FILE = "summary", "dataset", "replay"

#: Summary settings that nothing else in the bundle records: only their type/range is checked.
UNBOUND_SUMMARY_FIELDS = (
    "concurrency",
    "temperature",
    "capacity_wait_seconds",
    "max_action_tokens",
    "thinking_budget_tokens",
    "max_recoverable_errors",
    "constrained_actions",
)

_SUMMARY_KEYS = frozenset(
    {
        "schema", "prompt_version", "adapter", "adapter_label", "behavior_policy", "environments",
        "groups", "group_size", "rollout_count", "seed_start", "max_steps", "concurrency",
        "max_action_tokens", "thinking_budget_tokens", "temperature", "thinking", "constrained_actions",
        "protocol_error_reward", "max_recoverable_errors", "capacity_wait_seconds",
        "reset_plan_sha256", "dataset_sha256", "dataset_bytes", "replay_sha256", "replay_bytes",
        "stats", "rollouts",
    }
)
_SUMMARY_OPTIONAL = frozenset({"training_selection", "reset_determinism"})
_REPLAY_KEYS = frozenset(
    {"schema", "client_profile", "dataset_sha256", "protocol_error_reward", "max_steps",
     "environments", "groups"}
)
_GROUP_KEYS = frozenset(
    {"group_index", "environment_index", "seed", "reset_payload", "reset_observation", "candidates"}
)
_CANDIDATE_KEYS = frozenset(
    {"candidate_index", "exchanges", "episode_return", "terminal_done", "termination",
     "recoverable_protocol_errors", "capacity_retries", "model_tokens"}
)
_EXCHANGE_KEYS = frozenset({"step_index", "action", "result"})
_COMPLETION_KEYS = frozenset({"text", "reward", "trajectory", "openenv", "harness_code", "tokens"})
_PROVENANCE_KEYS = frozenset(
    {"schema", "environment_name", "environment_base_url", "openapi_version", "discovery_sha256",
     "environment_schema_sha256", "action_schema_sha256", "reset_sha256", "seed", "steps",
     "episode_return", "terminal_done", "termination", "behavior_policy"}
)
_RECORD_KEYS = frozenset(
    {"group_index", "candidate_index", "environment_name", "environment_url", "seed", "steps",
     "episode_return", "terminal_done", "termination", "recoverable_protocol_errors",
     "capacity_retries", "model_tokens"}
)
_TERMINATIONS = frozenset({"done", "max_steps", "invalid_model_action", "protocol_error"})
_HARNESS_CODES = frozenset({NO_OUTPUT, INVALID_ACTION, SCHEMA_FAILED, TRUNCATED})


class VerificationFailed(KilnError):
    """A bundle failed offline verification; ``details`` locate the first violation."""

    code = "openenv_verification_failed"
    http_status = 409


@dataclass(frozen=True)
class Where:
    """Location of a check, rendered into messages and ``details``."""

    file: str
    group: int | None = None
    candidate: int | None = None
    step: int | None = None

    def at(self, **changes: int | None) -> "Where":
        values = {"file": self.file, "group": self.group, "candidate": self.candidate, "step": self.step}
        values.update(changes)
        return Where(**values)  # type: ignore[arg-type]


def fail(where: Where, field: str, reason: str) -> VerificationFailed:
    """Build the error for a violation of ``field`` at ``where``."""
    parts = [where.file]
    if where.group is not None:
        parts.append(f"group {where.group}")
    if where.candidate is not None:
        parts.append(f"candidate {where.candidate}")
    if where.step is not None:
        parts.append(f"step {where.step}")
    parts.append(f"field {field}")
    return VerificationFailed(
        " ".join(parts) + f": {reason}",
        details={
            "file": where.file,
            "group_index": where.group,
            "candidate_index": where.candidate,
            "step_index": where.step,
            "field": field,
        },
    )


# ----------------------------------------------------------------------------- value checks
def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def same_float(a: Any, b: Any) -> bool:
    """Bitwise equality of two JSON floats (ints and bools never equal a float here)."""
    return (
        isinstance(a, float) and isinstance(b, float) and _bits(a) == _bits(b)
    )


def same_json(a: Any, b: Any) -> bool:
    """Equality of canonical bytes: ``1`` ≠ ``1.0`` ≠ ``true``, key order irrelevant."""
    try:
        return canonical_json(a) == canonical_json(b)
    except (TypeError, ValueError):
        return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def need_int(doc: dict, key: str, where: Where, lo: int = 0, hi: int | None = None) -> int:
    value = doc.get(key)
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise fail(where, key, f"must be an integer in {bound}")
    return value


def need_float(doc: dict, key: str, where: Where) -> float:
    value = doc.get(key)
    if not isinstance(value, float) or not math.isfinite(value):
        raise fail(where, key, "must be a finite JSON float")
    return value


def need_bool(doc: dict, key: str, where: Where) -> bool:
    value = doc.get(key)
    if not isinstance(value, bool):
        raise fail(where, key, "must be a boolean")
    return value


def need_str(doc: dict, key: str, where: Where) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise fail(where, key, "must be a string")
    return value


def need_digest(doc: dict, key: str, where: Where) -> str:
    value = doc.get(key)
    if not is_digest(value):
        raise fail(where, key, "must be a 'sha256:<64 lowercase hex>' digest")
    return value


def need_dict(value: Any, where: Where, field: str) -> dict:
    if not isinstance(value, dict):
        raise fail(where, field, "must be a JSON object")
    return value


def need_list(value: Any, where: Where, field: str) -> list:
    if not isinstance(value, list):
        raise fail(where, field, "must be a JSON array")
    return value


def need_keys(doc: dict, required: frozenset, where: Where, field: str, optional: frozenset = frozenset()) -> None:
    missing = sorted(required - set(doc))
    if missing:
        raise fail(where, f"{field}.{missing[0]}" if field else missing[0], "is missing")
    extra = sorted(set(doc) - required - optional)
    if extra:
        raise fail(where, f"{field}.{extra[0]}" if field else extra[0], "is not a known field")


def need_equal(actual: Any, expected: Any, where: Where, field: str, what: str) -> None:
    if not same_json(actual, expected):
        raise fail(where, field, f"does not match {what}")


# ----------------------------------------------------------------------------- files
def default_paths(summary_path: Path) -> tuple[Path, Path]:
    """``(dataset, replay)`` beside ``summary_path`` (naming rules in the module docstring)."""
    name = summary_path.name
    suffix = ".rollout-summary.json"
    if name.endswith(suffix) and len(name) > len(suffix):
        stem = name[: -len(suffix)]
        return summary_path.with_name(f"{stem}.rollouts.jsonl"), summary_path.with_name(f"{stem}.replay.json")
    return summary_path.with_name("rollouts.jsonl"), summary_path.with_name("replay.json")


def _read(path: Path, file: str) -> bytes:
    where = Where(file)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise fail(where, "path", f"cannot read {path}: {exc.strerror or exc}") from None
    if size > MAX_ARTIFACT_BYTES:
        raise fail(where, "bytes", f"{path} is larger than {MAX_ARTIFACT_BYTES} bytes")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise fail(where, "path", f"cannot read {path}: {exc.strerror or exc}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def parse_json(data: bytes, where: Where, field: str = "json") -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity; JSON errors become :class:`VerificationFailed`."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise fail(where, field, f"is not valid JSON ({type(exc).__name__})") from None


def parse_pretty(data: bytes, file: str) -> dict:
    """A pretty JSON object file that must be byte-equal to ``pretty_json`` of its parse."""
    where = Where(file)
    value = need_dict(parse_json(data, where), where, "json")
    if pretty_json(value) != data:
        raise fail(where, "json", "is not in Kiln's canonical pretty serialisation (bytes were altered)")
    return value


def parse_dataset(data: bytes) -> list[dict]:
    """One canonical compact JSON object per ``\\n``-terminated line, no blank lines."""
    if not data:
        return []
    if not data.endswith(b"\n"):
        raise fail(Where(DATASET_FILE), "json", "the last line is not terminated by a newline")
    lines = []
    for index, raw in enumerate(data[:-1].split(b"\n")):
        where = Where(DATASET_FILE, group=index)
        if not raw:
            raise fail(where, "json", "blank line")
        value = need_dict(parse_json(raw, where), where, "json")
        if canonical_json(value) != raw:
            raise fail(where, "json", "line is not canonical JSON (bytes were altered)")
        lines.append(value)
    return lines


@dataclass
class Bundle:
    """The parsed, verified files (returned for callers such as live replay)."""

    summary_path: Path
    dataset_path: Path
    replay_path: Path
    summary: dict
    replay: dict
    dataset: list[dict]
    report: dict


# ----------------------------------------------------------------------------- summary
def check_summary(summary: dict) -> None:
    where = Where(SUMMARY_FILE)
    need_keys(summary, _SUMMARY_KEYS, where, "", _SUMMARY_OPTIONAL)
    if summary["schema"] != SUMMARY_SCHEMA:
        raise fail(where, "schema", f"must be {SUMMARY_SCHEMA!r}")
    if summary["prompt_version"] != PROMPT_VERSION:
        raise fail(where, "prompt_version", f"must be {PROMPT_VERSION!r} (the prompt this verifier recomputes)")
    adapter = summary["adapter"]
    if adapter is not None and (not isinstance(adapter, str) or adapter in ("", "base")):
        raise fail(where, "adapter", "must be null (base) or an adapter name")
    if summary["adapter_label"] != (adapter or "base"):
        raise fail(where, "adapter_label", "must be the adapter name, or 'base' when adapter is null")
    check_behavior_policy(summary["behavior_policy"], adapter, where)
    environments = need_list(summary["environments"], where, "environments")
    if not 1 <= len(environments) <= 64:
        raise fail(where, "environments", "must hold 1..64 inspections")
    for index, inspection in enumerate(environments):
        check_inspection(inspection, where, f"environments[{index}]")
    groups = need_int(summary, "groups", where, 1, 16384)
    if groups < len(environments):
        raise fail(where, "groups", "must be >= the number of environments")
    group_size = need_int(summary, "group_size", where, 1, 256)
    if need_int(summary, "rollout_count", where) != groups * group_size:
        raise fail(where, "rollout_count", "must equal groups × group_size")
    seed_start = need_int(summary, "seed_start", where, 0, MAX_SEED)
    if seed_start + groups - 1 > MAX_SEED:
        raise fail(where, "seed_start", "seed_start + groups - 1 exceeds 2^63-1")
    need_int(summary, "max_steps", where, 1, 256)
    need_int(summary, "concurrency", where, 1, 256)
    max_tokens = need_int(summary, "max_action_tokens", where, 1, 16384)
    thinking = need_bool(summary, "thinking", where)
    need_bool(summary, "constrained_actions", where)
    budget = summary["thinking_budget_tokens"]
    if budget is not None:
        need_int(summary, "thinking_budget_tokens", where, 1, max_tokens - 1)
        if not thinking:
            raise fail(where, "thinking_budget_tokens", "requires thinking=true")
    temperature = summary["temperature"]
    if not _is_number(temperature) or temperature < 0:
        raise fail(where, "temperature", "must be a finite number >= 0")
    need_float(summary, "protocol_error_reward", where)
    need_int(summary, "max_recoverable_errors", where, 0, 64)
    need_int(summary, "capacity_wait_seconds", where, 1, 3600)
    for key in ("reset_plan_sha256", "dataset_sha256", "replay_sha256"):
        need_digest(summary, key, where)
    need_int(summary, "dataset_bytes", where, 0, MAX_ARTIFACT_BYTES)
    need_int(summary, "replay_bytes", where, 1, MAX_ARTIFACT_BYTES)
    need_dict(summary["stats"], where, "stats")
    records = need_list(summary["rollouts"], where, "rollouts")
    if len(records) != groups * group_size:
        raise fail(where, "rollouts", "must hold rollout_count records")
    if "training_selection" in summary:
        need_dict(summary["training_selection"], where, "training_selection")


def check_behavior_policy(policy: Any, adapter: str | None, where: Where) -> None:
    """v5: a valid behaviour-policy identity whose adapter name equals the summary's ``adapter``."""
    policy = need_dict(policy, where, "behavior_policy")
    if not is_digest(policy.get("base_model_sha256")):
        raise fail(where, "behavior_policy.base_model_sha256", "must be a sha256 digest")
    if not isinstance(policy.get("runtime"), dict):
        raise fail(where, "behavior_policy.runtime", "must be a JSON object")
    adapter_digest = policy.get("adapter_sha256")
    if adapter is None and adapter_digest is not None:
        raise fail(where, "behavior_policy.adapter_sha256", "must be null for the base model")
    if adapter is not None and not is_digest(adapter_digest):
        raise fail(where, "behavior_policy.adapter_sha256", "must be the adapter's sha256 digest")
    if "adapter" in policy and policy["adapter"] != adapter:
        raise fail(where, "behavior_policy.adapter", "differs from the summary's adapter")


def check_inspection(inspection: Any, where: Where, field: str) -> None:
    """An inspection ``{identity, schema}`` whose schema digest matches its schema document."""
    inspection = need_dict(inspection, where, field)
    need_keys(inspection, frozenset({"identity", "schema"}), where, field)
    identity = need_dict(inspection["identity"], where, f"{field}.identity")
    schema = need_dict(inspection["schema"], where, f"{field}.schema")
    if identity.get("schema") != IDENTITY_SCHEMA:
        raise fail(where, f"{field}.identity.schema", f"must be {IDENTITY_SCHEMA!r}")
    if identity.get("client_profile") != CLIENT_PROFILE:
        raise fail(where, f"{field}.identity.client_profile", f"must be {CLIENT_PROFILE!r}")
    for key in ("base_url", "websocket_url"):
        if not isinstance(identity.get(key), str):
            raise fail(where, f"{field}.identity.{key}", "must be a string")
    if identity.get("authentication") not in ("none", "bearer"):
        raise fail(where, f"{field}.identity.authentication", "must be 'none' or 'bearer'")
    if not isinstance(identity.get("metadata"), dict):
        raise fail(where, f"{field}.identity.metadata", "must be a JSON object")
    if not isinstance(identity.get("environments"), list):
        raise fail(where, f"{field}.identity.environments", "must be a JSON array")
    if identity.get("schema_sha256") != digest_json(schema):
        raise fail(where, f"{field}.identity.schema_sha256", "is not the digest of the schema document")
    if "discovery_sha256" in identity and not is_digest(identity["discovery_sha256"]):
        raise fail(where, f"{field}.identity.discovery_sha256", "must be a sha256 digest")
    if not isinstance(schema.get("action"), dict):
        raise fail(where, f"{field}.schema.action", "must be a JSON object")


# ----------------------------------------------------------------------------- replay manifest
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


def recompute_return(values: list[float], protocol_errors: int, penalty: float, invalid: bool) -> float:
    """Exactly :attr:`kiln.rollout.episode.CandidateEpisode.episode_return`'s float order."""
    total = 0.0
    for value in values:
        total += value
    total += penalty * protocol_errors
    if invalid:
        total += penalty
    return total


def check_replay_candidate(
    candidate: Any, index: int, where: Where, *, max_steps: int, penalty: float, max_recoverable: int
) -> CandidateFacts:
    """R4.4 manifest rules for one candidate."""
    where = where.at(candidate=index)
    candidate = need_dict(candidate, where, "candidate")
    need_keys(candidate, _CANDIDATE_KEYS, where, "", frozenset({"final_state", "reset_observation"}))
    if candidate["candidate_index"] != index or not _is_int(candidate["candidate_index"]):
        raise fail(where, "candidate_index", f"must be {index} (contiguous candidate indices)")
    exchanges = need_list(candidate["exchanges"], where, "exchanges")
    if len(exchanges) > max_steps:
        raise fail(where, "exchanges", f"holds {len(exchanges)} exchanges, more than max_steps {max_steps}")
    values: list[float] = []
    protocol_errors = recoverable = 0
    ended: str | None = None
    code: str | None = None
    last_terminal_code = False
    for step, exchange in enumerate(exchanges):
        at = where.at(step=step)
        if ended is not None:
            raise fail(at, "exchanges", f"an exchange follows a terminal result ({ended})")
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
            values.append(training_reward(wire["reward"]))
            if wire["done"]:
                ended = "done"
        elif kind == "protocol_error":
            need_keys(result, frozenset({"kind", "error", "continued"}), at, "result")
            error = need_dict(result["error"], at, "result.error")
            if not isinstance(error.get("code"), str):
                raise fail(at, "result.error.code", "must be a string")
            if not isinstance(result["continued"], bool):
                raise fail(at, "result.continued", "must be a boolean")
            is_recoverable = error["code"] in RECOVERABLE_CODES
            expected = is_recoverable and recoverable < max_recoverable
            if result["continued"] != expected:
                raise fail(
                    at, "result.continued",
                    f"must be {str(expected).lower()}: code {error['code']} with {recoverable} "
                    f"recoverable errors before it and a budget of {max_recoverable}",
                )
            recoverable += int(is_recoverable)
            protocol_errors += 1
            if not expected:
                ended, code = "protocol_error", error["code"]
                last_terminal_code = error["code"] in TERMINAL_CODES
        else:
            raise fail(at, "result.kind", "must be 'observation' or 'protocol_error'")
    termination = candidate["termination"]
    if termination not in _TERMINATIONS:
        raise fail(where, "termination", f"must be one of {sorted(_TERMINATIONS)}")
    if ended is not None and termination != ended:
        raise fail(where, "termination", f"must be {ended!r} after the last exchange's result")
    if ended is None:
        if termination == "max_steps" and len(exchanges) != max_steps:
            raise fail(where, "termination", f"max_steps needs exactly {max_steps} exchanges, found {len(exchanges)}")
        if termination == "invalid_model_action" and len(exchanges) >= max_steps:
            raise fail(where, "termination", "invalid_model_action after max_steps exchanges")
        if termination in ("done", "protocol_error"):
            raise fail(where, "termination", f"{termination!r} does not match the last exchange's result")
    if need_bool(candidate, "terminal_done", where) != (termination == "done"):
        raise fail(where, "terminal_done", "must be true exactly when termination is 'done'")
    if need_int(candidate, "recoverable_protocol_errors", where) != recoverable:
        raise fail(where, "recoverable_protocol_errors", f"must be {recoverable} (recoverable errors in the exchanges)")
    need_int(candidate, "capacity_retries", where)
    need_int(candidate, "model_tokens", where)
    returned = need_float(candidate, "episode_return", where)
    expected_return = recompute_return(values, protocol_errors, penalty, termination == "invalid_model_action")
    if not same_float(returned, expected_return):
        raise fail(
            where, "episode_return",
            f"{returned!r} is not the recomputed return {expected_return!r} (bitwise)",
        )
    if last_terminal_code:
        if "final_state" in candidate:
            raise fail(where, "final_state", "must be absent after a terminal-code protocol error")
    else:
        if "final_state" not in candidate:
            raise fail(where, "final_state", "is missing (required unless the episode ended on a terminal-code error)")
        need_dict(candidate["final_state"], where, "final_state")
    return CandidateFacts(exchanges, returned, termination, code)


def rebuild_reset_plan(groups: list[dict], environment_count: int) -> list[dict]:
    """Seed-free templates per environment from the replay's reset payloads (R3.1, R4.6)."""
    templates: list[dict | None] = [None] * environment_count
    for group in groups:
        where = Where(REPLAY_FILE, group=group["group_index"])
        template = {k: v for k, v in group["reset_payload"].items() if k != "seed"}
        index = group["environment_index"]
        if templates[index] is None:
            templates[index] = template
        elif not same_json(templates[index], template):
            raise fail(where, "reset_payload", f"differs from environment {index}'s earlier reset template")
    for index, template in enumerate(templates):
        if template is None:
            raise fail(Where(REPLAY_FILE), "groups", f"environment {index} is never exercised")
    return templates  # type: ignore[return-value]


# ----------------------------------------------------------------------------- dataset side
def split_answer(content: str, thinking: bool) -> str | None:
    """The final answer of an action segment: text after the first ``</think>`` when thinking."""
    if not thinking:
        return content.strip()
    cut = content.find(THINK_CLOSE)
    if cut < 0:
        return None
    return content[cut + len(THINK_CLOSE) :].strip()


def expected_harness(answer: str | None, validator: ActionValidator) -> tuple[str, str] | None:
    """``(code, message)`` the collector records for a final action text, None when it is valid."""
    if answer is None or not answer.strip():
        return NO_OUTPUT, NO_OUTPUT_MESSAGE
    try:
        action = parse_action_text(answer)
    except ActionParseError as exc:
        return INVALID_ACTION, str(exc)
    issues = validator.validate(action)
    if issues:
        return SCHEMA_FAILED, SCHEMA_FAILED_PREFIX + compact_json(issues).decode("utf-8")
    return None


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
    completion: dict, facts: CandidateFacts, where: Where, *, thinking: bool, validator: ActionValidator,
    max_action_tokens: int | None = None,
) -> None:
    """R4.2 structure: actions parse to the exchanged actions, observations are recomputed."""
    trajectory = need_list(completion["trajectory"], where, "trajectory")
    invalid = facts.termination == "invalid_model_action"
    expected_len = 2 * (len(facts.exchanges) + int(invalid))
    if len(trajectory) != expected_len:
        raise fail(where, "trajectory", f"holds {len(trajectory)} segments, expected {expected_len}")
    actions: list[str] = []
    for step, exchange in enumerate(facts.exchanges):
        at = where.at(step=step)
        action_seg = check_segment(trajectory[2 * step], at, f"trajectory[{2 * step}]", "assistant", "action", False)
        actions.append(action_seg["content"])
        answer = split_answer(action_seg["content"], thinking)
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
        result = exchange["result"]
        if result["kind"] == "observation":
            seg = check_segment(
                trajectory[2 * step + 1], at, f"trajectory[{2 * step + 1}]", "tool", "observation", False
            )
            expected = observation_content(result["observation"], "step result")
        else:
            seg = check_segment(
                trajectory[2 * step + 1], at, f"trajectory[{2 * step + 1}]", "tool", "observation", True
            )
            expected = protocol_error_content(result["error"], result["continued"])
        if seg["content"] != expected:
            raise fail(at, f"trajectory[{2 * step + 1}].content", "is not the recorded exchange's observation content")
    harness = completion["harness_code"]
    if invalid:
        step = len(facts.exchanges)
        at = where.at(step=step)
        action_seg = check_segment(trajectory[2 * step], at, f"trajectory[{2 * step}]", "assistant", "action", False)
        actions.append(action_seg["content"])
        outcome = expected_harness(split_answer(action_seg["content"], thinking), validator)
        if outcome is not None and max_action_tokens is not None:
            last = [p for p in completion["tokens"]["pieces"] if isinstance(p, dict) and p.get("kind") == "action"]
            outcome = truncation_outcome(*outcome, len(last[-1].get("ids") or []) if last else 0, max_action_tokens)
        if outcome is None:
            raise fail(at, f"trajectory[{2 * step}].content", "is a valid action, yet the candidate ended invalid_model_action")
        if harness != outcome[0]:
            raise fail(where, "harness_code", f"must be {outcome[0]!r} for the final action text")
        seg = check_segment(trajectory[2 * step + 1], at, f"trajectory[{2 * step + 1}]", "tool", "observation", True)
        if seg["content"] != harness_error_content(*outcome):
            raise fail(at, f"trajectory[{2 * step + 1}].content", "is not the recomputed harness error content")
    elif harness is not None:
        raise fail(where, "harness_code", "must be null unless termination is invalid_model_action")
    if completion["text"] != TURN_BREAK.join(actions):
        raise fail(where, "text", f"must be the action contents joined by {TURN_BREAK}")


def check_pieces(
    completion: dict, facts: CandidateFacts, where: Where, *, model_tokens: int, max_action_tokens: int
) -> None:
    """Token pieces: context, then per turn action [+ context, observation, context]."""
    tokens = need_dict(completion["tokens"], where, "tokens")
    need_keys(tokens, frozenset({"pieces"}), where, "tokens")
    pieces = need_list(tokens["pieces"], where, "tokens.pieces")
    layout: list[tuple[str, bool | None]] = [("context", None)]
    for exchange in facts.exchanges:
        warn = exchange["result"]["kind"] == "protocol_error"
        layout += [("action", None), ("context", None), ("observation", warn), ("context", None)]
    if facts.termination == "invalid_model_action":
        layout.append(("action", None))
        if completion["harness_code"] != NO_OUTPUT:
            layout += [("context", None), ("observation", True), ("context", None)]
    if len(pieces) != len(layout):
        raise fail(where, "tokens.pieces", f"holds {len(pieces)} pieces, expected {len(layout)}")
    total = 0
    for index, ((kind, warning), piece) in enumerate(zip(layout, pieces)):
        field = f"tokens.pieces[{index}]"
        piece = need_dict(piece, where, field)
        keys = {"kind", "ids"} | ({"logprobs"} if kind == "action" else set()) | (
            {"warning"} if kind == "observation" else set()
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
    if total != model_tokens:
        raise fail(where, "model_tokens", f"must be {total} (the action token ids)")


def check_provenance(
    provenance: Any, where: Where, *, inspection: dict, group: dict, facts: CandidateFacts,
    behavior_policy: dict,
) -> None:
    """R4.3 ``openenv`` rollout provenance against the inspection, the replay and the summary."""
    field = "openenv"
    prov = need_dict(provenance, where, field)
    optional = frozenset({"protocol_error_code"})
    need_keys(prov, _PROVENANCE_KEYS, where, field, optional)
    identity = inspection["identity"]
    expected = {
        "schema": ROLLOUT_SCHEMA,
        "environment_name": environment_name(identity),
        "environment_base_url": identity["base_url"],
        "openapi_version": identity.get("openapi_version"),
        "discovery_sha256": identity.get("discovery_sha256"),
        "environment_schema_sha256": identity["schema_sha256"],
        "action_schema_sha256": digest_json(inspection["schema"]["action"]),
        "reset_sha256": digest_json(group["reset_payload"]),
        "seed": group["seed"],
        "steps": len(facts.exchanges),
        "terminal_done": facts.termination == "done",
        "termination": facts.termination,
        "behavior_policy": behavior_policy,
    }
    for key, value in expected.items():
        need_equal(prov[key], value, where, f"{field}.{key}", "the replay / inspection / summary")
    if not same_float(prov["episode_return"], facts.episode_return):
        raise fail(where, f"{field}.episode_return", "is not bit-identical to the replay's episode_return")
    if facts.termination == "protocol_error":
        if prov.get("protocol_error_code") != facts.protocol_error_code:
            raise fail(where, f"{field}.protocol_error_code", f"must be {facts.protocol_error_code!r}")
    elif "protocol_error_code" in prov:
        raise fail(where, f"{field}.protocol_error_code", "must be absent unless termination is protocol_error")


def check_record(
    record: Any, where: Where, *, group: dict, candidate: dict, facts: CandidateFacts, inspection: dict,
    harness_code: str | None = None,
) -> None:
    """One summary ``rollouts`` record against the replay candidate."""
    record = need_dict(record, where, "rollouts[]")
    need_keys(record, _RECORD_KEYS, where, "rollouts[]", frozenset({"protocol_error_code", "harness_code"}))
    if "harness_code" in record and record["harness_code"] != harness_code:
        raise fail(where, "rollouts[].harness_code", f"must be the completion's harness_code {harness_code!r}")
    identity = inspection["identity"]
    expected = {
        "group_index": group["group_index"],
        "candidate_index": candidate["candidate_index"],
        "environment_name": environment_name(identity),
        "environment_url": identity["base_url"],
        "seed": group["seed"],
        "steps": len(facts.exchanges),
        "terminal_done": candidate["terminal_done"],
        "termination": candidate["termination"],
        "recoverable_protocol_errors": candidate["recoverable_protocol_errors"],
        "capacity_retries": candidate["capacity_retries"],
        "model_tokens": candidate["model_tokens"],
    }
    for key, value in expected.items():
        need_equal(record[key], value, where, f"rollouts[].{key}", "the replay")
    if not same_float(record["episode_return"], facts.episode_return):
        raise fail(where, "rollouts[].episode_return", "is not bit-identical to the replay's episode_return")
    if facts.termination == "protocol_error":
        if record.get("protocol_error_code") != facts.protocol_error_code:
            raise fail(where, "rollouts[].protocol_error_code", f"must be {facts.protocol_error_code!r}")
    elif "protocol_error_code" in record:
        raise fail(where, "rollouts[].protocol_error_code", "must be absent unless termination is protocol_error")


# ----------------------------------------------------------------------------- driver
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


def check_group(
    g: int, group: Any, line: dict, summary: dict, validators: list[ActionValidator], records: list
) -> int:
    """All checks of one group; returns its number of environment exchanges."""
    rwhere = Where(REPLAY_FILE, group=g)
    group = need_dict(group, rwhere, "group")
    need_keys(group, _GROUP_KEYS, rwhere, "", frozenset({"reset_nondeterministic_fields"}))
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
    inspection = environments[group["environment_index"]]
    validator = validators[group["environment_index"]]

    dwhere = Where(DATASET_FILE, group=g)
    need_keys(line, frozenset({"messages", "completions"}), dwhere, "")
    expected_messages = initial_messages(
        inspection["identity"]["metadata"], policy_action_schema(inspection["schema"]["action"]), reset,
        inspection["identity"].get("tools"),
    )
    if not same_json(line["messages"], expected_messages):
        raise fail(dwhere, "messages", "is not the recomputed R3.6 prompt for this group's reset observation")
    completions = need_list(line["completions"], dwhere, "completions")
    if len(completions) != len(candidates):
        raise fail(dwhere, "completions", f"holds {len(completions)} completions, expected {len(candidates)}")

    exchanges = 0
    for c, candidate in enumerate(candidates):
        facts = check_replay_candidate(
            candidate, c, rwhere,
            max_steps=summary["max_steps"],
            penalty=summary["protocol_error_reward"],
            max_recoverable=summary["max_recoverable_errors"],
        )
        exchanges += len(facts.exchanges)
        cwhere = dwhere.at(candidate=c)
        completion = need_dict(completions[c], cwhere, "completion")
        need_keys(completion, _COMPLETION_KEYS, cwhere, "")
        if not same_float(completion["reward"], facts.episode_return):
            raise fail(cwhere, "reward", "is not bit-identical to the replay's episode_return")
        check_provenance(
            completion["openenv"], cwhere, inspection=inspection, group=group, facts=facts,
            behavior_policy=summary["behavior_policy"],
        )
        if completion["harness_code"] is not None and completion["harness_code"] not in _HARNESS_CODES:
            raise fail(cwhere, "harness_code", f"must be null or one of {sorted(_HARNESS_CODES)}")
        check_trajectory(
            completion, facts, cwhere, thinking=summary["thinking"], validator=validator,
            max_action_tokens=summary["max_action_tokens"],
        )
        check_pieces(
            completion, facts, cwhere,
            model_tokens=candidate["model_tokens"], max_action_tokens=summary["max_action_tokens"],
        )
        record_index = g * summary["group_size"] + c
        check_record(
            records[record_index], Where(SUMMARY_FILE, group=g, candidate=c),
            group=group, candidate=candidate, facts=facts, inspection=inspection,
            harness_code=completion["harness_code"],
        )
    return exchanges


def load_bundle(
    summary_path: Path, *, dataset_path: Path | None = None, replay_path: Path | None = None
) -> Bundle:
    """Verify the bundle and return its parsed files with the verification report.

    Fail closed: a shape the explicit checks did not anticipate (an exception other than
    :class:`VerificationFailed`) is reported as a ``VerificationFailed`` on field ``structure``.
    """
    try:
        return _load_bundle(summary_path, dataset_path=dataset_path, replay_path=replay_path)
    except VerificationFailed:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError, KilnError) as exc:
        raise VerificationFailed(
            f"bundle of {summary_path} field structure: unexpected shape ({type(exc).__name__})",
            details={"file": None, "group_index": None, "candidate_index": None, "step_index": None,
                     "field": "structure", "exception": type(exc).__name__},
        ) from exc


def _load_bundle(
    summary_path: Path, *, dataset_path: Path | None = None, replay_path: Path | None = None
) -> Bundle:
    summary_path = Path(summary_path)
    default_dataset, default_replay = default_paths(summary_path)
    dataset_path = Path(dataset_path) if dataset_path is not None else default_dataset
    replay_path = Path(replay_path) if replay_path is not None else default_replay
    resolved = {p.resolve() for p in (summary_path, dataset_path, replay_path)}
    if len(resolved) != 3:
        raise fail(Where(SUMMARY_FILE), "path", "summary, dataset and replay paths must all differ")

    summary = parse_pretty(_read(summary_path, SUMMARY_FILE), SUMMARY_FILE)
    check_summary(summary)
    dataset_raw = _read(dataset_path, DATASET_FILE)
    replay_raw = _read(replay_path, REPLAY_FILE)
    for file, raw, prefix in ((DATASET_FILE, dataset_raw, "dataset"), (REPLAY_FILE, replay_raw, "replay")):
        if len(raw) != summary[f"{prefix}_bytes"]:
            raise fail(Where(SUMMARY_FILE), f"{prefix}_bytes", f"the {file} file has {len(raw)} bytes")
        if sha256_bytes(raw) != summary[f"{prefix}_sha256"]:
            raise fail(Where(SUMMARY_FILE), f"{prefix}_sha256", f"does not match the {file} file's sha256")
    dataset_sha256 = summary["dataset_sha256"]
    replay = parse_pretty(replay_raw, REPLAY_FILE)
    check_replay_header(replay, summary, dataset_sha256)
    lines = parse_dataset(dataset_raw)
    if len(lines) != summary["groups"]:
        raise fail(Where(DATASET_FILE), "lines", f"holds {len(lines)} groups, the summary says {summary['groups']}")

    validators = []
    for index, inspection in enumerate(summary["environments"]):
        try:
            validators.append(ActionValidator.compile(inspection["schema"]["action"]))
        except KilnError as exc:
            raise fail(Where(SUMMARY_FILE), f"environments[{index}].schema.action", exc.message) from None

    exchanges = 0
    for g, (group, line) in enumerate(zip(replay["groups"], lines)):
        exchanges += check_group(g, group, line, summary, validators, summary["rollouts"])

    plan = rebuild_reset_plan(replay["groups"], len(summary["environments"]))
    if digest_json(plan) != summary["reset_plan_sha256"]:
        raise fail(Where(SUMMARY_FILE), "reset_plan_sha256", "does not match the reset plan rebuilt from the replay")
    if not same_json(rollout_stats(summary["rollouts"]), summary["stats"]):
        raise fail(Where(SUMMARY_FILE), "stats", "differ from the stats recomputed from the rollout records")

    report = {
        "schema": VERIFICATION_SCHEMA,
        "summary_path": str(summary_path),
        "dataset_path": str(dataset_path),
        "replay_path": str(replay_path),
        "dataset_sha256": dataset_sha256,
        "replay_sha256": summary["replay_sha256"],
        "groups": summary["groups"],
        "rollouts": summary["rollout_count"],
        "environment_exchanges": exchanges,
    }
    return Bundle(summary_path, dataset_path, replay_path, summary, replay, lines, report)


def verify_bundle(
    summary_path: Path, *, dataset_path: Path | None = None, replay_path: Path | None = None
) -> dict:
    """Verify a bundle offline; return the ``kiln.openenv-verification.v1`` report.

    Raises :class:`VerificationFailed` (``openenv_verification_failed``) on the first violation.
    """
    return load_bundle(summary_path, dataset_path=dataset_path, replay_path=replay_path).report
