"""Online RL on real parts: several collect→train iterations in one durable run (issue 16).

A 4-iteration run of the tiny demo model on the counter environment (Temporal dev server,
SeaweedFS, real workers): every iteration samples fresh seeds with the adapter the previous one
trained (the behaviour identity of iteration k names iteration k−1's adapter digest), iterations 2
and 4 are evaluated on the held-out seeds (``eval_every`` 2), the last iteration's adapter beats
the base model on the final evaluation's paired seeds (sign test), the manifest lists every
iteration's bundle, adapter and receipt, status and ``metrics.jsonl`` carry the curve, and each
iteration's bundle verifies offline. Two gpu workers serve the run (one in a child process), so an
iteration's adapter is also fetched by the other worker. The run itself is a ``background`` job
(``tests/support/background.py``): it starts when the session begins and this test checks its
outcome and artifacts. (Learning over many iterations at length:
``test_online_learning.py``.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from api.runs import RunService
from kiln.core.artifacts.store import S3Store
from kiln.core.contracts import parse_run_request
from kiln.core.evaluation.sign_test import exact_sign_test_p_value
from kiln.core.rollout.verify import VerificationFailed
from kiln.core.rollout.verify.run import verify_run
from tests.support.counter_loop import ONE_PASS_TRAINING
from tests.support.kiln_workers import child_gpu_worker, running_workers
from tests.support.run_folders import artifact_bytes, download_run, rewrite_artifact
from tests.support.waiting import run_executions, workflow_result

pytestmark = pytest.mark.asyncio

ONLINE_RUN = {
    "kind": "train",
    "groups": 8,
    "group_size": 4,
    "max_steps": 6,
    "max_action_tokens": 48,
    "iterations": 4,
    "eval_every": 2,
    "output_adapter": "counter-online",
    "training_config": {"echo": None},  # the defaults (AdamW 3e-4, CISPO), ECHO off
    "environment_eval": {"groups": 20, "group_size": 2},
}


def _per_seed_returns(summary: dict[str, Any]) -> dict[int, float]:
    """Mean return per held-out seed from an evaluation side's summary."""
    out: dict[int, float] = {}
    for group in summary["groups"]:
        returns = [c["episode_return"] for c in group["candidates"]]
        out[group["seed"]] = sum(returns) / len(returns)
    return out


def four_iteration_run(settings: dict[str, str], url: str) -> dict[str, Any]:
    """Run ``ONLINE_RUN`` on ``url`` to its end with this process's control and gpu workers and a
    second gpu worker in a child process (so an iteration's adapter is also fetched by the other
    worker): the run's final status. Runs in the session's ``background`` child
    (``tests/support/background.py``); ``settings`` are ``Settings`` fields as strings."""
    from kiln.core.settings import Settings

    config = Settings(**settings)
    request = parse_run_request({**ONLINE_RUN, "environment_urls": [url]})

    async def run() -> dict[str, Any]:
        with child_gpu_worker(config, Path(settings["home"]).parent / "second-gpu-home"):
            async with running_workers(config) as client:
                status, _ = await RunService(client, config).submit(request)
                return await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=840)

    return asyncio.run(run())


