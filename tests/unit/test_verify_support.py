"""Helpers for the verify/replay tests: collect a REAL bundle without Temporal, reseal edits.

``collect_bundle`` runs :class:`kiln.core.rollout.group.GroupCollector` with the tiny model against a
live counter environment and builds the three files with :func:`kiln.core.rollout.bundle.build_bundle`,
mirroring production: the inspection and every group document travel through canonical JSON (the
store does that in a run). ``reseal`` re-serialises edited documents and recomputes every digest
and byte count that binds them, so an edit is only caught by the verifier's semantic checks.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

from kiln.core.canonical import canonical_json, pretty_json, sha256_bytes
from kiln.core.contracts import reset_payload, reset_plan_sha256
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.rollout.bundle import build_bundle
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from kiln.core.run_plan import BundleSpec

FILES = ("rollouts.jsonl", "replay.json", "summary.json")


def spec_for(settings: EpisodeSettings, *, seed_start: int) -> BundleSpec:
    """The bundle spec of a base-model rollout with these settings."""
    return BundleSpec(adapter=None, seed_start=seed_start, settings=settings)


async def _collect(
    url: str, runtime: Any, *, groups: int, seed_start: int, settings: EpisodeSettings, template: dict
) -> dict[str, bytes]:
    inspection = json.loads(canonical_json(await inspect_environment(url)))
    behavior_policy = dict(runtime.identity(None))
    behavior_policy["adapter"] = None
    documents = []
    for g in range(groups):
        task = GroupTask(
            group_index=g,
            environment_index=0,
            seed=seed_start + g,
            reset_payload=reset_payload(template, seed_start + g),
            inspection=inspection,
            settings=settings,
            behavior_policy=behavior_policy,
        )
        document = await GroupCollector(task, runtime).run()
        documents.append(json.loads(canonical_json(document)))
    return build_bundle(
        documents,
        spec=spec_for(settings, seed_start=seed_start),
        inspections=[inspection],
        behavior_policy=behavior_policy,
        reset_plan_sha256=reset_plan_sha256([template]),
    )


def collect_bundle(
    url: str,
    model_dir: Path,
    *,
    groups: int = 3,
    group_size: int = 2,
    max_steps: int = 3,
    seed_start: int = 100,
    template: dict | None = None,
    thinking: bool = True,
) -> dict[str, bytes]:
    """``{"rollouts.jsonl", "replay.json", "summary.json"}`` → bytes of a real collection."""
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(model_dir)
    settings = EpisodeSettings(group_size=group_size, max_steps=max_steps, max_action_tokens=48, thinking=thinking)
    return asyncio.run(
        _collect(
            url, runtime, groups=groups, seed_start=seed_start, settings=settings,
            template=dict(template or {}),
        )
    )


def write_bundle(folder: Path, files: dict[str, bytes]) -> Path:
    """Write the files into ``folder``; return the summary path."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder / "summary.json"


def parse(files: dict[str, bytes]) -> tuple[list[dict], dict, dict]:
    """Deep copies of ``(dataset lines, replay, summary)``."""
    lines = [json.loads(line) for line in files["rollouts.jsonl"].decode().splitlines()]
    return lines, json.loads(files["replay.json"]), json.loads(files["summary.json"])


def reseal(lines: list[dict], replay: dict, summary: dict) -> dict[str, bytes]:
    """Re-serialise edited documents and recompute every digest/byte count binding them."""
    replay, summary = copy.deepcopy(replay), copy.deepcopy(summary)
    dataset = b"".join(canonical_json(line) + b"\n" for line in lines)
    replay["dataset_sha256"] = sha256_bytes(dataset)
    replay_bytes = pretty_json(replay)
    summary["dataset_sha256"] = sha256_bytes(dataset)
    summary["dataset_bytes"] = len(dataset)
    summary["replay_sha256"] = sha256_bytes(replay_bytes)
    summary["replay_bytes"] = len(replay_bytes)
    return {"rollouts.jsonl": dataset, "replay.json": replay_bytes, "summary.json": pretty_json(summary)}


_CACHE: dict[str, dict[str, bytes]] = {}


def real_bundle(model_dir: Path) -> dict[str, bytes]:
    """The standard test bundle (3 groups × 2 candidates, max 3 steps, template
    ``{"difficulty": "easy"}``), collected once per test process against a fresh counter env."""
    key = str(model_dir)
    if key not in _CACHE:
        from tests.support.servers import serve_example_env

        with serve_example_env("counter") as url:
            _CACHE[key] = collect_bundle(url, model_dir, template={"difficulty": "easy"})
    return _CACHE[key]
