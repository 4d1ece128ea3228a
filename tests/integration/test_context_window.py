"""``context_policy: window`` (issue 41): a bounded window of turns, the dropped span recorded.

A real ``openenv`` server whose observations grow each step (``tests.support.growing_server``); the
tiny model rebuilt with a context that holds the prompt and the first two turns, never the third.
At the third turn the oldest turns leave the policy's view and the episode goes on
(``CONTEXT_WINDOWED``): what the policy sees from then on is one context piece plus what follows, so
no trained id lies past the context and every trained action was sampled from exactly the ids
before it in the bundle. The verifier replays the rule from the recorded turn sizes and catches
edits; live replay matches; stats and the status warning count such episodes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kiln.core.canonical import canonical_json
from kiln.core.contracts import reset_payload, reset_plan_sha256
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.rollout.bundle import build_bundle
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from kiln.core.rollout.replay_live import replay_bundle
from kiln.core.rollout.verify import verify_bundle
from kiln.core.rollout.verify.checks import VerificationFailed
from kiln.core.run_status import RunStatus
from kiln.core.train.selection import select_groups
from tests.support.scripted_policy import FixedActionPolicy
from tests.support.servers import serve_module
from tests.unit.test_verify_support import parse, reseal, spec_for, write_bundle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_ACTION = 32
SEED = 500
ACTION = '{"amount": 1}'


@pytest.fixture(scope="module")
def growing_url() -> Any:
    with serve_module("tests.support.growing_server", "--max-concurrent-envs", "4") as url:
        yield url


class ContextPolicy(FixedActionPolicy):
    """Always ``{"amount": 1}`` (ids are code points), served at a context of ``limit`` ids."""

    def __init__(self, limit: int | None) -> None:
        super().__init__(ACTION)
        self.limit = limit

    def context_tokens(self) -> int | None:
        return self.limit


def _collect(limit: int | None, url: str, policy: str, max_steps: int) -> dict[str, bytes]:
    runtime = ContextPolicy(limit)
    settings = EpisodeSettings(
        group_size=2, max_steps=max_steps, max_action_tokens=MAX_ACTION, thinking=False, context_policy=policy
    )

    async def run() -> dict[str, bytes]:
        inspection = json.loads(canonical_json(await inspect_environment(url)))
        behavior = runtime.identity(None)
        task = GroupTask(group_index=0, environment_index=0, seed=SEED, reset_payload=reset_payload({}, SEED),
                         inspection=inspection, settings=settings, behavior_policy=behavior)
        document = json.loads(canonical_json(await GroupCollector(task, runtime).run()))
        return build_bundle([document], spec=spec_for(settings, seed_start=SEED), inspections=[inspection],
                            behavior_policy=behavior, reset_plan_sha256=reset_plan_sha256([{}]))

    return asyncio.run(run())


def _turn_sizes(completion: dict) -> tuple[int, list[int]]:
    pieces = completion["tokens"]["pieces"]
    turns = [sum(len(p["ids"]) for p in pieces[i : i + 4]) for i in range(1, len(pieces) - 3, 4)]
    return len(pieces[0]["ids"]), turns


@pytest.fixture(scope="module")
def windowed(growing_url: str) -> dict[str, Any]:
    """Turn sizes from a run with no context limit, then a context that holds the prompt and the
    first two turns, never the third."""
    free = _collect(None, growing_url, "end", max_steps=3)
    sizes = [_turn_sizes(c) for c in parse(free)[0][0]["completions"]]
    assert all(len(turns) == 3 for _, turns in sizes), sizes
    prompt = sizes[0][0]
    limit = prompt + max(t[0] + t[1] for _, t in sizes) + MAX_ACTION + 8
    assert all(prompt + sum(t) + MAX_ACTION > limit for _, t in sizes)  # the third turn never fits
    return {"limit": limit, "files": _collect(limit, growing_url, "window", max_steps=3),
            "long": _collect(limit, growing_url, "window", max_steps=6)}


def _windowed_candidates(replay: dict) -> list[dict]:
    return [c for g in replay["groups"] for c in g["candidates"] if "window" in c.get("context", {})]


def test_a_window_keeps_the_episode_inside_the_context(windowed: dict[str, Any], tmp_path: Path) -> None:
    limit, files = windowed["limit"], windowed["files"]
    lines, replay, summary = parse(files)
    assert summary["context_policy"] == "window" and summary["context_tokens"] == limit
    slid = _windowed_candidates(replay)
    assert [(c["termination"], c["context"]["code"], c["context"]["window"]["slides"]) for c in slid] == [
        ("max_steps", "CONTEXT_WINDOWED", 1)
    ] * 2
    for candidate, completion in zip(replay["groups"][0]["candidates"], lines[0]["completions"]):
        pieces = completion["tokens"]["pieces"]
        total = sum(len(p["ids"]) for p in pieces)
        assert total + MAX_ACTION <= limit  # no trained (or seen) id past the context
        if "window" not in candidate.get("context", {}):
            continue
        record = candidate["context"]
        window = record["window"]
        turns = window["turn_tokens"]
        # the dropped span: the turns before kept_from_turn, no longer in the policy's view
        assert window["kept_from_turn"] >= 1 and window["slides"] >= 1
        assert window["dropped_tokens"] == sum(sum(t) for t in turns[: window["kept_from_turn"]])
        assert len(pieces[0]["ids"]) == window["prompt_tokens"] + sum(sum(t) for t in turns[window["kept_from_turn"] :])
        # brute force: with every turn in view, the slid turn would not have left room for an action
        assert window["prompt_tokens"] + sum(sum(t) for t in turns) + MAX_ACTION > limit
        assert record["tokens"] == total
        if candidate["termination"] != "context_exhausted":
            assert record["code"] == "CONTEXT_WINDOWED"
        # every exchange still happened and is in the trajectory and the replay
        assert len(completion["trajectory"]) >= 2 * len(candidate["exchanges"])
        assert candidate["model_tokens"] == sum(t[0] for t in turns) + sum(
            len(p["ids"]) for p in pieces if p["kind"] == "action"
        )
    windowed_records = [r for r in summary["rollouts"] if r.get("context_windowed")]
    assert len(windowed_records) == len(slid) == summary["stats"]["context_windowed_count"]

    summary_path = write_bundle(tmp_path, files)
    report = verify_bundle(summary_path)
    replayed = asyncio.run(replay_bundle(summary_path, concurrency=2))
    assert replayed["environment_exchanges"] == report["environment_exchanges"]

    # training keeps a windowed episode that went on (only its pieces are trained)
    _kept, selection = select_groups([dict(line) for line in lines])
    assert "context_exhausted_rollouts_excluded" not in selection

    status = RunStatus()
    status.record_publication(
        SimpleNamespace(manifest_uri="s3://x", manifest_sha256="0" * 64, artifacts=[], stats=summary["stats"]),
        promoted=False,
    )
    assert status.warnings == [
        f"2 of 2 episodes outgrew the model's context ({limit} tokens): 2 kept going with their earliest "
        "turns dropped (CONTEXT_WINDOWED), 0 ended (CONTEXT_EXHAUSTED); training sees only what the policy "
        "saw after the last drop. Lower --max-steps or --max-action-tokens, use an environment with shorter "
        "observations, or serve a model with a longer context (its config's max_position_embeddings)"
    ]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda w: w.update(kept_from_turn=w["kept_from_turn"] - 1), "context.window"),
        (lambda w: w.update(dropped_tokens=w["dropped_tokens"] + 1), "context.window.dropped_tokens"),
        (lambda w: w["turn_tokens"][0].__setitem__(1, 1), "context.window"),
        (lambda w: w.update(prompt_tokens=w["prompt_tokens"] + 1), "tokens.pieces[0]"),
    ],
    ids=["kept_from_turn", "dropped_tokens", "turn_tokens", "prompt_tokens"],
)
def test_verify_replays_the_window_rule(windowed: dict[str, Any], tmp_path: Path, edit: Any, field: str) -> None:
    lines, replay, summary = parse(windowed["files"])
    edit(_windowed_candidates(replay)[0]["context"]["window"])
    with pytest.raises(VerificationFailed) as caught:
        verify_bundle(write_bundle(tmp_path, reseal(lines, replay, summary)))
    assert caught.value.details["field"].startswith(field), caught.value.message


def test_a_window_is_refused_in_a_bundle_of_another_policy(windowed: dict[str, Any], tmp_path: Path) -> None:
    lines, replay, summary = parse(windowed["files"])
    summary["context_policy"] = "end"
    with pytest.raises(VerificationFailed) as caught:
        verify_bundle(write_bundle(tmp_path, reseal(lines, replay, summary)))
    assert caught.value.details["field"] == "context.window"


def test_a_long_episode_slides_again_and_ends_when_one_turn_outgrows_the_context(
    windowed: dict[str, Any], tmp_path: Path
) -> None:
    limit = windowed["limit"]
    lines, replay, summary = parse(windowed["long"])
    outcomes = [
        (c["termination"], c["context"]["code"], c["context"]["window"]["slides"], len(c["exchanges"]))
        for c in replay["groups"][0]["candidates"]
    ]
    # one slide at the third turn; the fourth turn does not fit even alone: the episode ends
    assert outcomes == [("context_exhausted", "CONTEXT_EXHAUSTED", 1, 4)] * 2
    for candidate in replay["groups"][0]["candidates"]:
        record = candidate["context"]
        assert record["omitted_turn_tokens"] > 0
        assert record["window"]["prompt_tokens"] + record["omitted_turn_tokens"] + MAX_ACTION > limit
    _kept, selection = select_groups([dict(line) for line in lines])
    assert selection["context_exhausted_rollouts_excluded"] == 2  # window leaves ended ones out, as end does
    for completion in lines[0]["completions"]:
        assert sum(len(p["ids"]) for p in completion["tokens"]["pieces"]) + MAX_ACTION <= limit
    verify_bundle(write_bundle(tmp_path, windowed["long"]))


@pytest.mark.asyncio
async def test_a_real_run_counts_windowed_episodes_in_status(
    kiln_settings: Any, tiny_model_dir: Path, growing_url: str, tmp_path: Path
) -> None:
    """A run (Temporal, SeaweedFS, workers) with ``context_policy: window`` and the tiny model
    (constrained actions, so every turn is a valid action) at a context that holds its first two turns, never the third: status counts the windowed episodes
    (``rollout_stats.context_windowed_count``) and the published bundle verifies."""
    from api.runs import RunService
    from kiln.core.contracts import parse_run_request
    from kiln.core.policy.runtime import PolicyRuntime
    from tests.integration.test_context_guard import _small_context_model
    from tests.integration.test_real_shape_run import _fetch
    from tests.support.kiln_workers import running_workers
    from tests.support.waiting import workflow_result

    runtime = PolicyRuntime.load(tiny_model_dir)
    settings_free = EpisodeSettings(
        group_size=2, max_steps=3, max_action_tokens=MAX_ACTION, thinking=False, constrained_actions=True
    )
    inspection = json.loads(canonical_json(await inspect_environment(growing_url)))
    task = GroupTask(group_index=0, environment_index=0, seed=SEED, reset_payload=reset_payload({}, SEED),
                     inspection=inspection, settings=settings_free, behavior_policy=runtime.identity(None))
    free = await GroupCollector(task, runtime).run()
    sizes = [_turn_sizes(c) for c in free["line"]["completions"]]
    assert all(len(turns) == 3 for _, turns in sizes), [r["termination"] for r in free["records"]]
    prompt = sizes[0][0]
    limit = prompt + max(t[0] + t[1] for _, t in sizes) + MAX_ACTION + 8
    model = _small_context_model(tiny_model_dir, tmp_path / "model", limit)
    settings = kiln_settings(model_path=model)
    request = parse_run_request({"kind": "rollout", "environment_urls": [growing_url], "groups": 1, "group_size": 2,
                                 "seed_start": SEED, "max_steps": 3, "max_action_tokens": MAX_ACTION,
                                 "thinking": False, "constrained_actions": True, "context_policy": "window"})
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(request)
        final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=400)
        summary_line = await _run_page_summary(settings, client, status.run_id)
    assert final["state"] == "completed", final.get("failure")
    stats = final["rollout_stats"]
    # the run page counts them too, in its summary line (a real Chromium over real HTTP)
    assert f"{stats['context_windowed_count']} episodes windowed to the context" in summary_line, summary_line
    artifacts = {a["name"]: a for a in final["artifacts"]}
    files = {name: _fetch(settings, artifacts[name]["uri"]) for name in ("rollouts.jsonl", "replay.json", "summary.json")}
    _lines, replay, summary = parse(files)
    assert stats["context_tokens"] == limit
    assert stats["context_windowed_count"] == len(_windowed_candidates(replay)) >= 1
    if stats["context_windowed_count"] + stats["context_exhausted_count"] > 1:
        assert any("CONTEXT_WINDOWED" in w for w in final["warnings"]), final["warnings"]
    assert summary["context_policy"] == "window"
    assert verify_bundle(write_bundle(tmp_path / "run", files))["rollouts"] == 2


async def _run_page_summary(settings: Any, client: Any, run_id: str) -> str:
    """The run page's summary line, read by a headless Chromium from the API served over HTTP."""
    import asyncio

    import uvicorn
    from playwright.async_api import async_playwright

    from api.app import create_app
    from tests.integration.test_run_page import CHROMIUM, CHROMIUM_ARGS
    from tests.support.servers import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings, client=client), host="127.0.0.1", port=port,
                                           log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page()
                await page.goto(f"http://127.0.0.1:{port}/runs/{run_id}")
                await page.wait_for_function("document.getElementById('state').textContent === 'completed'",
                                             timeout=60_000)
                return await page.text_content("#summary") or ""
            finally:
                await browser.close()
    finally:
        server.should_exit = True
        await serving
