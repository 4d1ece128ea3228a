"""Offline verification of a REAL bundle: it passes, paths resolve, and resealed edits fail.

The bundle is collected once (tiny model, live counter env, no Temporal): see
``tests/unit/test_verify_support.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from kiln.core.canonical import sha256_bytes
from kiln.core.rollout.verify import VERIFICATION_SCHEMA, VerificationFailed, default_paths, verify_bundle
from tests.unit.test_verify_support import parse, real_bundle, reseal, write_bundle


@pytest.fixture(scope="module")
def bundle(tiny_model_dir: Path) -> dict[str, bytes]:
    return real_bundle(tiny_model_dir)


def test_real_bundle_verifies_with_concrete_report(bundle: dict[str, bytes], tmp_path: Path) -> None:
    summary_path = write_bundle(tmp_path, bundle)
    report = verify_bundle(summary_path)
    summary = json.loads(bundle["summary.json"])
    assert report == {
        "schema": VERIFICATION_SCHEMA,
        "summary_path": str(summary_path),
        "dataset_path": str(tmp_path / "rollouts.jsonl"),
        "replay_path": str(tmp_path / "replay.json"),
        "dataset_sha256": sha256_bytes(bundle["rollouts.jsonl"]),
        "replay_sha256": sha256_bytes(bundle["replay.json"]),
        "groups": 3,
        "rollouts": 6,
        "environment_exchanges": summary["stats"]["total_environment_steps"],
    }
    assert report["environment_exchanges"] > 0
    # The collection really ran: 6 records with concrete seeds, env name and our reset template.
    assert [r["seed"] for r in summary["rollouts"]] == [100, 100, 101, 101, 102, 102]
    assert {r["environment_name"] for r in summary["rollouts"]} == {"counter"}
    replay = json.loads(bundle["replay.json"])
    assert replay["groups"][1]["reset_payload"] == {"difficulty": "easy", "seed": 101}


def test_cli_naming_pairs_files_by_stem(bundle: dict[str, bytes], tmp_path: Path) -> None:
    (tmp_path / "run7.rollout-summary.json").write_bytes(bundle["summary.json"])
    (tmp_path / "run7.rollouts.jsonl").write_bytes(bundle["rollouts.jsonl"])
    (tmp_path / "run7.replay.json").write_bytes(bundle["replay.json"])
    report = verify_bundle(tmp_path / "run7.rollout-summary.json")
    assert report["dataset_path"] == str(tmp_path / "run7.rollouts.jsonl")
    assert report["replay_path"] == str(tmp_path / "run7.replay.json")
    assert default_paths(Path("/x/summary.json")) == (Path("/x/rollouts.jsonl"), Path("/x/replay.json"))
    assert default_paths(Path("/x/openenv.rollout-summary.json")) == (
        Path("/x/openenv.rollouts.jsonl"),
        Path("/x/openenv.replay.json"),
    )


def test_explicit_paths_override_defaults(bundle: dict[str, bytes], tmp_path: Path) -> None:
    summary_path = tmp_path / "s.json"
    summary_path.write_bytes(bundle["summary.json"])
    (tmp_path / "data.jsonl").write_bytes(bundle["rollouts.jsonl"])
    (tmp_path / "r.json").write_bytes(bundle["replay.json"])
    report = verify_bundle(summary_path, dataset_path=tmp_path / "data.jsonl", replay_path=tmp_path / "r.json")
    assert report["groups"] == 3
    with pytest.raises(VerificationFailed) as info:  # defaults do not exist beside s.json
        verify_bundle(summary_path)
    assert info.value.details["file"] == "dataset" and info.value.details["field"] == "path"


def test_identical_paths_are_refused(bundle: dict[str, bytes], tmp_path: Path) -> None:
    summary_path = write_bundle(tmp_path, bundle)
    with pytest.raises(VerificationFailed, match="must all differ"):
        verify_bundle(summary_path, dataset_path=summary_path)


def test_swapped_replay_and_dataset_files_fail(bundle: dict[str, bytes], tmp_path: Path) -> None:
    summary_path = write_bundle(tmp_path, bundle)
    with pytest.raises(VerificationFailed) as info:
        verify_bundle(summary_path, dataset_path=tmp_path / "replay.json", replay_path=tmp_path / "rollouts.jsonl")
    assert info.value.code == "openenv_verification_failed"
    assert info.value.details["field"] == "dataset_bytes"


def _first_with_exchange(replay: dict) -> tuple[int, int]:
    for g, group in enumerate(replay["groups"]):
        for c, cand in enumerate(group["candidates"]):
            if cand["exchanges"]:
                return g, c
    raise AssertionError("the bundle has no exchange")


Edit = Callable[[list, dict, dict], None]


def _g0c0(lines: list, replay: dict, summary: dict) -> tuple[dict, dict, dict]:
    g, c = _first_with_exchange(replay)
    return lines[g]["completions"][c], replay["groups"][g]["candidates"][c], summary["rollouts"][g * 2 + c]


def _bump(value: float) -> float:
    return value + 1.0


def edit_swap_lines(lines, replay, summary):
    lines[0], lines[1] = lines[1], lines[0]


def edit_swap_replay_groups(lines, replay, summary):
    groups = replay["groups"]
    groups[0], groups[1] = groups[1], groups[0]


def edit_swap_groups_everywhere_renumbered(lines, replay, summary):
    groups = replay["groups"]
    groups[0], groups[1] = groups[1], groups[0]
    lines[0], lines[1] = lines[1], lines[0]
    for g, group in enumerate(groups):
        group["group_index"] = g
        for c in range(2):
            summary["rollouts"][g * 2 + c]["group_index"] = g


def edit_swap_candidates(lines, replay, summary):
    cands = replay["groups"][0]["candidates"]
    cands[0], cands[1] = cands[1], cands[0]
    cands[0]["candidate_index"], cands[1]["candidate_index"] = 0, 1


def edit_dataset_reward(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["reward"] = _bump(comp["reward"])


def edit_provenance_return(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["openenv"]["episode_return"] = _bump(comp["openenv"]["episode_return"])


def edit_replay_return(lines, replay, summary):
    _, cand, _ = _g0c0(lines, replay, summary)
    cand["episode_return"] = _bump(cand["episode_return"])


def edit_record_return(lines, replay, summary):
    _, _, record = _g0c0(lines, replay, summary)
    record["episode_return"] = _bump(record["episode_return"])


def edit_all_returns_consistently(lines, replay, summary):
    comp, cand, record = _g0c0(lines, replay, summary)
    for doc in (comp, comp["openenv"], cand, record):
        key = "reward" if doc is comp else "episode_return"
        doc[key] = _bump(doc[key])


def edit_return_int_type(lines, replay, summary):
    comp, cand, record = _g0c0(lines, replay, summary)
    for doc, key in ((comp, "reward"), (comp["openenv"], "episode_return"), (cand, "episode_return"), (record, "episode_return")):
        doc[key] = int(doc[key])


def edit_observation_reward(lines, replay, summary):
    _, cand, _ = _g0c0(lines, replay, summary)
    cand["exchanges"][0]["result"]["observation"]["reward"] = 0.25


def edit_provenance_seed(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["openenv"]["seed"] += 1


def edit_replay_group_seed(lines, replay, summary):
    replay["groups"][0]["seed"] += 1


def edit_reset_payload_seed(lines, replay, summary):
    replay["groups"][0]["reset_payload"]["seed"] += 1


def edit_record_seed(lines, replay, summary):
    summary["rollouts"][0]["seed"] += 1


def edit_seed_start(lines, replay, summary):
    summary["seed_start"] += 1


def edit_reset_template(lines, replay, summary):
    replay["groups"][2]["reset_payload"]["difficulty"] = "hard"


def _digest_flip(digest: str) -> str:
    return digest[:-1] + ("0" if digest[-1] != "0" else "1")


def edit_reset_sha(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["openenv"]["reset_sha256"] = _digest_flip(comp["openenv"]["reset_sha256"])


def edit_action_schema_sha(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["openenv"]["action_schema_sha256"] = _digest_flip(comp["openenv"]["action_schema_sha256"])


def edit_env_schema_sha(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["openenv"]["environment_schema_sha256"] = _digest_flip(comp["openenv"]["environment_schema_sha256"])


def edit_discovery_sha(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["openenv"]["discovery_sha256"] = _digest_flip(comp["openenv"]["discovery_sha256"])


def edit_reset_plan_sha(lines, replay, summary):
    summary["reset_plan_sha256"] = _digest_flip(summary["reset_plan_sha256"])


def edit_inspection_schema_sha_everywhere(lines, replay, summary):
    for doc in (replay, summary):
        ident = doc["environments"][0]["identity"]
        ident["schema_sha256"] = _digest_flip(ident["schema_sha256"])


def edit_action(lines, replay, summary):
    _, cand, _ = _g0c0(lines, replay, summary)
    action = cand["exchanges"][0]["action"]
    action["amount"] = 1 if action["amount"] != 1 else 2


def edit_trajectory_observation(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["trajectory"][1]["content"] += " "


def edit_trajectory_action(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["trajectory"][0]["content"] = comp["trajectory"][0]["content"].replace("}", ", \"x\": 1}")


def edit_text(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    comp["text"] += "!"


def edit_messages(lines, replay, summary):
    lines[0]["messages"][0]["content"] = lines[0]["messages"][0]["content"].replace("counter", "Counter")


def edit_reset_observation(lines, replay, summary):
    replay["groups"][0]["reset_observation"]["observation"]["input_text"] += " "


def edit_termination(lines, replay, summary):
    _, cand, _ = _g0c0(lines, replay, summary)
    cand["termination"] = "max_steps" if cand["termination"] != "max_steps" else "done"


def edit_model_tokens(lines, replay, summary):
    _, cand, record = _g0c0(lines, replay, summary)
    cand["model_tokens"] += 1
    record["model_tokens"] += 1


def edit_capacity_retries(lines, replay, summary):
    """A legacy ``capacity_retries`` put into one candidate only (its record and stats lack it)."""
    _, cand, _ = _g0c0(lines, replay, summary)
    cand["capacity_retries"] = 1


def _legacy_capacity(lines, replay, summary):
    """The bundle as written before capacity refusals left the artifacts: every candidate and
    record carries ``capacity_retries`` and the stats their sum."""
    for g, group in enumerate(replay["groups"]):
        for c, cand in enumerate(group["candidates"]):
            cand["capacity_retries"] = g + c
            summary["rollouts"][g * 2 + c]["capacity_retries"] = g + c
    summary["stats"]["capacity_retry_count"] = sum(r["capacity_retries"] for r in summary["rollouts"])


def edit_token_ids(lines, replay, summary):
    comp, _, _ = _g0c0(lines, replay, summary)
    action = next(p for p in comp["tokens"]["pieces"] if p["kind"] == "action")
    action["ids"].pop()
    action["logprobs"].pop()


def edit_final_state_removed(lines, replay, summary):
    _, cand, _ = _g0c0(lines, replay, summary)
    del cand["final_state"]


def edit_behavior_policy(lines, replay, summary):
    summary["behavior_policy"]["runtime"]["device"] = "cuda"


def edit_stats(lines, replay, summary):
    summary["stats"]["done_count"] += 1


def edit_max_steps(lines, replay, summary):
    replay["max_steps"] += 1
    summary["max_steps"] += 1


def edit_penalty(lines, replay, summary):
    summary["protocol_error_reward"] = -2.0


def edit_drop_group(lines, replay, summary):
    lines.pop()
    replay["groups"].pop()
    summary["rollouts"] = summary["rollouts"][:-2]
    summary["groups"] -= 1
    summary["rollout_count"] -= 2


def edit_prompt_version(lines, replay, summary):
    summary["prompt_version"] = "kiln.openenv-prompt.v0"


EDITS: dict[str, tuple[Edit, str | None]] = {
    "swap_dataset_lines": (edit_swap_lines, None),
    "swap_replay_groups": (edit_swap_replay_groups, "group_index"),
    "swap_groups_everywhere_renumbered": (edit_swap_groups_everywhere_renumbered, None),
    "swap_candidates": (edit_swap_candidates, None),
    "dataset_reward": (edit_dataset_reward, "reward"),
    "provenance_return": (edit_provenance_return, "openenv.episode_return"),
    "replay_return": (edit_replay_return, "episode_return"),
    "record_return": (edit_record_return, "rollouts[].episode_return"),
    "all_returns_consistently": (edit_all_returns_consistently, "episode_return"),
    "return_int_type": (edit_return_int_type, "episode_return"),
    "observation_reward": (edit_observation_reward, "episode_return"),
    "provenance_seed": (edit_provenance_seed, "openenv.seed"),
    "replay_group_seed": (edit_replay_group_seed, "seed"),
    "reset_payload_seed": (edit_reset_payload_seed, "reset_payload.seed"),
    "record_seed": (edit_record_seed, "rollouts[].seed"),
    "seed_start": (edit_seed_start, "seed"),
    "reset_template": (edit_reset_template, "openenv.reset_sha256"),
    "reset_sha": (edit_reset_sha, "openenv.reset_sha256"),
    "action_schema_sha": (edit_action_schema_sha, "openenv.action_schema_sha256"),
    "environment_schema_sha": (edit_env_schema_sha, "openenv.environment_schema_sha256"),
    "discovery_sha": (edit_discovery_sha, "openenv.discovery_sha256"),
    "reset_plan_sha": (edit_reset_plan_sha, "reset_plan_sha256"),
    "inspection_schema_sha": (edit_inspection_schema_sha_everywhere, "environments[0].identity.schema_sha256"),
    "action": (edit_action, None),
    "trajectory_observation": (edit_trajectory_observation, "trajectory[1].content"),
    "trajectory_action": (edit_trajectory_action, "trajectory[0].content"),
    "text": (edit_text, "text"),
    "messages": (edit_messages, "messages"),
    "reset_observation": (edit_reset_observation, "messages"),
    "termination": (edit_termination, "termination"),
    "model_tokens": (edit_model_tokens, "model_tokens"),
    "capacity_retries": (edit_capacity_retries, "rollouts[].capacity_retries"),
    "token_ids": (edit_token_ids, "model_tokens"),
    "final_state_removed": (edit_final_state_removed, "final_state"),
    "behavior_policy": (edit_behavior_policy, "openenv.behavior_policy"),
    "stats": (edit_stats, "stats"),
    "max_steps": (edit_max_steps, None),
    "penalty": (edit_penalty, "protocol_error_reward"),
    "drop_group": (edit_drop_group, None),
    "prompt_version": (edit_prompt_version, "prompt_version"),
}


def test_resealed_bundle_without_edits_still_verifies(bundle: dict[str, bytes], tmp_path: Path) -> None:
    files = reseal(*parse(bundle))
    assert files == bundle  # reseal is exact, so the edits below are the only change
    verify_bundle(write_bundle(tmp_path, files))


def test_a_bundle_written_with_capacity_retries_still_verifies(bundle: dict[str, bytes], tmp_path: Path) -> None:
    lines, replay, summary = parse(bundle)
    assert "capacity_retry_count" not in summary["stats"]  # new bundles carry no capacity figure
    _legacy_capacity(lines, replay, summary)
    verify_bundle(write_bundle(tmp_path / "legacy", reseal(lines, replay, summary)))
    summary["stats"]["capacity_retry_count"] += 1  # the legacy sum is still bound to the records
    with pytest.raises(VerificationFailed) as info:
        verify_bundle(write_bundle(tmp_path / "edited", reseal(lines, replay, summary)))
    assert info.value.details["field"] == "stats"


@pytest.mark.parametrize("name", sorted(EDITS))
def test_resealed_semantic_edit_is_detected(name: str, bundle: dict[str, bytes], tmp_path: Path) -> None:
    """Edits with every digest and byte count recomputed: only semantic checks can catch them."""
    edit, field = EDITS[name]
    lines, replay, summary = parse(bundle)
    edit(lines, replay, summary)
    files = reseal(lines, replay, summary)
    assert files != bundle
    with pytest.raises(VerificationFailed) as info:
        verify_bundle(write_bundle(tmp_path, files))
    assert info.value.code == "openenv_verification_failed"
    assert info.value.details.get("field") != "structure", info.value.message
    if field is not None:
        assert info.value.details["field"] == field, info.value.message


def test_error_message_names_file_group_candidate_step_field(bundle: dict[str, bytes], tmp_path: Path) -> None:
    lines, replay, summary = parse(bundle)
    g, c = _first_with_exchange(replay)
    lines[g]["completions"][c]["trajectory"][1]["content"] += " "
    with pytest.raises(VerificationFailed) as info:
        verify_bundle(write_bundle(tmp_path, reseal(lines, replay, summary)))
    assert info.value.details == {
        "file": "dataset",
        "group_index": g,
        "candidate_index": c,
        "step_index": 0,
        "field": "trajectory[1].content",
    }
    assert info.value.message.startswith(f"dataset group {g} candidate {c} step 0 field trajectory[1].content:")
    assert info.value.to_dict()["code"] == "openenv_verification_failed"


def test_reward_type_in_replay_is_not_bound_offline(bundle: dict[str, bytes], tmp_path: Path) -> None:
    """Documented limit: with ``input_text`` observations the wire reward TYPE (1.0 vs 1) appears
    only in the replay, so offline verification passes; live replay catches it."""
    lines, replay, summary = parse(bundle)
    _, cand, _ = _g0c0(lines, replay, summary)
    obs = cand["exchanges"][0]["result"]["observation"]
    assert isinstance(obs["reward"], float)
    obs["reward"] = int(obs["reward"])
    verify_bundle(write_bundle(tmp_path, reseal(lines, replay, summary)))
