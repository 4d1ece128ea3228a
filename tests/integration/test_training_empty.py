"""A train run whose every group is skipped fails ``training_failed`` / ``zero_groups`` unless the
request says ``allow_empty_training: true``; warnings number groups from 0 like receipts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.artifacts.group_sets import group_set
from kiln.artifacts.selections import full_selection
from kiln.artifacts.store import S3Store
from kiln.canonical import canonical_json
from kiln.errors import TrainingFailed
from kiln.records import StoredObject, TrainInput
from kiln.stages.training import train

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
