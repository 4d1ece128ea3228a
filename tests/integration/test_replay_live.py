"""Live replay of REAL bundles against the counter env: pass, step drift, identity drift.

The bundle's identity includes the environment's base URL, so every server here runs on the SAME
loopback port: collect, stop, then start the (possibly drifting) server again on that port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Iterator

import pytest

from kiln.core.errors import EnvironmentIdentityChanged
from kiln.core.rollout.replay_live import REPLAY_RUN_SCHEMA, ReplayDrift, replay_bundle
from kiln.core.rollout.verify import VerificationFailed, verify_bundle
from tests.support.servers import example_env_argv, free_port, serve_app_process
from tests.unit.test_verify_support import collect_bundle, parse, reseal, write_bundle


@contextlib.contextmanager
def counter_on(port: int, **options: object) -> Iterator[str]:
    with serve_app_process(example_env_argv("counter", port, **options), port=port) as url:
        yield url


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def bundle(port: int, tiny_model_dir: Path) -> dict[str, bytes]:
    with counter_on(port) as url:
        return collect_bundle(url, tiny_model_dir, groups=2, group_size=2, max_steps=3, seed_start=40)


@pytest.fixture(scope="module")
def scripted(port: int) -> dict[str, bytes]:
    from tests.unit.test_verify_vectors import _scripted_bundle

    with counter_on(port) as url:
        return asyncio.run(_scripted_bundle(url))


def _replay(summary: Path, **kwargs: object) -> dict:
    return asyncio.run(replay_bundle(summary, **kwargs))


def test_replay_passes_against_the_same_environment(bundle: dict[str, bytes], port: int, tmp_path: Path) -> None:
    summary_path = write_bundle(tmp_path, bundle)
    offline = verify_bundle(summary_path)
    with counter_on(port):
        report = _replay(summary_path, concurrency=3)
    assert report == {
        "schema": REPLAY_RUN_SCHEMA,
        "replay_sha256": offline["replay_sha256"],
        "environments": 1,
        "groups": 2,
        "rollouts": 4,
        "environment_exchanges": offline["environment_exchanges"],
        "environment_capacity": {f"http://127.0.0.1:{port}": {"refusals": 0}},
        "environment_prefix_only_rollouts": sum(
            r["termination"] == "invalid_model_action" for r in json.loads(bundle["summary.json"])["rollouts"]
        ),
        "excluded_fields": [],  # the counter's episode_id is seed-derived: nothing excluded
        "replay_ignore": {"sealed": [], "replay_time": []},
    }
    assert report["environment_exchanges"] >= 4


def test_invalid_tails_replay_only_their_environment_prefix(scripted: dict[str, bytes], port: int, tmp_path: Path) -> None:
    with counter_on(port):
        report = _replay(write_bundle(tmp_path, scripted), concurrency=4)
    assert (report["rollouts"], report["environment_exchanges"], report["environment_prefix_only_rollouts"]) == (4, 4, 3)


def test_capacity_one_server_is_replayed_with_capacity_refusals(bundle: dict[str, bytes], port: int, tmp_path: Path) -> None:
    with counter_on(port, max_concurrent_envs=1):
        report = _replay(write_bundle(tmp_path, bundle), concurrency=4)
    assert report["rollouts"] == 4  # every candidate got its own session in turn
    assert sum(f["refusals"] for f in report["environment_capacity"].values()) > 0


def _first_candidate_with(replay: dict, exchanges: int) -> tuple[int, int]:
    for group in replay["groups"]:
        for cand in group["candidates"]:
            if len(cand["exchanges"]) >= exchanges:
                return group["group_index"], cand["candidate_index"]
    raise AssertionError(f"no candidate with {exchanges} exchanges")


def test_step_drift_is_reported_at_its_exact_location(bundle: dict[str, bytes], port: int, tmp_path: Path) -> None:
    _, replay, _ = parse(bundle)
    group, candidate = _first_candidate_with(replay, 2)
    with counter_on(port, drift_step=1):
        with pytest.raises(ReplayDrift) as info:
            _replay(write_bundle(tmp_path, bundle), concurrency=4)
    assert info.value.code == "openenv_replay_drift"
    details = info.value.details
    assert {k: details[k] for k in ("group_index", "candidate_index", "step_index", "field")} == {
        "group_index": group,
        "candidate_index": candidate,
        "step_index": 1,
        "field": "result.observation.reward",
    }
    # every candidate with a step 1 drifted there (all replayed in one pass), live reward 0.5
    with_step_1 = sum(len(c["exchanges"]) >= 2 for g in replay["groups"] for c in g["candidates"])
    assert details["fields"] == [{"field": "result.observation.reward", "count": with_step_1}]
    assert details["drifts"][0]["live"] == "0.5" and details["drifts"][0]["recorded"] in ("0.0", "1.0")
    assert f"first at group {group} candidate {candidate} step 1" in info.value.message


def test_reward_type_tampering_passes_offline_but_not_live(bundle: dict[str, bytes], port: int, tmp_path: Path) -> None:
    lines, replay, summary = parse(bundle)
    group, candidate = _first_candidate_with(replay, 1)
    observation = replay["groups"][group]["candidates"][candidate]["exchanges"][0]["result"]["observation"]
    assert isinstance(observation["reward"], float)
    observation["reward"] = int(observation["reward"])  # 1.0 -> 1: same training value
    summary_path = write_bundle(tmp_path, reseal(lines, replay, summary))
    verify_bundle(summary_path)
    with counter_on(port):
        with pytest.raises(ReplayDrift) as info:
            _replay(summary_path)
    assert {k: info.value.details[k] for k in ("group_index", "candidate_index", "step_index", "field")} == {
        "group_index": group, "candidate_index": candidate, "step_index": 0, "field": "result.observation.reward",
    }
    assert info.value.details["drifts"][0]["recorded"] == "1" and info.value.details["drifts"][0]["live"] == "1.0"


def test_identity_drift_names_the_changed_fields(bundle: dict[str, bytes], port: int, tmp_path: Path) -> None:
    with counter_on(port, schema_variant=2):
        with pytest.raises(EnvironmentIdentityChanged) as info:
            _replay(write_bundle(tmp_path, bundle))
    assert info.value.details["changed_fields"] == [
        "identity.schema_sha256", "identity.discovery_sha256", "schema.action",
    ]
    assert info.value.details["environment_index"] == 0


def test_replay_verifies_offline_first(bundle: dict[str, bytes], tmp_path: Path) -> None:
    broken = bytearray(bundle["replay.json"])
    broken[10] ^= 0x01
    summary_path = write_bundle(tmp_path, {**bundle, "replay.json": bytes(broken)})
    with pytest.raises(VerificationFailed):  # no server is running: nothing was contacted
        _replay(summary_path)


def _cli():
    import typer

    from kiln.cli.verify_cmds import register

    app = typer.Typer(no_args_is_help=True)
    register(app)
    return app


def test_replay_cli_json_and_failure_exit_code(bundle: dict[str, bytes], port: int, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    summary_path = write_bundle(tmp_path / "ok", bundle)
    with counter_on(port):
        result = CliRunner().invoke(_cli(), ["replay", "--summary", str(summary_path), "--concurrency", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rollouts"] == 4
    broken = write_bundle(tmp_path / "broken", {**bundle, "summary.json": bundle["summary.json"] + b" "})
    result = CliRunner().invoke(_cli(), ["replay", "--summary", str(broken)])
    assert result.exit_code == 2
    assert "openenv_verification_failed" in result.stderr


def test_random_episode_id_is_excluded_and_listed(tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A 1-session server with a fresh uuid episode_id per reset: replay passes, and says what it
    did not compare; its capacity refusals are counted, not logged as poisoned sessions."""
    wild_port = free_port()
    argv = [sys.executable, "-m", "tests.support.wild_servers", "uuid_episode", "--port", str(wild_port)]
    with serve_app_process(argv, port=wild_port) as url:
        files = collect_bundle(url, tiny_model_dir, groups=1, group_size=2, max_steps=2, seed_start=7)
    summary = write_bundle(tmp_path, files)
    _, replay, _ = parse(files)
    ids = {c["final_state"]["episode_id"] for g in replay["groups"] for c in g["candidates"] if "final_state" in c}
    assert len(ids) == 2  # the recording itself holds two different uuids for one seed
    caplog.set_level(logging.DEBUG)
    with serve_app_process(argv, port=wild_port):
        report = _replay(summary, concurrency=4)
    assert report["rollouts"] == 2
    assert report["excluded_fields"] == [
        {"environment_index": 0, "field": "final_state.episode_id", "reason": "differs between two resets with the same payload"}
    ]
    assert sum(f["refusals"] for f in report["environment_capacity"].values()) > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "poisoned" in r.getMessage()]
