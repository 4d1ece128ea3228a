"""The online-RL rules of kiln.core.run_plan and kiln.core.contracts: seed plan, evaluation schedule,
staleness, chunks, the record chain, request validation and digest compatibility."""

from __future__ import annotations

import hashlib

import pytest

from kiln.core.contracts import parse_run_request
from kiln.core.request_digest import request_digest
from kiln.core.errors import InvalidRequest
from kiln.core.run_plan import (
    CHAIN_START,
    EvaluationPlan,
    behavior_lag,
    chunks,
    evaluates_after,
    extend_chain,
    group_schedule,
    iteration_schedule,
    should_continue_as_new,
)
from kiln.core.run_status import MAX_ITERATION_RECORDS, IterationStatus, RunStatus

pytestmark = pytest.mark.timeout(30)

BASE = {
    "kind": "train",
    "environment_urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
    "groups": 4,
    "group_size": 2,
    "seed_start": 10,
    "output_adapter": "a1",
}


def test_each_iteration_collects_fresh_seeds_and_held_out_seeds_follow_the_last() -> None:
    request = parse_run_request({**BASE, "iterations": 3, "environment_eval": {"groups": 5}})
    seeds = [[s.seed for s in iteration_schedule(request, k, 2)] for k in (1, 2, 3)]
    assert seeds == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]]
    # Iteration 1 is exactly a one-iteration run's schedule; group indexes restart per iteration.
    assert iteration_schedule(request, 1, 2) == group_schedule(10, 4, 2)
    assert [s.group_index for s in iteration_schedule(request, 3, 2)] == [0, 1, 2, 3]
    plan = EvaluationPlan.of(request, True)
    assert plan is not None and plan.seed_start == 22


def test_held_out_seeds_may_not_overlap_any_iteration() -> None:
    with pytest.raises(InvalidRequest, match=r"overlap the training seeds \[10, 22\)"):
        parse_run_request({**BASE, "iterations": 3, "environment_eval": {"groups": 5, "seed_start": 20}})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kind": "rollout", "output_adapter": None, "iterations": 2}, "need kind 'train'"),
        ({"eval_every": 2}, "eval_every needs environment_eval"),
        ({"max_staleness": 1}, "max_staleness 1 needs iterations >= 2"),
        ({"iterations": 1001}, "iterations"),
        ({"iterations": 0}, "iterations"),
        ({"max_staleness": 5, "iterations": 6}, "max_staleness: Input should be less than or equal to 4"),
    ],
)
def test_online_fields_are_validated(extra: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_run_request({**BASE, **extra})


def test_a_request_not_using_online_rl_digests_as_before() -> None:
    plain = parse_run_request(BASE)
    # The digest of this request before the online fields existed (computed on commit 8782f6d).
    assert request_digest(plain) == "sha256:5f225581baf49279bb2f41d15bc7bd751e6784a74e0366b3117bae6b605d65d7"
    explicit = parse_run_request({**BASE, "iterations": 1, "max_staleness": 0, "eval_every": None})
    assert request_digest(plain) == request_digest(explicit)
    assert request_digest(parse_run_request({**BASE, "iterations": 2})) != request_digest(plain)
    # Settings added later digest as before while at their defaults, and differently once used.
    assert request_digest(parse_run_request({**BASE, "context_policy": "end"})) == request_digest(plain)
    trained = parse_run_request({**BASE, "training_config": {"epochs": 2}})
    same = parse_run_request({**BASE, "training_config": {"epochs": 2, "entropy_coeff": 0.0, "overlong": "keep"}})
    assert request_digest(trained) == request_digest(same)
    assert request_digest(parse_run_request({**BASE, "training_config": {"epochs": 2, "entropy_coeff": 0.01}})) != \
        request_digest(trained)


def test_evaluation_schedule_and_staleness() -> None:
    request = parse_run_request({**BASE, "iterations": 5, "eval_every": 2, "environment_eval": {"groups": 3}})
    assert [k for k in range(1, 6) if evaluates_after(request, k)] == [2, 4, 5]
    no_eval = parse_run_request({**BASE, "iterations": 5})
    assert [k for k in range(1, 6) if evaluates_after(no_eval, k)] == []
    stale = parse_run_request({**BASE, "iterations": 4, "max_staleness": 1})
    assert [behavior_lag(stale, k) for k in (1, 2, 3, 4)] == [0, 1, 1, 1]
    deeper = parse_run_request({**BASE, "iterations": 4, "max_staleness": 2})
    assert [behavior_lag(deeper, k) for k in (1, 2, 3, 4)] == [0, 1, 2, 2]
    assert [behavior_lag(no_eval, k) for k in (1, 2, 3)] == [0, 0, 0]


def test_chunks_cut_large_collections_and_keep_order() -> None:
    slots = group_schedule(0, 600, 1)
    parts = chunks(slots, 256)
    assert [len(p) for p in parts] == [256, 256, 88]
    assert [s.seed for p in parts for s in p] == list(range(600))
    assert chunks(slots[:5], 256) == [slots[:5]]
    assert not should_continue_as_new(3999) and should_continue_as_new(4000)


def test_record_chain_is_sha256_over_the_previous_link_and_the_record() -> None:
    first = extend_chain(None, "sha256:" + "a" * 64)
    expected = hashlib.sha256(f"{CHAIN_START}\nsha256:{'a' * 64}".encode()).hexdigest()
    assert first == "sha256:" + expected
    assert extend_chain(first, "sha256:" + "b" * 64) != extend_chain(first, "sha256:" + "c" * 64)


def test_status_keeps_a_bounded_curve() -> None:
    status = RunStatus()
    for k in range(1, MAX_ITERATION_RECORDS + 21):
        status.record_iteration(IterationStatus(iteration=k, seed_start=k, behavior_adapter_sha256=None))
    assert len(status.iterations) == MAX_ITERATION_RECORDS
    assert status.iterations[0].iteration == 21 and status.iterations[-1].iteration == MAX_ITERATION_RECORDS + 20
    status.record_iteration(IterationStatus(iteration=MAX_ITERATION_RECORDS + 20, seed_start=0, behavior_adapter_sha256="x"))
    assert status.iterations[-1].behavior_adapter_sha256 == "x" and len(status.iterations) == MAX_ITERATION_RECORDS
