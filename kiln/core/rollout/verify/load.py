"""The driver: read and check the three files, every group and candidate, then the totals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.canonical import digest_json, sha256_bytes
from kiln.core.errors import KilnError
from kiln.core.openenv.tool_calls import ActionContract, action_contract
from kiln.core.rollout.bundle import rollout_stats
from kiln.core.rollout.exchange import HARNESS_CODES
from kiln.core.rollout.prompts import initial_messages
from kiln.core.rollout.verify.checks import (
    DATASET_FILE,
    REPLAY_FILE,
    SUMMARY_FILE,
    VerificationFailed,
    Where,
    fail,
    need_dict,
    need_keys,
    need_list,
    same_float,
    same_json,
)
from kiln.core.rollout.verify.files import Bundle, bundle_paths, parse_dataset, parse_pretty, read_capped
from kiln.core.rollout.verify.replay import (
    check_replay_candidate,
    check_replay_group,
    check_replay_header,
    rebuild_reset_plan,
)
from kiln.core.rollout.verify.summary import check_record, check_summary
from kiln.core.rollout.verify.trajectory import check_pieces, check_provenance, check_trajectory

VERIFICATION_SCHEMA = "kiln.openenv-verification.v1"
_COMPLETION_KEYS = frozenset({"text", "reward", "trajectory", "openenv", "harness_code", "tokens"})


def check_group(g: int, group: Any, line: dict, summary: dict, contracts: list[ActionContract], records: list) -> int:
    """All checks of one group; returns its number of environment exchanges."""
    rwhere = Where(REPLAY_FILE, group=g)
    group, reset = check_replay_group(g, group, summary)
    candidates = group["candidates"]
    environments = summary["environments"]
    inspection = environments[group["environment_index"]]
    shown_schema, validator = contracts[group["environment_index"]]

    dwhere = Where(DATASET_FILE, group=g)
    need_keys(line, frozenset({"messages", "completions"}), dwhere, "")
    expected_messages = initial_messages(
        inspection["identity"]["metadata"],
        shown_schema,
        reset,
        inspection["identity"].get("tools"),
        inspection["identity"].get("tool_calls"),
    )
    if not same_json(line["messages"], expected_messages):
        raise fail(dwhere, "messages", "is not the recomputed prompt for this group's reset observation")
    completions = need_list(line["completions"], dwhere, "completions")
    if len(completions) != len(candidates):
        raise fail(dwhere, "completions", f"holds {len(completions)} completions, expected {len(candidates)}")

    exchanges = 0
    for c, candidate in enumerate(candidates):
        facts = check_replay_candidate(
            candidate,
            c,
            rwhere,
            max_steps=summary["max_steps"],
            penalty=summary["protocol_error_reward"],
            max_recoverable=summary["max_recoverable_errors"],
            context_limit=summary.get("context_tokens"),
            penalise_context=summary.get("context_policy") == "end_penalised",
        )
        exchanges += len(facts.exchanges)
        cwhere = dwhere.at(candidate=c)
        completion = need_dict(completions[c], cwhere, "completion")
        need_keys(completion, _COMPLETION_KEYS, cwhere, "")
        if not same_float(completion["reward"], facts.episode_return):
            raise fail(cwhere, "reward", "is not bit-identical to the replay's episode_return")
        check_provenance(
            completion["openenv"],
            cwhere,
            inspection=inspection,
            group=group,
            facts=facts,
            behavior_policy=summary["behavior_policy"],
            context_policy=summary.get("context_policy", "end"),
        )
        if completion["harness_code"] is not None and completion["harness_code"] not in HARNESS_CODES:
            raise fail(cwhere, "harness_code", f"must be null or one of {sorted(HARNESS_CODES)}")
        check_trajectory(
            completion,
            facts,
            cwhere,
            thinking=summary["thinking"],
            validator=validator,
            max_action_tokens=summary["max_action_tokens"],
        )
        check_pieces(
            completion,
            facts,
            cwhere,
            model_tokens=candidate["model_tokens"],
            max_action_tokens=summary["max_action_tokens"],
            context_limit=summary.get("context_tokens"),
        )
        record_index = g * summary["group_size"] + c
        check_record(
            records[record_index],
            Where(SUMMARY_FILE, group=g, candidate=c),
            group=group,
            candidate=candidate,
            facts=facts,
            inspection=inspection,
            harness_code=completion["harness_code"],
        )
    return exchanges


def load_bundle(summary_path: Path, *, dataset_path: Path | None = None, replay_path: Path | None = None) -> Bundle:
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
            details={
                "file": None,
                "group_index": None,
                "candidate_index": None,
                "step_index": None,
                "field": "structure",
                "exception": type(exc).__name__,
            },
        ) from exc


def _load_bundle(summary_path: Path, *, dataset_path: Path | None = None, replay_path: Path | None = None) -> Bundle:
    summary_path = Path(summary_path)
    summary_raw = read_capped(summary_path, SUMMARY_FILE)
    dataset_path, replay_path = bundle_paths(summary_path, dataset_path, replay_path)
    resolved = {p.resolve() for p in (summary_path, dataset_path, replay_path)}
    if len(resolved) != 3:
        raise fail(Where(SUMMARY_FILE), "path", "summary, dataset and replay paths must all differ")

    summary = parse_pretty(summary_raw, SUMMARY_FILE)
    check_summary(summary)
    dataset_raw = read_capped(dataset_path, DATASET_FILE)
    replay_raw = read_capped(replay_path, REPLAY_FILE)
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

    contracts = []
    for index, inspection in enumerate(summary["environments"]):
        try:
            contracts.append(action_contract(inspection))
        except KilnError as exc:
            raise fail(Where(SUMMARY_FILE), f"environments[{index}].schema.action", exc.message) from None

    exchanges = 0
    for g, (group, line) in enumerate(zip(replay["groups"], lines)):
        exchanges += check_group(g, group, line, summary, contracts, summary["rollouts"])

    plan = rebuild_reset_plan(replay["groups"], len(summary["environments"]))
    if digest_json(plan) != summary["reset_plan_sha256"]:
        raise fail(Where(SUMMARY_FILE), "reset_plan_sha256", "does not match the reset plan rebuilt from the replay")
    stats = rollout_stats(summary["rollouts"])
    if "context_exhausted_count" not in summary["stats"] and not stats["context_exhausted_count"]:
        del stats["context_exhausted_count"]  # bundles written before the count existed
    legacy = [r.get("capacity_retries") for r in summary["rollouts"] if isinstance(r, dict)]
    if any(value is not None for value in legacy):  # bundles written before refusals left them
        stats["capacity_retry_count"] = sum(int(value or 0) for value in legacy)
    if "context_tokens" in summary:
        stats["context_tokens"] = summary["context_tokens"]
    if not same_json(stats, summary["stats"]):
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


def verify_bundle(summary_path: Path, *, dataset_path: Path | None = None, replay_path: Path | None = None) -> dict:
    """Verify a bundle offline; return the ``kiln.openenv-verification.v1`` report.

    Raises :class:`VerificationFailed` (``openenv_verification_failed``) on the first violation.
    """
    return load_bundle(summary_path, dataset_path=dataset_path, replay_path=replay_path).report
