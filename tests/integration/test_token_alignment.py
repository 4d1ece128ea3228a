"""Token-in/token-out: what a collected rollout records is exactly what the policy saw and sampled.

For every action segment of real collected groups (counter env, tiny model): the recorded ids
decode to the recorded text, and one forward pass over the recorded ids (prefix = every earlier
piece, never a re-rendered conversation) reproduces the recorded behaviour log-probs within 1e-4.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kiln.openenv.discovery import inspect_environment
from kiln.policy.runtime import PolicyRuntime
from kiln.rollout.group import EpisodeSettings, GroupCollector, GroupTask


@pytest.fixture(scope="module")
def collected(tiny_model_dir: Path, counter_env_url: str) -> tuple[PolicyRuntime, list[dict[str, Any]]]:
    runtime = PolicyRuntime.load(tiny_model_dir)

    async def collect() -> list[dict[str, Any]]:
        inspection = await inspect_environment(counter_env_url)
        documents = []
        for group, thinking in ((0, True), (1, False)):
            task = GroupTask(
                group_index=group,
                environment_index=0,
                seed=500 + group,
                reset_payload={"seed": 500 + group},
                inspection=inspection,
                settings=EpisodeSettings(group_size=3, max_steps=4, max_action_tokens=48, thinking=thinking),
                behavior_policy=runtime.identity(),
            )
            documents.append(await GroupCollector(task, runtime).run())
        return documents

    return runtime, asyncio.run(collect())


def test_recorded_ids_decode_to_recorded_text_and_logprobs_match(collected: Any) -> None:
    runtime, documents = collected
    stop = runtime.stop_id
    checked = 0
    for document in documents:
        for completion in document["line"]["completions"]:
            pieces = completion["tokens"]["pieces"]
            actions = [seg for seg in completion["trajectory"] if seg["kind"] == "action"]
            action_pieces = [p for p in pieces if p["kind"] == "action"]
            assert len(actions) == len(action_pieces) >= 1
            prefix: list[int] = []
            index = 0
            for piece in pieces:
                if piece["kind"] == "action":
                    ids = piece["ids"]
                    text_ids = ids[:-1] if ids and ids[-1] == stop else ids
                    assert runtime.decode(text_ids) == actions[index]["content"]
                    recomputed = runtime.logprobs_of(prefix, ids, temperature=1.0)
                    assert len(recomputed) == len(piece["logprobs"]) == len(ids)
                    assert max(abs(a - b) for a, b in zip(recomputed, piece["logprobs"])) < 1e-4
                    index += 1
                    checked += 1
                prefix = prefix + piece["ids"]
    assert checked >= 6