@pytest.mark.background("four_iteration_run")
@pytest.mark.timeout(900)
async def test_four_iterations_learn_on_policy(background_jobs: Any, tmp_path: Path) -> None:
    from kiln.core.settings import Settings
    from tests.support.background import four_iteration_settings

    final = await asyncio.to_thread(background_jobs.result, "four_iteration_run", 880)
    settings = Settings(**four_iteration_settings(background_jobs))
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
    # The whole run verifies offline: every file, every iteration's bundle, the on-policy chain.
    folder = download_run(store, final["run_id"], manifest, tmp_path / "run")
    report = verify_run(folder)
    assert set(report["bundles"]) == {".", *(f"iterations/{k:06d}/" for k in range(1, 5))}
    assert all(b["rollouts"] == 32 for b in report["bundles"].values())
    assert [r["sampled_by"] for r in report["iterations"]] == [r["behavior_adapter_sha256"] for r in curve]
    assert [r["adapter_sha256"] for r in report["iterations"]] == [r["adapter_sha256"] for r in curve]
    # Every paired evaluation verifies: both sides, and a receipt whose evidence pairing them gives.
    assert set(report["evaluations"]) == {"environment_eval/", "iterations/000002/environment_eval/"}
    assert all(e["paired_groups"] == 20 for e in report["evaluations"].values())
    assert report["evaluations"]["environment_eval/"]["decision"] == final["environment_evaluation"]["decision"]
    # A receipt claiming a better candidate than its two sides show fails (digests fixed up).
    original = (folder / "environment_eval/receipt.json").read_bytes()
    rewrite_artifact(folder, "environment_eval/receipt.json", lambda r: {**r, "evidence": {
        **r["evidence"], "candidate_mean_return": r["evidence"]["candidate_mean_return"] + 1.0,
        "mean_return_improvement": r["evidence"]["mean_return_improvement"] + 1.0}})
    with pytest.raises(VerificationFailed) as failed:
        verify_run(folder)
    assert failed.value.details["file"] == "environment_eval/receipt.json"
    assert failed.value.details["field"].startswith("evidence"), failed.value.details
    rewrite_artifact(folder, "environment_eval/receipt.json", lambda r: json.loads(original))
    second = json.loads((folder / "iterations/000002/environment_eval/receipt.json").read_bytes())
    rewrite_artifact(folder, "iterations/000002/environment_eval/receipt.json",
             lambda r: {**r, "baseline_summary_sha256": "sha256:" + "2" * 64})
    with pytest.raises(VerificationFailed) as failed:
        verify_run(folder)
    assert failed.value.details["file"] == "iterations/000002/environment_eval/receipt.json"
    assert failed.value.details["field"] == "baseline_summary_sha256"
    rewrite_artifact(folder, "iterations/000002/environment_eval/receipt.json", lambda r: second)
    verify_run(folder)
    # A receipt that names another adapter breaks the chain at the next iteration (digests fixed up).
    rewrite_artifact(folder, "iterations/000002/train_receipt.json", lambda r: {**r, "adapter_sha256": "sha256:" + "1" * 64})
    with pytest.raises(VerificationFailed) as failed:
        verify_run(folder)
    assert failed.value.details["file"] == "iterations/000003/summary.json"
    # The top-level adapter is the final one, and it was gated against the starting policy.
    final_receipt = json.loads(artifact_bytes(store, names["train_receipt.json"]))
    assert final_receipt["adapter_sha256"] == curve[-1]["adapter_sha256"]
    assert names["adapter/adapter_model.safetensors"]["sha256"] == names["iterations/000004/adapter/adapter_model.safetensors"]["sha256"]

    # Learning: the held-out return of iteration 4's adapter beats the base model's on the same
    # paired seeds of the final evaluation (exact sign test). Iterations 2 and 4 were evaluated
    # (eval_every 2), against one baseline collected once.
    base = _per_seed_returns(json.loads(artifact_bytes(store, names["environment_eval/baseline/replay.json"])))
    last = _per_seed_returns(json.loads(artifact_bytes(store, names["environment_eval/candidate/replay.json"])))
    assert set(base) == set(last) and len(base) == 20
    wins = sum(1 for seed in base if last[seed] > base[seed])
    losses = sum(1 for seed in base if last[seed] < base[seed])
    assert wins > losses and exact_sign_test_p_value(wins, losses) < 0.05, (wins, losses, curve)
    assert [r["eval_mean_return"] is not None for r in curve] == [False, True, False, True]
    assert [r["eval_baseline_mean_return"] is not None for r in curve] == [False, True, False, True]
    assert curve[1]["eval_baseline_mean_return"] == curve[3]["eval_baseline_mean_return"]  # one baseline

    # The curve is in metrics.jsonl too: one iteration row each, equal to status.
    metrics = [json.loads(line) for line in artifact_bytes(store, names["metrics.jsonl"]).splitlines()]
    rows = [m for m in metrics if m.get("kind") == "iteration"]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert [r["adapter_sha256"] for r in rows] == [r["adapter_sha256"] for r in curve]
    assert [r["mean_return"] for r in rows] == [r["mean_return"] for r in curve]
    steps = [m for m in metrics if m.get("kind") == "train_step"]
    assert {m["iteration"] for m in steps} == {1, 2, 3, 4}


STALE_RUN = {
    **ONLINE_RUN,
    "groups": 4,
    "iterations": 3,
    "max_staleness": 1,
    "eval_every": None,
    "environment_eval": None,
}


