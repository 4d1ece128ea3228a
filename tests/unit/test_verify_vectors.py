"""Replay validation vectors (reference-behaviour §11, adapted to Kiln's format) and invalid tails.

* Synthetic replay candidates drive :func:`kiln.core.rollout.verify.check_replay_candidate` directly.
* A scripted policy (no model) drives the REAL ``GroupCollector`` against the counter env to
  produce the three harness outcomes (invalid JSON, schema failure, no output) and a fenced action;
  the resulting bundle verifies, and edits of its invalid tails are caught.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from kiln.core.canonical import canonical_json
from kiln.core.contracts import reset_payload, reset_plan_sha256
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.rollout.bundle import build_bundle
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from kiln.core.rollout.verify import (
    VerificationFailed,
    Where,
    check_replay_candidate,
    recompute_return,
    verify_bundle,
)
from tests.support.scripted_policy import ScriptedPolicy
from tests.unit.test_verify_support import parse, reseal, spec_for, write_bundle

WHERE = Where("replay", group=0)


def _obs(reward: Any, done: bool, total: int = 0) -> dict:
    return {"kind": "observation", "observation": {"observation": {"total": total}, "reward": reward, "done": done}}


def _err(code: str, continued: bool) -> dict:
    return {"kind": "protocol_error", "error": {"code": code, "message": "Invalid message"}, "continued": continued}


def _candidate(results: list[dict], *, ret: float, termination: str, recoverable: int = 0, final: bool = True) -> dict:
    out: dict[str, Any] = {
        "candidate_index": 0,
        "exchanges": [{"step_index": i, "action": {"amount": 2}, "result": r} for i, r in enumerate(results)],
        "episode_return": ret,
        "terminal_done": termination == "done",
        "termination": termination,
        "recoverable_protocol_errors": recoverable,
        "capacity_retries": 1,
        "model_tokens": 4,
    }
    if final:
        out["final_state"] = {"total": 2, "step_count": 1}
    return out


def _check(candidate: dict, *, max_steps: int = 8, max_recoverable: int = 3):
    return check_replay_candidate(
        candidate, 0, WHERE, max_steps=max_steps, penalty=-1.0, max_recoverable=max_recoverable
    )


def test_validation_error_continued_then_reward_2_done_returns_1() -> None:
    facts = _check(_candidate([_err("VALIDATION_ERROR", True), _obs(2, True)], ret=1.0, termination="done", recoverable=1))
    assert facts.episode_return == 1.0 and facts.termination == "done"
    with pytest.raises(VerificationFailed) as info:  # the recovery count is part of the manifest
        _check(_candidate([_err("VALIDATION_ERROR", True), _obs(2, True)], ret=1.0, termination="done", recoverable=0))
    assert info.value.details["field"] == "recoverable_protocol_errors"


def test_invalid_model_action_without_exchanges_returns_minus_one() -> None:
    assert _check(_candidate([], ret=-1.0, termination="invalid_model_action")).episode_return == -1.0
    with pytest.raises(VerificationFailed) as info:
        _check(_candidate([], ret=0.0, termination="invalid_model_action"))
    assert info.value.details == {
        "file": "replay", "group_index": 0, "candidate_index": 0, "step_index": None, "field": "episode_return",
    }
    assert "recomputed return -1.0" in info.value.message


def test_minimal_reference_candidate_max_steps_return_2() -> None:
    facts = _check(_candidate([_obs(2.0, False, total=2)], ret=2.0, termination="max_steps"), max_steps=1)
    assert (facts.termination, facts.episode_return) == ("max_steps", 2.0)
    with pytest.raises(VerificationFailed, match="exactly 2 exchanges"):
        _check(_candidate([_obs(2.0, False)], ret=2.0, termination="max_steps"), max_steps=2)


def test_return_is_compared_bitwise_and_by_type() -> None:
    assert recompute_return([0.1, 0.2], 0, -1.0, False) == 0.1 + 0.2
    good = _candidate([_obs(0.1, False), _obs(0.2, True)], ret=0.1 + 0.2, termination="done")
    _check(good)
    with pytest.raises(VerificationFailed):  # 0.3 differs from 0.1 + 0.2 in the last bit
        _check({**good, "episode_return": 0.3})
    with pytest.raises(VerificationFailed, match="finite JSON float"):
        _check(_candidate([_obs(2, True)], ret=2, termination="done"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "results,termination,recoverable,final,field",
    [
        # continued must be false after a terminal code
        ([_err("SESSION_ERROR", True)], "protocol_error", 0, False, "result.continued"),
        # a terminal-code error leaves no final state
        ([_err("SESSION_ERROR", False)], "protocol_error", 0, True, "final_state"),
        # budget exhausted: the 2nd recoverable error (budget 1) must not continue
        ([_err("EXECUTION_ERROR", True), _err("EXECUTION_ERROR", True)], "protocol_error", 2, True, "result.continued"),
        # nothing may follow a done observation
        ([_obs(1, True), _obs(1, False)], "done", 0, True, "exchanges"),
        # done/termination agreement
        ([_obs(1, True)], "max_steps", 0, True, "termination"),
        ([_obs(1, False)], "done", 0, True, "termination"),
        # a protocol_error termination needs a non-continued error last
        ([_err("EXECUTION_ERROR", True)], "protocol_error", 1, True, "termination"),
    ],
)
def test_manifest_rules_fail_closed(results, termination, recoverable, final, field) -> None:
    values = [r["observation"]["reward"] for r in results if r["kind"] == "observation"]
    ret = recompute_return([float(v) for v in values], sum(r["kind"] == "protocol_error" for r in results), -1.0, False)
    with pytest.raises(VerificationFailed) as info:
        _check(
            _candidate(results, ret=ret, termination=termination, recoverable=recoverable, final=final),
            max_recoverable=1,
        )
    assert info.value.details["field"] == field, info.value.message


def test_budget_exhaustion_is_a_protocol_error_with_final_state() -> None:
    results = [_err("EXECUTION_ERROR", True), _err("EXECUTION_ERROR", False)]
    facts = _check(_candidate(results, ret=-2.0, termination="protocol_error", recoverable=2), max_recoverable=1)
    assert (facts.termination, facts.protocol_error_code, facts.episode_return) == ("protocol_error", "EXECUTION_ERROR", -2.0)


def test_step_indices_must_be_contiguous() -> None:
    candidate = _candidate([_obs(1, False), _obs(1, True)], ret=2.0, termination="done")
    candidate["exchanges"][1]["step_index"] = 2
    with pytest.raises(VerificationFailed) as info:
        _check(candidate)
    assert (info.value.details["step_index"], info.value.details["field"]) == (1, "step_index")


# ------------------------------------------------------------------ scripted policy, real collector
GROUP_SEED = 5
SCRIPTS = {
    0: ['</think>{"amount": 1}', "</think>not json"],  # 1 exchange, then INVALID_MODEL_ACTION
    1: ['reason</think>{"amount": 9}'],  # ACTION_SCHEMA_VALIDATION_FAILED, no exchange
    2: ["still thinking"],  # unfinished, no </think>: MODEL_ACTION_NO_OUTPUT
    3: ['</think>```json\n{"amount": 2}\n```', '\n</think>{"amount":1}', '</think> {"amount": 1} '],
}


async def _scripted_bundle(url: str, template: dict | None = None) -> dict[str, bytes]:
    template = dict(template or {})
    inspection = json.loads(canonical_json(await inspect_environment(url)))
    policy = ScriptedPolicy(SCRIPTS, [GROUP_SEED], unfinished=frozenset({2}))
    settings = EpisodeSettings(group_size=4, max_steps=3, max_action_tokens=64)
    task = GroupTask(
        group_index=0, environment_index=0, seed=GROUP_SEED, reset_payload=reset_payload(template, GROUP_SEED),
        inspection=inspection, settings=settings, behavior_policy=policy.identity(),
    )
    document = json.loads(canonical_json(await GroupCollector(task, policy).run()))
    return build_bundle(
        [document],
        spec=spec_for(settings, seed_start=GROUP_SEED),
        inspections=[inspection],
        behavior_policy=policy.identity(),
        reset_plan_sha256=reset_plan_sha256([template]),
    )


@pytest.fixture(scope="module")
def counter_url() -> Iterator[str]:
    from tests.support.servers import serve_example_env

    with serve_example_env("counter") as url:
        yield url


@pytest.fixture(scope="module")
def scripted(counter_url: str) -> dict[str, bytes]:
    return asyncio.run(_scripted_bundle(counter_url))


def test_reset_template_with_keys_after_seed_verifies(counter_url: str, tmp_path: Path) -> None:
    files = asyncio.run(_scripted_bundle(counter_url, {"split": "train"}))
    verify_bundle(write_bundle(tmp_path, files))


def test_scripted_bundle_with_invalid_tails_verifies(scripted: dict[str, bytes], tmp_path: Path) -> None:
    report = verify_bundle(write_bundle(tmp_path, scripted))
    assert (report["groups"], report["rollouts"], report["environment_exchanges"]) == (1, 4, 4)
    lines, replay, summary = parse(scripted)
    completions = lines[0]["completions"]
    assert [c["harness_code"] for c in completions] == [
        "INVALID_MODEL_ACTION", "ACTION_SCHEMA_VALIDATION_FAILED", "MODEL_ACTION_NO_OUTPUT", None,
    ]
    assert [c["reward"] for c in completions] == [0.0, -1.0, -1.0, 3.0]
    assert [r["termination"] for r in summary["rollouts"]] == ["invalid_model_action"] * 3 + ["max_steps"]
    assert [len(c["trajectory"]) for c in completions] == [4, 2, 2, 6]
    assert summary["stats"]["invalid_model_action_count"] == 3


def _edit_return_everywhere(lines, replay, summary, c: int, value: float) -> None:
    lines[0]["completions"][c]["reward"] = value
    lines[0]["completions"][c]["openenv"]["episode_return"] = value
    replay["groups"][0]["candidates"][c]["episode_return"] = value
    summary["rollouts"][c]["episode_return"] = value
    from kiln.core.rollout.bundle import rollout_stats

    summary["stats"] = rollout_stats(summary["rollouts"])


@pytest.mark.parametrize(
    "name,field",
    [
        ("invalid_return_zero", "episode_return"),
        ("harness_code", "harness_code"),
        ("harness_content", "trajectory[1].content"),
        ("harness_warning_len", "trajectory[1].warning_prefix_len"),
        ("schema_failure_made_valid", "trajectory[0].content"),
        ("no_output_gets_answer", "trajectory[0].content"),
        ("fenced_action_changed", "trajectory[0].content"),
    ],
)
def test_scripted_bundle_edits_are_detected(name: str, field: str, scripted: dict[str, bytes], tmp_path: Path) -> None:
    lines, replay, summary = parse(scripted)
    comps = lines[0]["completions"]
    if name == "invalid_return_zero":  # §11: -1.0 changed to 0.0 everywhere must fail
        _edit_return_everywhere(lines, replay, summary, 1, 0.0)
    elif name == "harness_code":
        comps[0]["harness_code"] = "ACTION_SCHEMA_VALIDATION_FAILED"
    elif name == "harness_content":
        assert "maximum" in comps[1]["trajectory"][1]["content"]
        comps[1]["trajectory"][1]["content"] = comps[1]["trajectory"][1]["content"].replace("maximum", "minimum")
        comps[1]["trajectory"][1]["warning_prefix_len"] = len(comps[1]["trajectory"][1]["content"].encode())
    elif name == "harness_warning_len":
        comps[1]["trajectory"][1]["warning_prefix_len"] -= 1
    elif name == "schema_failure_made_valid":
        comps[1]["trajectory"][0]["content"] = comps[1]["trajectory"][0]["content"].replace("9", "4")
        comps[1]["text"] = comps[1]["trajectory"][0]["content"]
    elif name == "no_output_gets_answer":
        comps[2]["trajectory"][0]["content"] += '</think>{"amount": 1}'
        comps[2]["text"] = comps[2]["trajectory"][0]["content"]
    elif name == "fenced_action_changed":
        comps[3]["trajectory"][0]["content"] = comps[3]["trajectory"][0]["content"].replace("2", "3")
    with pytest.raises(VerificationFailed) as info:
        verify_bundle(write_bundle(tmp_path, reseal(lines, replay, summary)))
    assert info.value.details["field"] == field, info.value.message
