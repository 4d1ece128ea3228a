"""Online RL on real parts: several collect→train iterations in one durable run (issue 16).

A 4-iteration run of the tiny demo model on the counter environment (Temporal dev server,
SeaweedFS, real workers): every iteration samples fresh seeds with the adapter the previous one
trained (the behaviour identity of iteration k names iteration k−1's adapter digest), the
held-out return of the last iteration's adapter beats the first's on paired seeds (sign test),
the manifest lists every iteration's bundle, adapter and receipt, status and ``metrics.jsonl``
carry the curve, and each iteration's bundle verifies offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api.runs import RunService
from kiln.artifacts.store import ObjectRef, S3Store
from kiln.contracts import parse_run_request
from kiln.evaluation.sign_test import exact_sign_test_p_value
from kiln.rollout.verify import verify_bundle
from tests.support.counter_loop import DEMO_TRAINING
from tests.support.kiln_workers import running_workers
from tests.support.waiting import workflow_result

pytestmark = pytest.mark.asyncio

ONLINE_RUN = {
    "kind": "train",
    "groups": 8,
    "group_size": 4,
    "max_steps": 6,
    "max_action_tokens": 48,
    "iterations": 4,
    "eval_every": 1,
    "output_adapter": "counter-online",
    "training_config": {**DEMO_TRAINING, "echo": None, "learning_rate": 3e-4},
    "environment_eval": {"groups": 20, "group_size": 2},
}


def _get(store: S3Store, entry: dict[str, Any]) -> bytes:
    return store.get_bytes(ObjectRef(uri=entry["uri"], sha256=entry["sha256"], bytes=entry["bytes"]))


def _per_seed_returns(summary: dict[str, Any]) -> dict[int, float]:
    """Mean return per held-out seed from an evaluation side's summary."""
    out: dict[int, float] = {}
    for group in summary["groups"]:
        returns = [c["episode_return"] for c in group["candidates"]]
        out[group["seed"]] = sum(returns) / len(returns)
    return out


@pytest.mark.timeout(900)
async def test_four_iterations_learn_on_policy(kiln_settings: Any, counter_env_url: str, tmp_path: Path) -> None:
    settings = kiln_settings()
    request = parse_run_request({**ONLINE_RUN, "environment_urls": [counter_env_url]})
    async with running_workers(settings) as client:
        service = RunService(client, settings)
        status, _ = await service.submit(request)
        final = await workflow_result(client.get_workflow_handle(status["run_id"]), timeout_s=840)
    assert final["state"] == "completed", final.get("failure")
    assert final["iteration"] == 4 and final["iterations_total"] == 4
    curve = final["iterations"]
    assert [r["iteration"] for r in curve] == [1, 2, 3, 4]
    assert [r["seed_start"] for r in curve] == [0, 8, 16, 24]
    assert all(r["trained"] and r["steps"] > 0 for r in curve)
    # On-policy proof: iteration k sampled with exactly the adapter iteration k−1 produced.
    assert curve[0]["behavior_adapter_sha256"] is None
    for previous, current in zip(curve, curve[1:]):
        assert current["behavior_adapter_sha256"] == previous["adapter_sha256"]
    assert len({r["adapter_sha256"] for r in curve}) == 4

    store = S3Store.from_settings(settings)
    manifest = json.loads(store.get_key(f"runs/{final['run_id']}/manifest.json"))
    names = {a["name"]: a for a in manifest["artifacts"]}
    assert manifest["iterations"] == 4
    for k in range(1, 5):
        prefix = f"iterations/{k:06d}/"
        for name in ("rollouts.jsonl", "replay.json", "summary.json", "train_receipt.json", "adapter/adapter_model.safetensors"):
            assert prefix + name in names, prefix + name
        # Each iteration's bundle verifies offline on its own.
        folder = tmp_path / f"it{k}"
        folder.mkdir()
        for name in ("rollouts.jsonl", "replay.json", "summary.json"):
            (folder / name).write_bytes(_get(store, names[prefix + name]))
        report = verify_bundle(folder / "summary.json", dataset_path=folder / "rollouts.jsonl", replay_path=folder / "replay.json")
        assert report["rollouts"] == 32
        summary = json.loads((folder / "summary.json").read_bytes())
        assert summary["behavior_policy"].get("adapter_sha256") == curve[k - 1]["behavior_adapter_sha256"]
    # The top-level adapter is the final one, and it was gated against the starting policy.
    final_receipt = json.loads(_get(store, names["train_receipt.json"]))
    assert final_receipt["adapter_sha256"] == curve[-1]["adapter_sha256"]
    assert names["adapter/adapter_model.safetensors"]["sha256"] == names["iterations/000004/adapter/adapter_model.safetensors"]["sha256"]

    # Learning: the held-out return of iteration 4's adapter beats iteration 1's on the same
    # paired seeds (exact sign test); every iteration was evaluated (eval_every 1).
    first = _per_seed_returns(json.loads(_get(store, names["iterations/000001/environment_eval/candidate/replay.json"])))
    last = _per_seed_returns(json.loads(_get(store, names["environment_eval/candidate/replay.json"])))
    assert set(first) == set(last) and len(first) == 20
    wins = sum(1 for seed in first if last[seed] > first[seed])
    losses = sum(1 for seed in first if last[seed] < first[seed])
    print("curve", [(r["mean_return"], r["eval_mean_return"], r["loss"]) for r in curve], "wins", wins, "losses", losses)
    assert wins > losses and exact_sign_test_p_value(wins, losses) < 0.05, (wins, losses)
    assert all(r["eval_mean_return"] is not None for r in curve)
    assert len({r["eval_baseline_mean_return"] for r in curve}) == 1  # one baseline, collected once

    # The curve is in metrics.jsonl too: one iteration row each, equal to status.
    metrics = [json.loads(line) for line in _get(store, names["metrics.jsonl"]).splitlines()]
    rows = [m for m in metrics if m.get("kind") == "iteration"]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert [r["adapter_sha256"] for r in rows] == [r["adapter_sha256"] for r in curve]
    assert [r["mean_return"] for r in rows] == [r["mean_return"] for r in curve]
    steps = [m for m in metrics if m.get("kind") == "train_step"]
    assert {m["iteration"] for m in steps} == {1, 2, 3, 4}
