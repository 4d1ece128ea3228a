"""DAPO dynamic sampling's pure parts: the seed plan it reserves, the refill rounds it plans
(kiln.core.run_plan.refill_slots) and the verifier's check of the recorded rounds."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.core.contracts import parse_run_request
from kiln.core.errors import InvalidRequest, VerificationFailed
from kiln.core.rollout.verify.checks import Where
from kiln.core.rollout.verify.summary import check_dynamic_sampling
from kiln.core.run_plan import DynamicSamplingRecord, RefillRound, iteration_schedule, iteration_seed_start, refill_slots

pytestmark = pytest.mark.timeout(30)

TRAIN: dict[str, Any] = {
    "kind": "train",
    "environment_urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
    "groups": 4,
    "group_size": 2,
    "seed_start": 100,
    "iterations": 3,
    "output_adapter": "a1",
    "environment_eval": {"groups": 5},
}
DYNAMIC = {**TRAIN, "training_config": {"dynamic_sampling": {"max_refill_rounds": 2}}}


def _slots(slots: list[Any]) -> list[tuple[int, int, int]]:
    return [(s.group_index, s.environment_index, s.seed) for s in slots]


def test_the_seed_plan_reserves_the_refill_seeds_of_every_iteration() -> None:
    off, on = parse_run_request(TRAIN), parse_run_request(DYNAMIC)
    assert [iteration_seed_start(off, k) for k in (1, 2, 3)] == [100, 104, 108]
    assert off.eval_seed_start() == 112
    # 4 groups + 2 rounds × 4 reserved seeds = 12 per iteration; held-out seeds after all of them.
    assert [iteration_seed_start(on, k) for k in (1, 2, 3)] == [100, 112, 124]
    assert on.eval_seed_start() == 136
    assert _slots(iteration_schedule(on, 2, 2)) == [(0, 0, 112), (1, 1, 113), (2, 0, 114), (3, 1, 115)]


def test_refill_rounds_take_one_fresh_seed_per_missing_group_in_order() -> None:
    request = parse_run_request(DYNAMIC)
    # Iteration 2 collected its 4 groups and 1 has variation: round 1 takes 3 fresh seeds.
    first = refill_slots(request, 2, 2, collected=4, signal=1, round_=1)
    assert _slots(first) == [(4, 0, 116), (5, 1, 117), (6, 0, 118)]
    # Two of them had variation (3 of 4): round 2 takes the next seed.
    assert _slots(refill_slots(request, 2, 2, collected=7, signal=3, round_=2)) == [(7, 1, 119)]
    # Past the cap, or nothing missing: no round.
    assert refill_slots(request, 2, 2, collected=8, signal=3, round_=3) == []
    assert refill_slots(request, 2, 2, collected=4, signal=4, round_=1) == []
    # The worst case stays inside the iteration's reserved seeds [112, 124).
    worst = refill_slots(request, 2, 2, collected=8, signal=0, round_=2)
    assert [s.seed for s in worst] == [120, 121, 122, 123]
    # Off: never a refill.
    assert refill_slots(parse_run_request(TRAIN), 2, 2, collected=4, signal=0, round_=1) == []


def test_the_request_bounds_cover_the_reserved_seeds() -> None:
    with pytest.raises(InvalidRequest, match="overlap the training seeds"):
        # held-out seeds at 130 overlap iteration 3's refill seeds [124, 136)
        parse_run_request({**DYNAMIC, "environment_eval": {"groups": 5, "seed_start": 130}})
    parse_run_request({**TRAIN, "environment_eval": {"groups": 5, "seed_start": 130}})  # fine without refills
    big = {**DYNAMIC, "groups": 2048, "group_size": 4, "environment_eval": None}
    with pytest.raises(InvalidRequest, match="max_refill_rounds"):
        parse_run_request(big)  # 2048 × 3 × 4 rollouts in one iteration's bundle > 16384
    with pytest.raises(InvalidRequest, match="max_refill_rounds"):
        parse_run_request({**TRAIN, "training_config": {"dynamic_sampling": {"max_refill_rounds": 0}}})


def _record(**change: Any) -> dict[str, Any]:
    record = DynamicSamplingRecord(
        target_groups=4,
        max_refill_rounds=2,
        rounds=[
            RefillRound(round=1, group_indexes=[4, 5, 6], seeds=[116, 117, 118]),
            RefillRound(round=2, group_indexes=[7], seeds=[119]),
        ],
        signal_groups=4,
        capped=False,
    )
    return {**record.model_dump(mode="json"), **change}


def _fails(block: dict[str, Any], groups: int = 8) -> str:
    with pytest.raises(VerificationFailed) as info:
        check_dynamic_sampling(block, groups, 112, Where("summary.json"))
    return str(info.value)


def test_the_verifier_accepts_the_recorded_rounds_and_rejects_any_other() -> None:
    check_dynamic_sampling(_record(), 8, 112, Where("summary.json"))
    assert "must be seed_start + each group index" in _fails(
        _record(rounds=[_record()["rounds"][0], {"round": 2, "group_indexes": [7], "seeds": [120]}])
    )
    assert "must continue at group 7" in _fails(
        _record(rounds=[_record()["rounds"][0], {"round": 2, "group_indexes": [8], "seeds": [120]}])
    )
    assert "account for 8 groups; the bundle holds 9" in _fails(_record(), groups=9)
    assert "must be round 2" in _fails(
        _record(rounds=[_record()["rounds"][0], {"round": 3, "group_indexes": [7], "seeds": [119]}])
    )
    assert "the cap is 1" in _fails(_record(max_refill_rounds=1))
    assert "field dynamic_sampling.capped" in _fails(_record(signal_groups=3))
    assert "is missing" in _fails({k: v for k, v in _record().items() if k != "capped"})
