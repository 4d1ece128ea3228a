"""Episodes stay inside the served model's context (issue 41).

A real ``openenv`` server whose observations grow each step (``tests.support.growing_server``),
the tiny model rebuilt with a small ``max_position_embeddings``: episodes end with
``CONTEXT_EXHAUSTED``, no recorded (trainable) id lies past the context, the bundle verifies,
training selection leaves them out (``context_policy: end``) or keeps them penalised
(``end_penalised``), and the run's status warns in words naming ``--max-steps``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kiln.core.canonical import canonical_json
from kiln.core.contracts import reset_payload, reset_plan_sha256
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.rollout.bundle import build_bundle
from kiln.core.rollout.context import served_context
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from kiln.core.rollout.verify import verify_bundle
from kiln.core.run_status import RunStatus
from kiln.core.train.selection import select_groups
from tests.support.servers import serve_module
from tests.unit.test_verify_support import parse, reseal, spec_for, write_bundle

MAX_ACTION = 48
GROUPS = 2
GROUP_SIZE = 2


@pytest.fixture(scope="module")
def growing_url() -> Any:
    with serve_module("tests.support.growing_server", "--max-concurrent-envs", "4") as url:
        yield url


def _small_context_model(tiny_model_dir: Path, folder: Path, limit: int) -> Path:
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = limit
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _prompt_tokens(tiny_model_dir: Path, url: str) -> int:
    """The first prompt's length for this server (one real step with the unchanged tiny model)."""
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(tiny_model_dir)

    async def run() -> dict:
        inspection = await inspect_environment(url)
        settings = EpisodeSettings(group_size=1, max_steps=1, max_action_tokens=MAX_ACTION, thinking=True)
        task = GroupTask(group_index=0, environment_index=0, seed=300, reset_payload={"seed": 300},
                         inspection=inspection, settings=settings, behavior_policy=runtime.identity(None))
        return await GroupCollector(task, runtime).run()

    document = asyncio.run(run())
    return len(document["line"]["completions"][0]["tokens"]["pieces"][0]["ids"])


def _collect(model_dir: Path, url: str, policy: str) -> dict[str, bytes]:
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(model_dir)
    settings = EpisodeSettings(
        group_size=GROUP_SIZE, max_steps=6, max_action_tokens=MAX_ACTION, thinking=True, context_policy=policy,
    )

    async def run() -> dict[str, bytes]:
        inspection = json.loads(canonical_json(await inspect_environment(url)))
        behavior = {**runtime.identity(None), "adapter": None}
        documents = []
        for g in range(GROUPS):
            task = GroupTask(group_index=g, environment_index=0, seed=300 + g, reset_payload=reset_payload({}, 300 + g),
                             inspection=inspection, settings=settings, behavior_policy=behavior)
            documents.append(json.loads(canonical_json(await GroupCollector(task, runtime).run())))
        return build_bundle(documents, spec=spec_for(settings, seed_start=300), inspections=[inspection],
                            behavior_policy=behavior, reset_plan_sha256=reset_plan_sha256([{}]))

    assert served_context(runtime) == runtime.model.config.max_position_embeddings
    return asyncio.run(run())


