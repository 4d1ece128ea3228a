"""DAPO dynamic sampling on real parts (issue 40): Temporal dev server, SeaweedFS, real workers,
the tiny model and a real ``openenv`` server (``tests/support/signal_env.py``) whose even seeds
pay the same reward to every candidate and whose odd seeds pay 0 and 1 within a group.

With ``groups`` 2 every first collection holds one group without variation (its even seed), so
each iteration refills: round 1 takes the next seed (even: still short), round 2 the one after
(odd: done). With the setting off, the iteration trains on the one group left, as before. Where
no seed can vary (``flat`` reset), the refill stops at the cap with a warning.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.runs import RunService
from kiln.core.artifacts.store import S3Store
from kiln.core.contracts import parse_run_request
from kiln.core.rollout.verify import VerificationFailed
from kiln.core.rollout.verify.run import verify_run
from tests.support.kiln_workers import running_workers
from tests.support.run_folders import download_run, rewrite_artifact
from tests.support.waiting import workflow_result

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

RUN = {
    "kind": "train",
    "groups": 2,
    "group_size": 2,
    "max_steps": 1,
    "max_action_tokens": 24,
    "thinking": False,
    "constrained_actions": True,
    "output_adapter": "signal-dapo",
}
TRAINING = {"learning_rate": 1e-3, "epochs": 1, "echo": None}


@pytest.fixture(scope="module")
def signal_env_url() -> Iterator[str]:
    from tests.support.servers import serve_module

    with serve_module("tests.support.signal_env", "--max-concurrent-envs", "8") as url:
        yield url


async def _run(settings: Any, body: dict[str, Any]) -> dict[str, Any]:
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(parse_run_request(body))
        return await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=400)


def _downloaded(settings: Any, final: dict[str, Any], folder: Path) -> Path:
    store = S3Store.from_settings(settings)
    manifest = json.loads(store.get_key(f"runs/{final['run_id']}/manifest.json"))
    return download_run(store, final["run_id"], manifest, folder)


def _varying_groups(summary: dict[str, Any]) -> list[int]:
    """Brute force from the bundle's rollout records: the groups whose returns are not all equal."""
    returns: dict[int, set[float]] = {}
    for record in summary["rollouts"]:
        returns.setdefault(record["group_index"], set()).add(record["episode_return"])
    return sorted(g for g, values in returns.items() if len(values) > 1)


def _refill(rounds: list[tuple[int, int]], signal: int, cap: int = 2, target: int = 2) -> dict[str, Any]:
    return {
        "target_groups": target,
        "max_refill_rounds": cap,
        "rounds": [{"round": n + 1, "group_indexes": [g], "seeds": [s]} for n, (g, s) in enumerate(rounds)],
        "signal_groups": signal,
        "capped": signal < target,
    }


@pytest.mark.timeout(480)
async def test_refill_trains_on_groups_with_variation_and_verifies(
    kiln_settings: Any, signal_env_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Iteration 1 refills in the workflow's own loop; iteration 2 (``max_staleness`` 1) is
    collected and refilled while iteration 1 trains, and its groups and refill record cross a
    continue-as-new (a history budget of 1 event) before it trains."""
    import kiln.core.run_plan

    monkeypatch.setattr(kiln.core.run_plan, "HISTORY_EVENTS_BUDGET", 1)
    settings = kiln_settings()
    final = await _run(settings, {
        **RUN, "iterations": 2, "max_staleness": 1, "environment_urls": [signal_env_url],
        "training_config": {**TRAINING, "dynamic_sampling": {"max_refill_rounds": 2}},
    })
    assert final["state"] == "completed", final.get("failure")
    assert [r["staleness"] for r in final["iterations"]] == [0, 1]
    # The seed plan reserves groups × (1 + 2) seeds per iteration: iteration 2 starts at seed 6.
    assert [r["seed_start"] for r in final["iterations"]] == [0, 6]
    assert all(r["trained"] for r in final["iterations"])
    assert not [w for w in final["warnings"] if "dynamic sampling" in w]
    folder = _downloaded(settings, final, tmp_path / "run")
    for k, start in ((1, 0), (2, 6)):
        summary = json.loads((folder / f"iterations/{k:06d}/summary.json").read_bytes())
        assert summary["groups"] == 4 and summary["seed_start"] == start
        assert summary["dynamic_sampling"] == _refill([(2, start + 2), (3, start + 3)], signal=2)
        assert _varying_groups(summary) == [1, 3]
        selection = summary["training_selection"]
        assert selection["groups_submitted"] == 4
        assert selection["no_reward_gradient_groups_skipped"] == 2  # trained on exactly 2 groups
    report = verify_run(folder)
    assert report["bundles"]["iterations/000002/"] == {"groups": 4, "rollouts": 8}
    assert [row["iteration"] for row in report["iterations"]] == [1, 2]
    # A record that names another seed for a refill (manifest digest fixed) fails verification.
    name = "iterations/000002/summary.json"

    def other_seed(summary: dict[str, Any]) -> dict[str, Any]:
        summary["dynamic_sampling"]["rounds"][1]["seeds"] = [12]
        return summary

    rewrite_artifact(folder, name, other_seed)
    with pytest.raises(VerificationFailed, match="dynamic_sampling.rounds.1..seeds"):
        verify_run(folder)


@pytest.mark.timeout(480)
async def test_off_is_unchanged_and_the_cap_stops_with_a_warning(
    kiln_settings: Any, signal_env_url: str, tmp_path: Path
) -> None:
    settings = kiln_settings()
    off = await _run(settings, {**RUN, "environment_urls": [signal_env_url], "training_config": TRAINING})
    assert off["state"] == "completed", off.get("failure")
    folder = _downloaded(settings, off, tmp_path / "off")
    summary = json.loads((folder / "summary.json").read_bytes())
    assert summary["groups"] == 2 and "dynamic_sampling" not in summary
    assert (off["progress"]["groups_completed"], off["progress"]["groups_total"]) == (2, 2)
    assert summary["training_selection"]["groups_submitted"] == 2
    assert summary["training_selection"]["no_reward_gradient_groups_skipped"] == 1
    verify_run(folder)

    capped = await _run(settings, {
        **RUN, "environment_urls": [signal_env_url], "reset_options": {"flat": True},
        "allow_empty_training": True, "output_adapter": "signal-flat",
        "training_config": {**TRAINING, "dynamic_sampling": {"max_refill_rounds": 1}},
    })
    assert capped["state"] == "completed", capped.get("failure")
    assert capped["iterations"][0]["trained"] is False
    progress = capped["progress"]  # the refill round's groups are planned, then collected
    assert (progress["groups_completed"], progress["groups_total"]) == (4, 4)
    assert (progress["rollouts_completed"], progress["rollouts_total"]) == (8, 8)
    assert (
        "iteration 1: dynamic sampling reached its cap of 1 refill rounds with 0 of 2 groups carrying "
        "reward variation; it trains on those"
    ) in capped["warnings"]
    folder = _downloaded(settings, capped, tmp_path / "capped")
    summary = json.loads((folder / "summary.json").read_bytes())
    # One round of 2 fresh seeds (2, 3), both flat: 4 groups, none with variation.
    assert summary["groups"] == 4 and _varying_groups(summary) == []
    assert summary["dynamic_sampling"] == {
        "target_groups": 2, "max_refill_rounds": 1, "signal_groups": 0, "capped": True,
        "rounds": [{"round": 1, "group_indexes": [2, 3], "seeds": [2, 3]}],
    }
    verify_run(folder)
