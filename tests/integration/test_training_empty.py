"""A train run whose every group is skipped fails ``training_failed`` / ``zero_groups`` unless the
request says ``allow_empty_training: true``; warnings number groups from 0 like receipts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.core.artifacts.group_sets import group_set
from kiln.core.artifacts.selections import full_selection
from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import canonical_json, sha256_bytes
from kiln.core.errors import TrainingFailed
from kiln.core.records import StoredObject, TrainInput
from kiln.core.stages.training import train

pytestmark = pytest.mark.timeout(120)


def _group(index: int) -> dict[str, Any]:
    completion = {"reward": 1.0, "harness_code": None, "tokens": {"pieces": [{"kind": "context", "ids": [1]}]}}
    return {"group_index": index, "line": {"messages": [], "completions": [completion, dict(completion)]}}


def _input(store: S3Store, allow: bool, groups: int = 2) -> TrainInput:
    refs = [StoredObject.of(store.put_blob(canonical_json(_group(i)))) for i in range(groups)]
    return TrainInput(
        run_id="r", groups=group_set(store, [refs]), training_config={}, output_adapter="x", behavior_policy={},
        allow_empty_training=allow,
    )


def test_all_groups_skipped(s3_server: dict[str, str], tmp_path: Path) -> None:
    store = S3Store(endpoint=s3_server["endpoint"], access_key=s3_server["access_key"],
                    secret_key=s3_server["secret_key"], bucket=s3_server["bucket"])
    kwargs = dict(store=store, model_path=tmp_path, work_dir=tmp_path, cache_dir=tmp_path,
                  heartbeat=lambda _d: None, should_cancel=lambda: False)
    with pytest.raises(TrainingFailed) as info:
        train(_input(store, False), **kwargs)
    assert info.value.code == "training_failed" and not info.value.retryable
    assert info.value.details["reason"] == "zero_groups"
    assert "group 0 has no reward variation" in info.value.message  # 0-based, like receipts
    result = train(_input(store, True), **kwargs)
    assert result.trained is False and result.skip_reason.startswith("every seed group was skipped")

    # Many skipped groups: the result (a workflow payload) keeps the counts and the first 20
    # warnings, the stored selection (read back for the summary) every one.
    many = train(_input(store, True, groups=50), **kwargs)
    assert many.selection["no_reward_gradient_groups_skipped"] == 50
    assert len(many.selection["warnings"]) == 20
    assert many.skip_reason is not None and many.skip_reason.endswith("; and 42 more")
    whole = full_selection(store, many)
    assert whole is not None and len(whole["warnings"]) == 50
    assert whole["warnings"][49].startswith("group 49 has no reward variation")
    assert {k: v for k, v in whole.items() if k != "warnings"} == {
        k: v for k, v in many.selection.items() if k != "warnings"
    }


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_train_run_failing_zero_groups_keeps_its_collected_episodes(
    kiln_settings, counter_env_url: str, tmp_path: Path
) -> None:
    """Every action cut at one token: no group has reward variation, training fails ``zero_groups``,
    and the run still publishes the episodes it collected (manifest + bundle, no adapter): the
    status points at the manifest, the downloaded run verifies, nothing is promoted."""
    import json

    from typer.testing import CliRunner

    from api.runs import RunService
    from kiln.cli.app import app as cli_app
    from kiln.core.artifacts.adapters import pointer_key
    from kiln.core.contracts import parse_run_request
    from kiln.core.rollout.verify.run import verify_run
    from tests.support.counter_loop import ONE_PASS_TRAINING
    from tests.support.kiln_workers import running_workers
    from tests.support.run_folders import download_run
    from tests.support.waiting import workflow_result

    settings = kiln_settings()
    request = parse_run_request({
        "kind": "train", "groups": 2, "group_size": 2, "max_steps": 1, "max_action_tokens": 1,
        "thinking": False, "output_adapter": "kept-evidence", "environment_urls": [counter_env_url],
        "training_config": {**ONE_PASS_TRAINING, "echo": None},
    })
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(request)
        handle = client.get_workflow_handle(status.run_id)
        with pytest.raises(Exception):
            await workflow_result(handle, timeout_s=200)
        final = await handle.query("status")
    final = final if isinstance(final, dict) else final.model_dump(mode="json", by_alias=True)
    assert final["state"] == "failed" and final["failure"]["code"] == "training_failed"
    assert final["failure"]["details"]["reason"] == "zero_groups"
    assert final["promoted"] is False and final["manifest"] is not None
    assert {a["name"] for a in final["artifacts"]} == {"rollouts.jsonl", "replay.json", "summary.json", "metrics.jsonl"}
    assert any("failed (training_failed) after collection" in w for w in final["warnings"])
    store = S3Store.from_settings(settings)
    manifest_bytes = store.get_key(f"runs/{final['run_id']}/manifest.json")
    assert manifest_bytes is not None and sha256_bytes(manifest_bytes) == final["manifest"]["sha256"]
    manifest = json.loads(manifest_bytes)
    assert manifest["promoted"] is False and manifest["adapter_sha256"] is None
    assert not store.exists(pointer_key("kept-evidence"))  # no adapter name points anywhere
    folder = download_run(store, final["run_id"], manifest, tmp_path / "run")
    report = verify_run(folder)
    assert report["bundles"] == {".": {"groups": 2, "rollouts": 4}}
    shown = CliRunner().invoke(cli_app, ["openenv", "verify", "--run", str(folder)])
    assert shown.exit_code == 0, shown.output
