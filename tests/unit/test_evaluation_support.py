"""Shared helpers for the evaluation tests: synthetic paired bundles (summary + replay documents).

(No tests here; the file name keeps it inside the evaluation tests' namespace.)
"""

from __future__ import annotations

import copy
from typing import Any

ENV_NAME = "counter"
ENV_URL = "http://127.0.0.1:8990"
INSPECTION = {"identity": {"base_url": ENV_URL, "schema_sha256": "sha256:" + "a" * 64}}


def bundle(returns: list[list[float]], *, seed_start: int = 1000) -> tuple[dict, dict]:
    """``(summary, replay)`` with one seed group per entry of ``returns`` (its episode returns)."""
    groups: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    for g, group_returns in enumerate(returns):
        seed = seed_start + g
        groups.append(
            {
                "group_index": g,
                "environment_index": 0,
                "seed": seed,
                "reset_payload": {"seed": seed},
                "reset_observation": {"observation": {"total": 0}, "reward": None, "done": False},
                "candidates": [
                    {"candidate_index": c, "episode_return": r} for c, r in enumerate(group_returns)
                ],
            }
        )
        for c, r in enumerate(group_returns):
            records.append(
                {
                    "group_index": g,
                    "candidate_index": c,
                    "environment_name": ENV_NAME,
                    "environment_url": ENV_URL,
                    "seed": seed,
                    "steps": 1,
                    "episode_return": r,
                    "termination": "max_steps",
                }
            )
    summary = {
        "schema": "kiln.openenv-rollout-summary.v5",
        "groups": len(returns),
        "group_size": len(returns[0]) if returns else 0,
        "seed_start": seed_start,
        "max_steps": 1,
        "temperature": 1.0,
        "rollouts": records,
    }
    replay = {
        "schema": "kiln.openenv-replay.v1",
        "environments": [copy.deepcopy(INSPECTION)],
        "groups": groups,
    }
    return summary, replay


def paired_bundles(
    baseline: list[list[float]], candidate: list[list[float]]
) -> tuple[dict, dict, dict, dict]:
    """``(baseline_summary, candidate_summary, baseline_replay, candidate_replay)``."""
    bs, br = bundle(baseline)
    cs, cr = bundle(candidate)
    return bs, cs, br, cr


def constant(groups: int, value: float, size: int = 1) -> list[list[float]]:
    return [[value] * size for _ in range(groups)]
