"""Property: any bundle Kiln's collector writes verifies, whatever the server's replies look like.

The REAL ``GroupCollector`` (``_episode_for``, ``_run_turns``, ``_apply``, ``_finish``,
``_document``) runs a scripted policy; only the WebSocket transport is replaced by an in-process
session that returns the drawn replies as the real session hands them over (parsed frame data, key
order as the server sent it). Replies cover every observation and error shape the hostile and
example servers and ``openenv`` emit — counter/taskbank/hostile observations, arbitrary JSON
observations, rewards null/bool/int/float, optional metadata; ``{"message", "code"}`` errors with
``errors`` (pydantic's nested order), ``active_sessions``/``max_sessions``, ``factory_name``,
recoverable, terminal and unknown codes, keys in any order — plus the three harness outcomes.
The real transport with server-ordered errors is covered end to end by
tests/integration/test_openenv_error_order.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.core.canonical import canonical_json
from kiln.core.contracts import reset_payload, reset_plan_sha256
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.openenv.replies import RECOVERABLE_CODES, TERMINAL_CODES, StepResult
from kiln.core.rollout.bundle import build_bundle
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from kiln.core.rollout.verify import verify_bundle
from tests.support.scripted_policy import ScriptedPolicy
from tests.unit.test_verify_support import spec_for, write_bundle

SEED = 21
MAX_STEPS = 4
GROUP_SIZE = 2
CODES = sorted(RECOVERABLE_CODES | TERMINAL_CODES) + ["RATE_LIMITED"]  # an unknown code too

_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_reward = st.none() | st.booleans() | st.integers(-10, 10) | st.floats(-1e6, 1e6, allow_nan=False)


@st.composite
def _ordered(draw: st.DrawFn, items: dict[str, Any]) -> dict[str, Any]:
    """``items`` with its keys in a drawn order (a server's own order)."""
    keys = draw(st.permutations(list(items)))
    return {key: items[key] for key in keys}


@st.composite
def observations(draw: st.DrawFn, *, done: bool | None = None) -> dict[str, Any]:
    shape = draw(st.sampled_from(["counter", "taskbank", "hostile", "any"]))
    if shape == "counter":
        body = {"metadata": {}, "count": draw(st.integers(0, 20)), "target": draw(st.integers(8, 12)),
                "input_text": draw(st.sampled_from(["", "   ", "Count is 3. Target is 9."]) | st.text(max_size=20))}
    elif shape == "taskbank":
        body = {"metadata": {}, "question": draw(st.text(max_size=20)), "input_text": draw(st.text(max_size=20))}
    elif shape == "hostile":
        body = {"metadata": {}, "count": draw(st.integers(0, 9)), "note": draw(st.text(max_size=8))}
    else:
        body = draw(st.dictionaries(st.text(max_size=6), _json, max_size=4))
    wire: dict[str, Any] = {
        "observation": draw(_ordered(body)),
        "reward": draw(_reward),
        "done": draw(st.booleans()) if done is None else done,
    }
    metadata = draw(st.sampled_from(["absent", "null", "object"]))
    if metadata != "absent":
        wire["metadata"] = None if metadata == "null" else draw(
            st.dictionaries(st.text(max_size=6), _json, max_size=3).map(lambda d: d or {"overshoot": True})
        )
    return draw(_ordered(wire))


@st.composite
def errors(draw: st.DrawFn) -> dict[str, Any]:
    data: dict[str, Any] = {"message": draw(st.text(max_size=30)), "code": draw(st.sampled_from(CODES))}
    extra = draw(st.sampled_from(["none", "errors", "capacity", "factory", "any"]))
    if extra == "errors":  # pydantic's e.errors() order, as openenv forwards it
        data["errors"] = [
            {"type": "amount_refused", "loc": ["amount"], "msg": draw(st.text(max_size=20)),
             "input": draw(_json), "ctx": {"amount": draw(st.integers(0, 9))}}
        ]
    elif extra == "capacity":
        data.update(active_sessions=draw(st.integers(0, 4)), max_sessions=draw(st.integers(1, 4)))
    elif extra == "factory":
        data["factory_name"] = draw(st.text(max_size=10))
    elif extra == "any":
        data.update(draw(st.dictionaries(st.text(max_size=6).filter(lambda k: k not in data), _json, max_size=2)))
    return draw(_ordered(data))


_HARNESS = ["not json", '{"amount": 9}', ""]  # invalid JSON, schema failure, empty answer
turns = st.one_of(
    observations().map(lambda wire: ("observation", wire)),
    errors().map(lambda data: ("protocol_error", data)),
    st.sampled_from(_HARNESS).map(lambda text: ("harness", text)),
)


class ReplySession:
    """Stands in for the WebSocket session: hands the drawn replies over in order."""

    def __init__(self, replies: list[StepResult], final_state: dict[str, Any]) -> None:
        self.replies = list(replies)
        self.final_state = final_state

    async def step(self, action: dict) -> StepResult:
        return self.replies.pop(0)

    async def state(self) -> dict[str, Any]:
        return self.final_state

    async def close(self) -> None:
        return None


def _action_text(turn: tuple[str, Any], thinking: bool) -> str:
    answer = turn[1] if turn[0] == "harness" else '{"amount": 1}'
    return ("plan</think>" if thinking else "") + answer


async def _collect(inspection: dict, scripts: list[list], reset_wire: dict, thinking: bool, budget: int,
                   final_state: dict) -> dict[str, bytes]:
    texts = {c: [_action_text(turn, thinking) for turn in script] for c, script in enumerate(scripts)}
    policy = ScriptedPolicy(texts, [SEED])
    settings_ = EpisodeSettings(group_size=GROUP_SIZE, max_steps=MAX_STEPS, max_action_tokens=64,
                                thinking=thinking, max_recoverable_errors=budget, concurrency=GROUP_SIZE)
    task = GroupTask(group_index=0, environment_index=0, seed=SEED, reset_payload=reset_payload({}, SEED),
                     inspection=inspection, settings=settings_, behavior_policy=policy.identity())
    collector = GroupCollector(task, policy)
    sessions = {}
    for c, script in enumerate(scripts):
        replies = [
            StepResult(kind="observation", observation=value) if kind == "observation"
            else StepResult(kind="protocol_error", error=value)
            for kind, value in script if kind != "harness"
        ]
        sessions[c] = ReplySession(replies, final_state)
    reset = StepResult(kind="observation", observation=reset_wire)
    episodes = [collector._episode_for(c, (c, sessions[c], reset, 0)) for c in range(GROUP_SIZE)]
    collector.episodes.extend(episodes)
    await collector._run_turns(episodes, sessions)
    for ep in episodes:
        await collector._finish(ep, sessions[ep.candidate_index])
    document = json.loads(canonical_json(collector._document()))  # as the store hands it on
    return build_bundle(
        [document],
        spec=spec_for(settings_, seed_start=SEED),
        inspections=[inspection],
        behavior_policy=policy.identity(),
        reset_plan_sha256=reset_plan_sha256([{}]),
    )


@pytest.fixture(scope="module")
def inspection() -> Iterator[dict]:
    from tests.support.servers import serve_example_env

    with serve_example_env("counter") as url:
        yield json.loads(canonical_json(asyncio.run(inspect_environment(url))))


@pytest.mark.timeout(240)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(
    scripts=st.lists(st.lists(turns, min_size=MAX_STEPS, max_size=MAX_STEPS), min_size=GROUP_SIZE, max_size=GROUP_SIZE),
    reset_wire=observations(done=False),
    thinking=st.booleans(),
    budget=st.integers(0, 3),
    final_state=st.dictionaries(st.text(max_size=6), _json, max_size=3),
)
def test_any_bundle_the_collector_writes_verifies(
    inspection: dict, tmp_path_factory: pytest.TempPathFactory, scripts: list, reset_wire: dict,
    thinking: bool, budget: int, final_state: dict,
) -> None:
    files = asyncio.run(_collect(inspection, scripts, reset_wire, thinking, budget, final_state))
    folder = tmp_path_factory.mktemp("bundle")
    report = verify_bundle(write_bundle(Path(folder), files))
    replay = json.loads(files["replay.json"])
    consumed = [len(c["exchanges"]) for c in replay["groups"][0]["candidates"]]
    assert report["environment_exchanges"] == sum(consumed)
    for script, count in zip(scripts, consumed):  # the collector stopped where the rules say
        harness_at = next((i for i, (kind, _v) in enumerate(script) if kind == "harness"), MAX_STEPS)
        assert count <= harness_at
