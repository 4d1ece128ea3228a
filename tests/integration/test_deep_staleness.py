"""max_staleness 2 on real parts (Temporal dev server, SeaweedFS, real workers, the openenv counter
env): collection runs two adapter versions ahead of training, across continue-as-new.

Iterations 1, 2 and 3 are sampled by the starting policy (versions 0: lags 0, 1, 2), iteration 4
by iteration 1's adapter (lag 2, where staleness 1 would have used iteration 2's): each trainer
scores its data with the adapter its data names, by digest; the bundles record the lag, the
trainer's selection records the version bound (nothing past it here), and ``verify --run`` passes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api.runs import RunService
from kiln.core.artifacts.store import S3Store
from kiln.core.contracts import parse_run_request
from kiln.core.rollout.verify.run import verify_run
from tests.support.kiln_workers import running_workers
from tests.support.run_folders import artifact_bytes, download_run
from tests.support.waiting import run_executions, workflow_result

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

# The staleness-1 test's run (tests/integration/test_online_rl.py), four iterations deep two.
RUN = {
    "kind": "train",
    "groups": 2,
    "group_size": 4,
    "max_steps": 6,
    "max_action_tokens": 48,
    "iterations": 4,
    "max_staleness": 2,
    "output_adapter": "counter-stale2",
    "training_config": {"echo": None},
}


@pytest.mark.timeout(780)
async def test_staleness_two_pipelines_collection_across_continue_as_new(
    kiln_settings: Any, counter_env_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import kiln.core.run_plan

    monkeypatch.setattr(kiln.core.run_plan, "HISTORY_EVENTS_BUDGET", 1)  # continue as new every iteration
    settings = kiln_settings()
    request = parse_run_request({**RUN, "environment_urls": [counter_env_url]})
    async with running_workers(settings) as client:
        service = RunService(client, settings)
        status, _ = await service.submit(request)
        run_id = status.run_id
        final = await workflow_result(client.get_workflow_handle(run_id), timeout_s=720)
        executions = await run_executions(client, run_id, continued=3)
    assert final["state"] == "completed", final.get("failure")
    assert sorted(e.status.name for e in executions) == ["COMPLETED"] + ["CONTINUED_AS_NEW"] * 3
    curve = final["iterations"]
    assert [r["iteration"] for r in curve] == [1, 2, 3, 4]
    assert [r["staleness"] for r in curve] == [0, 1, 2, 2]
    assert all(r["trained"] for r in curve), curve
    first = curve[0]["adapter_sha256"]
    assert [r["behavior_adapter_sha256"] for r in curve] == [None, None, None, first]
    assert first != curve[1]["adapter_sha256"]  # lag 2, not 1: iteration 4 is not sampled by adapter 2

    store = S3Store.from_settings(settings)
    manifest = json.loads(store.get_key(f"runs/{run_id}/manifest.json"))
    names = {a["name"]: a for a in manifest["artifacts"]}
    for k, lag, behind in ((1, 0, None), (2, 1, None), (3, 2, None), (4, 2, first)):
        prefix = f"iterations/{k:06d}/"
        summary = json.loads(artifact_bytes(store, names[prefix + "summary.json"]))
        receipt = json.loads(artifact_bytes(store, names[prefix + "train_receipt.json"]))
        assert summary["staleness"] == {"max_staleness": 2, "behavior_version": k - 1 - lag, "lag": lag}
        assert summary["behavior_policy"]["adapter_sha256"] == behind
        bound = {"max_staleness": 2, "trained_from_version": k - 1, "lags": {str(lag): 2}, "dropped_groups": 0}
        assert summary["training_selection"]["stale"] == bound == receipt["selection"]["stale"]
        if lag:  # the trainer scored the data with the adapter that sampled it, fetched by digest
            assert receipt["staleness"]["staleness"] == lag
            assert receipt["staleness"]["behavior_adapter_sha256"] == behind
            assert receipt["continued_from"]["adapter_sha256"] == curve[k - 2]["adapter_sha256"]
        else:
            assert receipt.get("staleness") is None
    report = verify_run(download_run(store, run_id, manifest, tmp_path / "run"))
    assert [r["staleness"] for r in report["iterations"]] == [0, 1, 2, 2]
    assert [r["sampled_by"] for r in report["iterations"]] == [None, None, None, first]
