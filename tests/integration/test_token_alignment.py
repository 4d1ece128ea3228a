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

from kiln.core.openenv.discovery import inspect_environment
from kiln.core.policy.runtime import PolicyRuntime
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask


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


FAMILY_RUNS = [
    # (family, thinking, constrained): qwen3 with <think> (free reasoning, budget-stopped or
    # closed), and every family without thinking under the action grammar (multi-turn episodes).
    ("qwen3", True, False),
    ("qwen3", False, True),
    ("llama3", False, True),
    ("gemma", False, True),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, thinking, constrained", FAMILY_RUNS)
def test_template_families_roll_out_with_aligned_tokens(
    family: str, thinking: bool, constrained: bool, counter_env_url: str, tmp_path_factory
) -> None:
    from kiln.core.openenv.schema import policy_action_schema
    from tests.support.models import shared_family_model

    runtime = PolicyRuntime.load(shared_family_model(family, tmp_path_factory), device="cpu")
    assert runtime.resolve_thinking("auto") is (family == "qwen3")

    async def collect() -> tuple[dict[str, Any], dict[str, Any]]:
        inspection = await inspect_environment(counter_env_url)
        settings = EpisodeSettings(
            group_size=2, max_steps=3, max_action_tokens=24, thinking=thinking,
            thinking_budget_tokens=12 if thinking else None, constrained_actions=constrained,
        )
        task = GroupTask(
            group_index=0, environment_index=0, seed=700, reset_payload={"seed": 700},
            inspection=inspection, settings=settings, behavior_policy=runtime.identity(),
        )
        return inspection, await GroupCollector(task, runtime).run()

    inspection, document = asyncio.run(collect())
    schema = policy_action_schema(inspection["schema"]["action"]) if constrained else None
    checked = exchanged = 0
    for completion in document["line"]["completions"]:
        pieces = completion["tokens"]["pieces"]
        actions = [seg for seg in completion["trajectory"] if seg["kind"] == "action"]
        prefix: list[int] = []
        index = 0
        for piece in pieces:
            if piece["kind"] == "action":
                ids = piece["ids"]
                text_ids = ids[:-1] if ids and ids[-1] == runtime.stop_id else ids
                assert runtime.decode(text_ids) == actions[index]["content"]
                extra = {"action_schema": schema, "thinking": thinking} if schema is not None else {}
                recomputed = runtime.logprobs_of(prefix, ids, temperature=1.0, **extra)
                assert len(recomputed) == len(piece["logprobs"]) == len(ids)
                assert max(abs(a - b) for a, b in zip(recomputed, piece["logprobs"])) < 1e-4
                index += 1
                checked += 1
            prefix = prefix + piece["ids"]
        exchanged += completion["openenv"]["steps"]
    assert checked >= 2
    if constrained:
        # Schema-valid actions reach the environment: episodes span several turns.
        assert exchanged >= 3
        first = runtime.decode(document["line"]["completions"][0]["tokens"]["pieces"][0]["ids"])
        assert first.endswith(runtime.glue.generation_prompt[False])
