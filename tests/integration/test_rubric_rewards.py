"""Delayed rubric rewards (OpenEnv RFC 004) map to the episode's return as the protocol delivers them.

A rubric sets each step observation's ``reward`` on the server; a trajectory rubric answers its
``intermediate_reward`` until ``done`` and its trajectory score on the ``done`` step. Kiln's return
is the sum of the rewards on the wire, so the delayed score counts once, on the last step; an
episode cut at ``max_steps`` before ``done`` never receives it. The server is a real ``openenv``
server with an ``ExponentialDiscountingTrajectoryRubric`` (``tests.support.rubric_server``); the
expected returns are worked out here from the rubric's rule, not read back from Kiln.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator

import pytest

from kiln.core.canonical import canonical_json
from kiln.core.contracts import reset_payload, reset_plan_sha256
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.rollout.bundle import build_bundle
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from kiln.core.rollout.replay_live import replay_bundle
from kiln.core.rollout.verify import verify_bundle
from tests.support.rubric_server import INTERMEDIATE_REWARD, MISS_SCORE
from tests.support.scripted_policy import ScriptedPolicy
from tests.support.servers import serve_module
from tests.unit.test_verify_support import parse, spec_for, write_bundle

pytestmark = pytest.mark.timeout(120)

SEED = 11
SCRIPTS = {
    0: ['</think>{"amount": 2}', '</think>{"amount": 3}', '</think>{"amount": 5}'],  # reaches 10
    1: ['</think>{"amount": 1}', '</think>{"amount": 1}', '</think>{"amount": 1}'],  # ends at 3
}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_module("tests.support.rubric_server") as base_url:
        yield base_url


async def _bundle(url: str, max_steps: int) -> dict[str, bytes]:
    inspection = json.loads(canonical_json(await inspect_environment(url)))
    policy = ScriptedPolicy(SCRIPTS, [SEED])
    settings = EpisodeSettings(group_size=2, max_steps=max_steps, max_action_tokens=64)
    task = GroupTask(
        group_index=0, environment_index=0, seed=SEED, reset_payload=reset_payload({}, SEED),
        inspection=inspection, settings=settings, behavior_policy=policy.identity(),
    )
    document = json.loads(canonical_json(await GroupCollector(task, policy).run()))
    return build_bundle(
        [document], spec=spec_for(settings, seed_start=SEED), inspections=[inspection],
        behavior_policy=policy.identity(), reset_plan_sha256=reset_plan_sha256([{}]),
    )


def test_the_delayed_score_counts_once_on_the_done_step(url: str, tmp_path: Path) -> None:
    files = asyncio.run(_bundle(url, max_steps=3))
    lines, replay, summary = parse(files)
    wire = [[e["result"]["observation"]["reward"] for e in c["exchanges"]] for c in replay["groups"][0]["candidates"]]
    assert wire == [[INTERMEDIATE_REWARD, INTERMEDIATE_REWARD, 1.0], [INTERMEDIATE_REWARD, INTERMEDIATE_REWARD, MISS_SCORE]]
    expected = [2 * INTERMEDIATE_REWARD + 1.0, 2 * INTERMEDIATE_REWARD + MISS_SCORE]  # 0.75, 0.0
    assert [r["episode_return"] for r in summary["rollouts"]] == expected
    assert [c["reward"] for c in lines[0]["completions"]] == expected  # what training reads
    assert [r["termination"] for r in summary["rollouts"]] == ["done", "done"]
    summary_path = write_bundle(tmp_path, files)
    verify_bundle(summary_path)
    report = asyncio.run(replay_bundle(summary_path, concurrency=2))  # the rubric resets per episode
    assert report["rollouts"] == 2


def test_an_episode_cut_before_done_never_gets_the_delayed_score(url: str) -> None:
    _, _, summary = parse(asyncio.run(_bundle(url, max_steps=2)))
    assert [r["termination"] for r in summary["rollouts"]] == ["max_steps", "max_steps"]
    assert [r["episode_return"] for r in summary["rollouts"]] == [2 * INTERMEDIATE_REWARD] * 2
