"""Properties of public OpenEnv servers (issue 12), each on a server of our own built with the real
``openenv`` package (``tests.support.wild_servers``): a seed-ignoring reset, collected, replayed,
and through a whole train run's paired held-out gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.core.canonical import canonical_json
from kiln.core.contracts import reset_payload, reset_plan_sha256
from kiln.core.errors import CollectionFailed
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.rollout.bundle import build_bundle
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from kiln.core.rollout.replay_live import replay_bundle
from kiln.core.rollout.verify import verify_bundle
from tests.support.servers import free_port, serve_app_process
from tests.unit.test_verify_support import spec_for, write_bundle

pytestmark = pytest.mark.timeout(240)


@contextlib.contextmanager
def wild(name: str, port: int, sessions: int = 1) -> Iterator[str]:
    argv = [sys.executable, "-m", "tests.support.wild_servers", name, "--port", str(port),
            "--max-concurrent-envs", str(sessions)]
    with serve_app_process(argv, port=port) as url:
        yield url


async def _collect(url: str, runtime, settings: EpisodeSettings, *, groups: int = 1, seed_start: int = 11) -> dict[str, bytes]:
    inspection = json.loads(canonical_json(await inspect_environment(url)))
    behavior_policy = {**runtime.identity(None), "adapter": None}
    documents = []
    for g in range(groups):
        task = GroupTask(
            group_index=g, environment_index=0, seed=seed_start + g,
            reset_payload=reset_payload({}, seed_start + g), inspection=inspection,
            settings=settings, behavior_policy=behavior_policy,
        )
        documents.append(json.loads(canonical_json(await GroupCollector(task, runtime).run())))
    return build_bundle(documents, spec=spec_for(settings, seed_start=seed_start), inspections=[inspection],
                        behavior_policy=behavior_policy, reset_plan_sha256=reset_plan_sha256([{}]))


def test_seed_ignoring_reset_strict_names_fields_warn_proceeds(tiny_model_dir: Path, tmp_path: Path) -> None:
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(tiny_model_dir)
    port = free_port()
    strict = EpisodeSettings(group_size=2, max_steps=2, max_action_tokens=24)
    with wild("seed_ignoring", port) as url:
        with pytest.raises(CollectionFailed) as info:
            asyncio.run(_collect(url, runtime, strict))
        assert info.value.code == "collection_failed"
        assert info.value.details["fields"] == ["reset_observation.observation.side"]
        assert "reset_observation.observation.side" in info.value.message
        assert "reset_determinism" in info.value.hint

        warn = EpisodeSettings(group_size=2, max_steps=2, max_action_tokens=24, reset_determinism="warn")
        files = asyncio.run(_collect(url, runtime, warn))
    summary = json.loads(files["summary.json"])
    replay = json.loads(files["replay.json"])
    assert summary["reset_determinism"] == "warn" and summary["rollout_count"] == 2
    assert replay["groups"][0]["reset_nondeterministic_fields"] == ["reset_observation.observation.side"]
    own = replay["groups"][0]["candidates"][1]["reset_observation"]["observation"]["side"]
    assert own != replay["groups"][0]["reset_observation"]["observation"]["side"]
    summary_path = write_bundle(tmp_path, files)
    assert verify_bundle(summary_path)["rollouts"] == 2  # verify honours reset_determinism: warn

    with wild("seed_ignoring", port):
        report = asyncio.run(replay_bundle(summary_path, concurrency=2))
    fields = {item["field"] for item in report["excluded_fields"]}
    assert fields == {"reset_observation.observation.side", "final_state.side"}


def test_truncated_actions_get_their_own_code_and_count(tiny_model_dir: Path, counter_env_url: str, tmp_path: Path) -> None:
    """An answer cut at max_action_tokens is MODEL_ACTION_TRUNCATED (not INVALID_MODEL_ACTION),
    counted in the summary stats, and the bundle verifies."""
    from kiln.core.policy.runtime import PolicyRuntime
    from tests.unit.test_verify_support import _collect as collect_counter

    settings = EpisodeSettings(group_size=4, max_steps=2, max_action_tokens=3, thinking=False)
    files = asyncio.run(
        collect_counter(counter_env_url, PolicyRuntime.load(tiny_model_dir), groups=2, seed_start=3, settings=settings, template={})
    )
    summary = json.loads(files["summary.json"])
    codes = [r.get("harness_code") for r in summary["rollouts"]]
    assert codes.count("MODEL_ACTION_TRUNCATED") == summary["stats"]["truncated_action_count"] > 0
    assert "INVALID_MODEL_ACTION" not in codes  # a 3-token answer that fails to parse was cut, not wrong
    lines = [json.loads(line) for line in files["rollouts.jsonl"].splitlines()]
    message = next(
        json.loads(seg["content"])["openenv_harness_error"]["message"]
        for line in lines for c in line["completions"] if c["harness_code"] == "MODEL_ACTION_TRUNCATED"
        for seg in c["trajectory"][-1:]
    )
    assert message.startswith("the action was cut at max_action_tokens (3)")
    assert verify_bundle(write_bundle(tmp_path, files))["rollouts"] == 8


def test_mcp_tools_reach_the_prompt_and_the_identity(tiny_model_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kiln.cli.app import app
    from kiln.core.openenv.discovery import identity_differences
    from kiln.core.policy.runtime import PolicyRuntime

    port = free_port()
    base = ["--tool-variant"]
    with wild("mcp_tools", port, sessions=4) as url:
        first = asyncio.run(inspect_environment(url))
        settings = EpisodeSettings(group_size=2, max_steps=2, max_action_tokens=24, thinking=False)
        files = asyncio.run(_collect(url, PolicyRuntime.load(tiny_model_dir), settings))
        printed = CliRunner().invoke(app, ["openenv", "inspect", "--environment", url]).output
    tools = first["identity"]["tools"]
    assert [t["name"] for t in tools] == ["add", "total"]
    line = json.loads(files["rollouts.jsonl"].splitlines()[0])
    system = line["messages"][0]["content"]
    assert "Add an amount to the running total." in system and '"maximum":5' in system and '"name":"total"' in system
    assert json.loads(files["summary.json"])["prompt_version"] == "kiln.openenv-prompt.v3"
    assert verify_bundle(write_bundle(tmp_path, files))["rollouts"] == 2  # verify rebuilds the prompt with tools
    assert "tool add — Add an amount to the running total." in printed

    argv = [sys.executable, "-m", "tests.support.wild_servers", "mcp_tools", "--port", str(port), *base, "2"]
    with serve_app_process(argv, port=port) as url:
        second = asyncio.run(inspect_environment(url))
    assert second["identity"]["tools_sha256"] != first["identity"]["tools_sha256"]
    assert second["identity"]["discovery_sha256"] != first["identity"]["discovery_sha256"]
    assert "identity.tools" in identity_differences(first, second)


@pytest.mark.asyncio
async def test_warn_mode_goes_through_the_paired_gate(kiln_settings, tmp_path: Path) -> None:
    """A train run with reset_determinism: warn on a seed-ignoring server: the held-out groups pair
    by seed and reset payload (the two sides' resets differ in ``side``), the run completes, and
    the receipt lists each group's differing reset fields, and ``verify --run`` (function and CLI)
    recomputes that evidence offline. (Without warn, collection fails: the test above.)"""
    from typer.testing import CliRunner

    from api.runs import RunService
    from kiln.cli.app import app as cli_app
    from kiln.core.artifacts.store import S3Store
    from kiln.core.contracts import parse_run_request
    from kiln.core.evaluation.receipt import validate_receipt
    from kiln.core.rollout.verify.run import verify_run
    from tests.support.counter_loop import ONE_PASS_TRAINING
    from tests.support.kiln_workers import running_workers
    from tests.support.run_folders import artifact_bytes, download_run
    from tests.support.waiting import workflow_result

    settings = kiln_settings()
    with wild("seed_ignoring", free_port(), sessions=4) as url:
        request = parse_run_request({
            "kind": "train", "groups": 4, "group_size": 4, "max_steps": 3, "max_action_tokens": 32,
            "reset_determinism": "warn", "output_adapter": "seedless", "environment_urls": [url],
            "training_config": {**ONE_PASS_TRAINING, "echo": None},
            "environment_eval": {"groups": 4, "group_size": 1, "gate": None},
        })
        async with running_workers(settings) as client:
            status, _ = await RunService(client, settings).submit(request)
            final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=200)
    assert final["state"] == "completed", final.get("failure")
    # Every training group's candidates saw different sides: one status warning each, naming the
    # field (the held-out groups have one candidate each: nothing to differ within them).
    assert sorted(w for w in final["warnings"] if "candidates saw different resets" in w) == [
        f"group {g}: candidates saw different resets in reset_observation.observation.side (reset_determinism: warn)"
        for g in range(4)
    ]
    store = S3Store.from_settings(settings)
    manifest = json.loads(store.get_key(f"runs/{final['run_id']}/manifest.json"))
    entry = next(a for a in manifest["artifacts"] if a["name"] == "environment_eval/receipt.json")
    receipt = json.loads(artifact_bytes(store, entry))
    validate_receipt(receipt)
    assert receipt["evidence"]["paired_groups"] == 4
    differences = receipt["evidence"]["reset_differences"]
    assert [d["group_index"] for d in differences] == [0, 1, 2, 3]
    assert all(d["fields"] == ["reset_observation.observation.side"] for d in differences)
    # Offline, the whole run verifies, the receipt's evidence recomputed from its two sides.
    folder = download_run(store, final["run_id"], manifest, tmp_path / "run")
    report = verify_run(folder)
    assert report["evaluations"] == {"environment_eval/": {"decision": "diagnostic", "outcome": "diagnostic", "paired_groups": 4}}
    shown = CliRunner().invoke(cli_app, ["openenv", "verify", "--run", str(folder)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "environment_eval/  4 paired groups, diagnostic (diagnostic), evidence recomputed" in shown.output
    as_json = CliRunner().invoke(cli_app, ["openenv", "verify", "--run", str(folder), "--json"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["evaluations"] == report["evaluations"]


@pytest.mark.slow
def test_replay_ignore_leaves_out_a_wall_clock_step_field(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A step observation with a wall-clock ``metadata.execution_time``: replay drifts on it unless
    the run named it in ``replay_ignore``, which the summary records, so replay (told nothing)
    leaves it out and lists it."""
    from kiln.core.policy.runtime import PolicyRuntime
    from kiln.core.rollout.replay_live import ReplayDrift

    runtime = PolicyRuntime.load(tiny_model_dir)
    field = "result.observation.metadata.execution_time"
    plain = EpisodeSettings(group_size=2, max_steps=3, max_action_tokens=24)
    ignoring = EpisodeSettings(group_size=2, max_steps=3, max_action_tokens=24, replay_ignore=[field])
    with wild("clock_metadata", free_port(), sessions=2) as url:
        without = write_bundle(tmp_path / "plain", asyncio.run(_collect(url, runtime, plain)))
        with_ignore = write_bundle(tmp_path / "ignoring", asyncio.run(_collect(url, runtime, ignoring)))
        with pytest.raises(ReplayDrift) as info:
            asyncio.run(replay_bundle(without, concurrency=2))
        report = asyncio.run(replay_bundle(with_ignore, concurrency=2))
    assert info.value.details["field"] == field and info.value.details["step_index"] == 0
    assert json.loads(with_ignore.read_text())["replay_ignore"] == [field]
    assert "replay_ignore" not in json.loads(without.read_text())  # absent unless asked
    assert verify_bundle(with_ignore)["rollouts"] == 2
    assert report["rollouts"] == 2 and report["environment_exchanges"] >= 2
    assert {"environment_index": 0, "field": field, "reason": "recorded in the summary's replay_ignore"} in report["excluded_fields"]
