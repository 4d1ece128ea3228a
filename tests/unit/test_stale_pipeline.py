"""max_staleness N > 1 (kiln.core.stale_pipeline): the pipeline's plan, the trainer's version bound,
the bundle's staleness record and verify's checks of it, with exact values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.contracts import parse_run_request
from kiln.core.errors import InvalidRequest, TrainingFailed, VerificationFailed
from kiln.core.records import GroupSet, StoredObject, TrainInput
from kiln.core.rollout.verify.run import _check_chain
from kiln.core.rollout.verify.summary import check_staleness
from kiln.core.rollout.verify.checks import Where
from kiln.core.run_plan import behavior_lag
from kiln.core.stages.training import stale_bound
from kiln.core.stale_pipeline import bound_groups, pipeline_starts, sampler_version
from kiln.core.train.selection import select_groups
from kiln.core.training_config import TrainingConfig
from tests.unit.test_train_support import X_TOKEN, Y_TOKEN, completion

pytestmark = pytest.mark.timeout(30)

BASE = {
    "kind": "train",
    "environment_urls": ["http://127.0.0.1:1"],
    "groups": 2,
    "group_size": 2,
    "seed_start": 10,
    "output_adapter": "a1",
}


def test_max_staleness_is_bounded_and_named_in_its_errors() -> None:
    assert parse_run_request({**BASE, "iterations": 5, "max_staleness": 4}).max_staleness == 4
    assert parse_run_request(BASE).max_staleness == 0  # the default is unchanged
    with pytest.raises(InvalidRequest, match=r"max_staleness: Input should be less than or equal to 4"):
        parse_run_request({**BASE, "iterations": 5, "max_staleness": 5})
    with pytest.raises(InvalidRequest, match=r"max_staleness: Input should be greater than or equal to 0"):
        parse_run_request({**BASE, "iterations": 5, "max_staleness": -1})
    with pytest.raises(InvalidRequest, match=r"max_staleness 3 needs iterations >= 2.*set iterations >= 2"):
        parse_run_request({**BASE, "max_staleness": 3})


@pytest.mark.parametrize(
    ("n", "lags", "versions"),
    [
        (1, [0, 1, 1, 1, 1, 1], [0, 0, 1, 2, 3, 4]),
        (2, [0, 1, 2, 2, 2, 2], [0, 0, 0, 1, 2, 3]),
        (3, [0, 1, 2, 3, 3, 3], [0, 0, 0, 0, 1, 2]),
    ],
)
def test_each_iteration_is_sampled_n_versions_behind(n: int, lags: list[int], versions: list[int]) -> None:
    request = parse_run_request({**BASE, "iterations": 6, "max_staleness": n})
    assert [behavior_lag(request, k) for k in range(1, 7)] == lags
    assert [sampler_version(n, k) for k in range(1, 7)] == versions
    assert [k - 1 - lag for k, lag in zip(range(1, 7), lags)] == versions


def test_the_pipeline_starts_each_collection_once_its_sampler_exists() -> None:
    assert [pipeline_starts(2, k, 6) for k in range(1, 7)] == [[2, 3], [4], [5], [6], [], []]
    assert [pipeline_starts(3, k, 4) for k in range(1, 5)] == [[2, 3, 4], [], [], []]
    assert [pipeline_starts(1, k, 3) for k in range(1, 4)] == [[2], [3], []]  # today's overlap
    assert pipeline_starts(0, 1, 3) == []
    # Every iteration after the first starts exactly once, while an iteration its sampler trained from trains.
    for n in (1, 2, 3, 4):
        started = {j: k for k in range(1, 9) for j in pipeline_starts(n, k, 8)}
        assert sorted(started) == list(range(2, 9))
        assert all(started[j] - 1 == sampler_version(n, j) for j in started)


def test_the_version_bound_drops_and_counts_groups_past_it() -> None:
    bound = bound_groups([3, 1, 2, 0, 3], trained_from=3, max_staleness=2)
    assert bound.lags == {"0": 2, "1": 1, "2": 1, "3": 1}
    assert bound.dropped_at == {3: 3}
    assert bound.block() == {"max_staleness": 2, "trained_from_version": 3, "lags": bound.lags, "dropped_groups": 1}
    assert bound.warnings() == {
        3: "group 3 was sampled 3 adapter versions behind version 3, past max_staleness 2; dropped before training"
    }
    assert bound_groups([1, 1], trained_from=1, max_staleness=2).dropped_at == {}
    with pytest.raises(TrainingFailed) as caught:
        bound_groups([0, 4], trained_from=3, max_staleness=2)
    assert caught.value.code == "staleness_invalid" and "group 1 names adapter version 4" in caught.value.message


def _group(step: int) -> dict:
    return {"tag": step, "messages": [], "completions": [completion(step, X_TOKEN), completion(step, Y_TOKEN)]}


def test_the_trainer_drops_stale_groups_before_selecting() -> None:
    groups = [_group(0), _group(1), _group(2)]
    bound = bound_groups([2, 0, 2], trained_from=2, max_staleness=1)
    kept, selection = select_groups(groups, "drop", bound.warnings())
    assert len(kept) == 2 and [g["tag"] for g in kept] == [0, 2]
    assert selection["stale_groups_dropped"] == 1 and selection["groups_submitted"] == 3
    assert selection["warnings"] == [bound.warnings()[1]]
    assert "stale_groups_dropped" not in select_groups(groups, "drop")[1]


def _train_input(**extra: object) -> TrainInput:
    ref = StoredObject(uri="s3://b/k", sha256="sha256:" + "0" * 64, bytes=1)
    return TrainInput(
        run_id="r",
        groups=GroupSet(indexes=[ref], count=3),
        training_config=TrainingConfig(),
        output_adapter="a",
        behavior_policy={},
        **extra,
    )


def test_the_trainer_bound_applies_only_to_pipelined_runs() -> None:
    assert stale_bound(_train_input(iteration=4, staleness=1), 3) is None  # staleness 1: as before
    bound = stale_bound(_train_input(iteration=4, staleness=2, max_staleness=2, behavior_version=1), 3)
    assert bound is not None and bound.lags == {"2": 3} and bound.dropped_at == {}
    past = stale_bound(_train_input(iteration=5, staleness=3, max_staleness=2, behavior_version=1), 2)
    assert past is not None and past.dropped_at == {0: 3, 1: 3}
    with pytest.raises(TrainingFailed) as caught:
        stale_bound(_train_input(iteration=5, staleness=2, max_staleness=2, behavior_version=1), 2)
    assert caught.value.code == "staleness_invalid" and "staleness 2 disagrees with behavior_version 1" in str(
        caught.value.message
    )


def test_the_bundle_record_is_checked_field_by_field() -> None:
    where = Where("summary.json")
    check_staleness({"max_staleness": 2, "behavior_version": 1, "lag": 2}, where)
    for block, field in (
        ({"max_staleness": 5, "behavior_version": 1, "lag": 2}, "staleness.max_staleness"),
        ({"max_staleness": 2, "behavior_version": -1, "lag": 2}, "staleness.behavior_version"),
        ({"max_staleness": 2, "behavior_version": 1, "lag": True}, "staleness.lag"),
        ({"max_staleness": 2, "behavior_version": 1}, "staleness.lag"),
    ):
        with pytest.raises(VerificationFailed, match=field.replace(".", r"\.")):
            check_staleness(block, where)


A = ["sha256:" + c * 64 for c in "abcd"]  # the adapters iterations 1..4 trained


def _write_run(
    folder: Path, n: int, lags: list[int], samplers: list[str | None], tamper: dict[int, dict] | None = None
) -> None:
    """Iteration summaries and receipts of a run with max_staleness ``n``: iteration k sampled by
    ``samplers[k-1]``, trained into ``A[k-1]``."""
    for k, (lag, sampled_by) in enumerate(zip(lags, samplers), start=1):
        prefix = folder / f"iterations/{k:06d}"
        prefix.mkdir(parents=True)
        summary = {
            "groups": 2,
            "behavior_policy": {"adapter_sha256": sampled_by},
            "staleness": {"max_staleness": n, "behavior_version": k - 1 - lag, "lag": lag},
            "training_selection": {
                "stale": {"max_staleness": n, "trained_from_version": k - 1, "lags": {str(lag): 2}, "dropped_groups": 0}
            },
        }
        receipt = {"adapter_sha256": A[k - 1], "staleness": {"staleness": lag} if lag else None}
        for key, value in (tamper or {}).get(k, {}).items():
            part, name = key.split(".", 1)
            (summary if part == "summary" else receipt)[name] = value
        (prefix / "summary.json").write_text(json.dumps(summary))
        (prefix / "train_receipt.json").write_text(json.dumps(receipt))


def test_verify_follows_the_chain_of_a_pipelined_run(tmp_path: Path) -> None:
    # max_staleness 2 over 4 iterations: 1, 2, 3 sampled by the start policy, 4 by adapter 1.
    _write_run(tmp_path, 2, [0, 1, 2, 2], [None, None, None, A[0]])
    rows = _check_chain(tmp_path, 4)
    assert [r["staleness"] for r in rows] == [0, 1, 2, 2]
    assert [r["sampled_by"] for r in rows] == [None, None, None, A[0]]


@pytest.mark.parametrize(
    ("tamper", "file", "field"),
    [
        # a lag of 1 declared for iteration 4 (sampled by adapter 1): the bundle no longer matches
        ({4: {"receipt.staleness": {"staleness": 1}}}, "iterations/000004/train_receipt.json", "staleness.staleness"),
        (
            {4: {"summary.staleness": {"max_staleness": 2, "behavior_version": 1, "lag": 1}}},
            "iterations/000004/summary.json",
            "staleness.behavior_version",
        ),
        (
            {3: {"summary.staleness": {"max_staleness": 1, "behavior_version": 0, "lag": 2}}},
            "iterations/000003/summary.json",
            "training_selection.stale.lags",
        ),
        (
            {
                3: {
                    "summary.staleness": {"max_staleness": 1, "behavior_version": 0, "lag": 2},
                    "summary.training_selection": {},
                }
            },
            "iterations/000003/summary.json",
            "staleness.lag",
        ),
    ],
)
def test_verify_names_a_tampered_lag(tmp_path: Path, tamper: dict, file: str, field: str) -> None:
    _write_run(tmp_path, 2, [0, 1, 2, 2], [None, None, None, A[0]], tamper)
    with pytest.raises(VerificationFailed) as caught:
        _check_chain(tmp_path, 4)
    assert file in caught.value.message and field in caught.value.message


def test_verify_refuses_a_sampler_the_lag_does_not_name(tmp_path: Path) -> None:
    # Iteration 4 claims lag 2 (adapter 1) but was sampled by adapter 2.
    _write_run(tmp_path, 2, [0, 1, 2, 2], [None, None, None, A[1]])
    with pytest.raises(VerificationFailed, match=r"iterations/000004/summary.json.*behavior_policy\.adapter_sha256"):
        _check_chain(tmp_path, 4)