@pytest.fixture(scope="module")
def small_model(tiny_model_dir: Path, growing_url: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The tiny model with a context that fits the prompt, two actions and the first short turns,
    never step 2's 120-word log."""
    prompt = _prompt_tokens(tiny_model_dir, growing_url)
    limit = prompt + 3 * MAX_ACTION + 80
    return _small_context_model(tiny_model_dir, tmp_path_factory.mktemp("ctx") / "model", limit), limit


@pytest.fixture(scope="module")
def bundles(small_model: tuple[Path, int], growing_url: str) -> dict[str, Any]:
    model, limit = small_model
    return {"limit": limit, "end": _collect(model, growing_url, "end"),
            "end_penalised": _collect(model, growing_url, "end_penalised")}


def _pieces_total(completion: dict) -> int:
    return sum(len(p["ids"]) for p in completion["tokens"]["pieces"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_episodes_end_at_the_context_and_no_recorded_id_lies_past_it(bundles: dict, tmp_path: Path) -> None:
    limit = bundles["limit"]
    lines, replay, summary = parse(bundles["end"])
    assert summary["context_tokens"] == limit and summary["context_policy"] == "end"
    terminations = [r["termination"] for r in summary["rollouts"]]
    exhausted = terminations.count("context_exhausted")
    assert exhausted >= 1
    assert summary["stats"]["context_exhausted_count"] == exhausted
    assert summary["stats"]["context_tokens"] == limit
    for group, line in zip(replay["groups"], lines):
        assert group["context_tokens"] == limit
        for candidate, completion in zip(group["candidates"], line["completions"]):
            total = _pieces_total(completion)
            # every id the policy saw and every trainable id (actions, observations) is inside it
            assert total + MAX_ACTION <= limit, (total, limit)
            if candidate["termination"] == "context_exhausted":
                record = candidate["context"]
                assert record["code"] == "CONTEXT_EXHAUSTED" and record["limit_tokens"] == limit
                assert record["tokens"] == total
                assert total + record["omitted_turn_tokens"] + MAX_ACTION > limit
                assert completion["openenv"]["termination"] == "context_exhausted"
                assert completion["openenv"]["context_policy"] == "end"
                # the left-out turn is text in the trajectory, never ids in the pieces
                assert completion["trajectory"][-1]["kind"] == "observation"
                assert completion["tokens"]["pieces"][-1]["kind"] == "action"
    summary_path = write_bundle(tmp_path / "end", bundles["end"])
    report = verify_bundle(summary_path)
    assert report["rollouts"] == GROUPS * GROUP_SIZE
    # live replay sends every recorded exchange (the left-out turns' included) and matches
    from kiln.core.rollout.replay_live import replay_bundle

    replayed = asyncio.run(replay_bundle(summary_path, concurrency=2))
    assert replayed["environment_exchanges"] == report["environment_exchanges"]

    # training: end leaves every such episode out; end_penalised keeps them with the penalty
    _kept, selection = select_groups([dict(line) for line in lines])
    assert selection["context_exhausted_rollouts_excluded"] == exhausted
    p_lines, p_replay, p_summary = parse(bundles["end_penalised"])
    verify_bundle(write_bundle(tmp_path / "pen", bundles["end_penalised"]))
    _kept, p_selection = select_groups([dict(line) for line in p_lines])
    assert "context_exhausted_rollouts_excluded" not in p_selection
    for group in p_replay["groups"]:
        for candidate in group["candidates"]:
            if candidate["termination"] == "context_exhausted":
                steps = len(candidate["exchanges"])
                assert candidate["episode_return"] == float(steps) + p_summary["protocol_error_reward"]

    # status warns (most episodes hit the context), naming what the user can change
    status = RunStatus()
    status.record_publication(
        SimpleNamespace(manifest_uri="s3://x", manifest_sha256="0" * 64, artifacts=[], stats=summary["stats"]),
        promoted=False,
    )
    assert exhausted * 2 > len(terminations), terminations
    assert any("--max-steps" in w and f"{limit} tokens" in w and "CONTEXT_EXHAUSTED" in w for w in status.warnings)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verify_catches_context_tampering(bundles: dict, tmp_path: Path) -> None:
    lines, replay, summary = parse(bundles["end"])
    group = next(g for g in replay["groups"] if any(c["termination"] == "context_exhausted" for c in g["candidates"]))
    candidate = next(c for c in group["candidates"] if c["termination"] == "context_exhausted")
    candidate["context"]["tokens"] += 1
    from kiln.core.rollout.verify.checks import VerificationFailed

    with pytest.raises(VerificationFailed) as caught:
        verify_bundle(write_bundle(tmp_path / "a", reseal(lines, replay, summary)))
    assert "context.tokens" in caught.value.message
    # a larger recorded context than the one decisions were made at: nothing had to end
    lines, replay, summary = parse(bundles["end"])
    summary["context_tokens"] = summary["stats"]["context_tokens"] = bundles["limit"] * 4
    for g in replay["groups"]:
        g["context_tokens"] = bundles["limit"] * 4
        for c in g["candidates"]:
            if "context" in c:
                c["context"]["limit_tokens"] = bundles["limit"] * 4
    with pytest.raises(VerificationFailed) as caught:
        verify_bundle(write_bundle(tmp_path / "b", reseal(lines, replay, summary)))
    assert "nothing had to end" in caught.value.message


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.asyncio
async def test_a_run_warns_in_status_and_its_bundle_keeps_inside_the_context(
    kiln_settings: Any, small_model: tuple[Path, int], growing_url: str, tmp_path: Path
) -> None:
    """A real run (Temporal, SeaweedFS, workers) on the growing server: status counts the episodes
    that hit the context and warns; the published bundle verifies with no id past the context."""
    from api.runs import RunService
    from kiln.core.contracts import parse_run_request
    from tests.integration.test_real_shape_run import _fetch
    from tests.support.kiln_workers import running_workers
    from tests.support.waiting import workflow_result

    model, limit = small_model
    settings = kiln_settings(model_path=model)
    request = parse_run_request({"kind": "rollout", "environment_urls": [growing_url], "groups": 2, "group_size": 2, "seed_start": 300,
                                 "max_steps": 6, "max_action_tokens": MAX_ACTION, "thinking": True})
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(request)
        final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=500)
    assert final["state"] == "completed", final.get("failure")
    stats = final["rollout_stats"]
    assert stats["context_tokens"] == limit and stats["context_exhausted_count"] * 2 > stats["rollouts"] == 4
    warning = [w for w in final["warnings"] if "CONTEXT_EXHAUSTED" in w]
    assert len(warning) == 1 and f"{stats['context_exhausted_count']} of 4 episodes" in warning[0]
    assert "--max-steps" in warning[0]
    artifacts = {a["name"]: a for a in final["artifacts"]}
    files = {name: _fetch(settings, artifacts[name]["uri"]) for name in ("rollouts.jsonl", "replay.json", "summary.json")}
    assert verify_bundle(write_bundle(tmp_path / "run", files))["rollouts"] == 4
    for line in parse(files)[0]:
        for completion in line["completions"]:
            assert _pieces_total(completion) + MAX_ACTION <= limit