@pytest.mark.timeout(600)
async def test_stale_overlap_across_continue_as_new(
    kiln_settings: Any, counter_env_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """max_staleness 1: iteration k+1 is collected (with adapter k−1) while iteration k trains, and
    trains with truncated IS. With a history budget of 1 event the run also continues as new after
    every iteration (carrying status, adapter, optimizer state, chain and the next iteration's
    already-collected groups): it ends as one completed run with all three iterations."""
    import kiln.core.run_plan

    monkeypatch.setattr(kiln.core.run_plan, "HISTORY_EVENTS_BUDGET", 1)
    settings = kiln_settings()
    request = parse_run_request({**STALE_RUN, "groups": 2, "environment_urls": [counter_env_url]})
    async with running_workers(settings) as client:
        service = RunService(client, settings)
        status, _ = await service.submit(request)
        run_id = status.run_id
        final = await workflow_result(client.get_workflow_handle(run_id), timeout_s=540)
        executions = await run_executions(client, run_id, continued=2)
        described = await service.status(run_id)
    assert final["state"] == "completed", final.get("failure")
    assert len(executions) == 3  # iterations 1 and 2 each ended with continue-as-new
    assert sorted(e.status.name for e in executions) == ["COMPLETED", "CONTINUED_AS_NEW", "CONTINUED_AS_NEW"]
    curve = final["iterations"]
    assert [r["iteration"] for r in curve] == [1, 2, 3]
    assert [r["staleness"] for r in curve] == [0, 1, 1]
    assert curve[2]["behavior_adapter_sha256"] == curve[0]["adapter_sha256"]
    assert described.state == "completed" and described.model_dump(mode="json")["iterations"] == curve
    store = S3Store.from_settings(settings)
    manifest = json.loads(store.get_key(f"runs/{run_id}/manifest.json"))
    assert manifest["iterations"] == 3
    names = {a["name"]: a for a in manifest["artifacts"]}
    assert {f"iterations/{k:06d}/train_receipt.json" for k in (1, 2, 3)} <= set(names)
    # Each record's mean return is its own iteration's, also for the one collected before a
    # continue-as-new and finished after it.
    for k in (1, 2, 3):
        summary = json.loads(artifact_bytes(store, names[f"iterations/{k:06d}/summary.json"]))
        assert curve[k - 1]["mean_return"] == summary["stats"]["mean_episode_return"]
    # Stale iterations: scored with the adapter that sampled them, weights truncated at the cap.
    assert curve[0]["behavior_adapter_sha256"] is None and curve[1]["behavior_adapter_sha256"] is None
    for k, behind in ((2, None), (3, curve[0]["adapter_sha256"])):
        receipt = json.loads(artifact_bytes(store, names[f"iterations/{k:06d}/train_receipt.json"]))
        block = receipt["staleness"]
        assert block["staleness"] == 1 and block["behavior_adapter_sha256"] == behind
        assert all(step["staleness"] == 1 and step["is_weight_max"] <= block["is_max_weight"] for step in receipt["steps"])
        assert receipt["continued_from"]["adapter_sha256"] == curve[k - 2]["adapter_sha256"]
    report = verify_run(download_run(store, run_id, manifest, tmp_path / "run"))
    assert [r["staleness"] for r in report["iterations"]] == [0, 1, 1]


@pytest.mark.timeout(300)
async def test_iterations_on_a_llama3_template_model(
    kiln_settings: Any, counter_env_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A model whose chat template has no thinking mode (``thinking: auto`` resolves to off): each
    iteration's adapter is resolved with the run's resolved sampling settings, so iteration 2
    collects with iteration 1's adapter (it failed ``policy_identity_changed`` when the adapter's
    identity kept the unresolved thinking mode)."""
    from tests.support.models import shared_family_model

    settings = kiln_settings(model_path=shared_family_model("llama3", tmp_path_factory))
    request = parse_run_request({
        "kind": "train", "groups": 4, "group_size": 4, "max_steps": 3, "max_action_tokens": 24,
        "constrained_actions": True, "iterations": 2, "output_adapter": "llama3-online",
        "training_config": {**ONE_PASS_TRAINING, "echo": None}, "environment_urls": [counter_env_url],
    })
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(request)
        final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=240)
    assert final["state"] == "completed", final.get("failure")
    assert final["behavior_policy"]["inference"]["thinking"] is False
    first, second = final["iterations"]
    assert first["trained"] and second["trained"]
    assert first["behavior_adapter_sha256"] is None
    assert second["behavior_adapter_sha256"] == first["adapter_sha256"] != second["adapter_sha256"]
