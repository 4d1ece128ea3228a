"""Live replay finds every drift in one pass (issue 41), against a real ``openenv`` server with
three volatile fields at three depths and steps (``tests.support.volatile_server``).

One replay reports all three fields with their recorded and live values and a hint; ``--ignore``
with one wildcard passes (reported as a replay-time ignore, apart from the sealed ones); the same
wildcard given at collection (``replay_ignore``) passes sealed; a random-reset server's drift says
its reset is random.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kiln.core.rollout.group import EpisodeSettings
from kiln.core.rollout.replay_drift import ReplayDrift
from kiln.core.rollout.replay_live import replay_bundle
from tests.support.servers import serve_module
from tests.unit.test_verify_support import _collect, parse, write_bundle

NONCE = "result.observation.**.nonce"
FIELDS_BY_STEP = {
    0: "result.observation.observation.nonce",
    1: "result.observation.observation.stats.nonce",
    2: "result.observation.observation.trace.span.nonce",
}


def _nonce_at(exchange: dict) -> str:
    observation = exchange["result"]["observation"]["observation"]
    step = exchange["step_index"]
    value = observation["nonce"] if step == 0 else (
        observation["stats"]["nonce"] if step == 1 else observation["trace"]["span"]["nonce"])
    return json.dumps(value)


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path) -> Any:
    from kiln.core.policy.runtime import PolicyRuntime

    return PolicyRuntime.load(tiny_model_dir)


@pytest.fixture(scope="module")
def volatile_url() -> Any:
    with serve_module("tests.support.volatile_server", "--max-concurrent-envs", "4") as url:
        yield url


def _bundle(url: str, runtime: Any, folder: Path, *, group_size: int = 2, groups: int = 3,
            replay_ignore: list[str] | None = None) -> Path:
    settings = EpisodeSettings(group_size=group_size, max_steps=3, max_action_tokens=48,
                               replay_ignore=replay_ignore or [])
    files = asyncio.run(_collect(url, runtime, groups=groups, seed_start=40, settings=settings, template={}))
    return write_bundle(folder, files)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_replay_reports_all_three_fields_and_one_wildcard_passes(
    volatile_url: str, runtime: Any, tmp_path: Path
) -> None:
    summary = _bundle(volatile_url, runtime, tmp_path / "plain")
    _, replay, _ = parse({name: (summary.parent / name).read_bytes() for name in
                          ("rollouts.jsonl", "replay.json", "summary.json")})
    exchanges = [e for g in replay["groups"] for c in g["candidates"] for e in c["exchanges"]]
    expected_counts: dict[str, int] = {}
    for exchange in exchanges:
        field = FIELDS_BY_STEP[min(exchange["step_index"], 2)]
        expected_counts[field] = expected_counts.get(field, 0) + 1
    assert set(expected_counts) == set(FIELDS_BY_STEP.values()), "the tiny model's episodes reach step 2"

    with pytest.raises(ReplayDrift) as info:
        asyncio.run(replay_bundle(summary, concurrency=4))
    details = info.value.details
    assert {f["field"]: f["count"] for f in details["fields"]} == expected_counts
    assert details["drift_count"] == len(exchanges)
    first_candidate = next(c for g in replay["groups"] for c in g["candidates"] if c["exchanges"])
    first = details["drifts"][0]
    assert first["step_index"] == 0 and first["recorded"] == _nonce_at(first_candidate["exchanges"][0])
    for drift in details["drifts"]:
        assert drift["recorded"] != drift["live"] and len(drift["live"]) == 34  # a fresh uuid4 hex, quoted
    for field in FIELDS_BY_STEP.values():
        assert field in info.value.message and f"--ignore {field}" in info.value.hint

    report = asyncio.run(replay_bundle(summary, concurrency=4, ignore=[NONCE]))
    assert report["rollouts"] == 6
    assert report["replay_ignore"] == {"sealed": [], "replay_time": [NONCE]}
    assert {"environment_index": 0, "field": NONCE,
            "reason": "given to this replay (--ignore), not sealed in the bundle"} in report["excluded_fields"]

    # the CLI: --ignore reaches the replay, --json prints the report
    from kiln.cli import app as cli

    result = CliRunner().invoke(cli.app, ["openenv", "replay", "--summary", str(summary), "--ignore", NONCE, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["replay_ignore"]["replay_time"] == [NONCE]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_same_wildcard_sealed_at_collection_passes(volatile_url: str, runtime: Any, tmp_path: Path) -> None:
    summary = _bundle(volatile_url, runtime, tmp_path / "sealed", groups=1, replay_ignore=[NONCE])
    assert json.loads(summary.read_text())["replay_ignore"] == [NONCE]
    report = asyncio.run(replay_bundle(summary, concurrency=2))
    assert report["replay_ignore"] == {"sealed": [NONCE], "replay_time": []}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_random_reset_drift_says_the_reset_is_random(runtime: Any, tmp_path: Path) -> None:
    with serve_module("tests.support.volatile_server", "--max-concurrent-envs", "2", "--random-reset") as url:
        summary = _bundle(url, runtime, tmp_path / "random", group_size=1, groups=1)
        with pytest.raises(ReplayDrift) as info:
            asyncio.run(replay_bundle(summary, concurrency=1, ignore=[NONCE]))
    assert info.value.details["field"] == "reset_observation.observation.draw"
    assert "its reset is random rather than seeded" in info.value.hint
    assert "environment 0 answers two resets with the same payload differently" in info.value.hint


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_train_runs_bundle_replays_after_the_fact(
    kiln_settings: Any, volatile_url: str, tmp_path: Path
) -> None:
    """A train run (Temporal, SeaweedFS, workers) on the volatile server sealed no ignore: its
    published bundle drifts in the nonces, and replays after the fact with one --ignore wildcard."""
    from api.runs import RunService
    from kiln.core.contracts import parse_run_request
    from tests.integration.test_real_shape_run import _fetch
    from tests.support.kiln_workers import running_workers
    from tests.support.waiting import workflow_result

    settings = kiln_settings()
    request = parse_run_request({
        "kind": "train", "environment_urls": [volatile_url], "groups": 2, "group_size": 2, "max_steps": 3,
        "max_action_tokens": 48, "output_adapter": "volatile-a", "allow_empty_training": True,
        "training_config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8},
    })
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(request)
        final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=500)
    assert final["state"] == "completed", final.get("failure")
    artifacts = {a["name"]: a for a in final["artifacts"]}
    files = {name: _fetch(settings, artifacts[name]["uri"]) for name in ("rollouts.jsonl", "replay.json", "summary.json")}
    summary = write_bundle(tmp_path / "train", files)
    assert "replay_ignore" not in json.loads(files["summary.json"])
    with pytest.raises(ReplayDrift) as info:
        await replay_bundle(summary, concurrency=2)
    assert {f["field"] for f in info.value.details["fields"]} <= set(FIELDS_BY_STEP.values())
    report = await replay_bundle(summary, concurrency=2, ignore=[NONCE])
    assert report["rollouts"] == 4 and report["replay_ignore"]["replay_time"] == [NONCE]
