"""The rules the run workflow sequences (kiln.core.run_plan) and the run status it keeps (kiln.core.run_status)."""

from __future__ import annotations

import json

import pytest
from pydantic_core import to_json

from kiln.core.contracts import EpisodeSettings, parse_run_request
from kiln.core.run_plan import BundleSpec, EvaluationPlan, group_schedule, promotion_decision
from kiln.core.run_status import Failure, Progress, RunStatus

pytestmark = pytest.mark.timeout(30)

TRAIN = {
    "kind": "train",
    "environment_urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
    "groups": 6,
    "group_size": 3,
    "seed_start": 100,
    "concurrency": 8,
    "output_adapter": "a1",
    "environment_eval": {"groups": 4, "group_size": 2},
}


def test_group_schedule_round_robins_environments_over_consecutive_seeds() -> None:
    slots = group_schedule(100, 5, 2)
    assert [(s.group_index, s.environment_index, s.seed) for s in slots] == [
        (0, 0, 100), (1, 1, 101), (2, 0, 102), (3, 1, 103), (4, 0, 104),
    ]


def test_evaluation_plan_defaults_to_the_seeds_after_training() -> None:
    plan = EvaluationPlan.of(parse_run_request(TRAIN), True)
    assert plan is not None
    assert (plan.seed_start, plan.groups, plan.settings.group_size) == (106, 4, 2)
    # Never more concurrent sessions than candidates in a group.
    assert plan.settings.concurrency == 2
    assert [s.seed for s in plan.schedule(2)] == [106, 107, 108, 109]
    explicit = parse_run_request({**TRAIN, "environment_eval": {"groups": 4, "group_size": 2, "seed_start": 500}})
    assert EvaluationPlan.of(explicit, True).seed_start == 500  # type: ignore[union-attr]
    assert EvaluationPlan.of(parse_run_request({**TRAIN, "environment_eval": None}), True) is None


def test_bundle_specs_of_the_run_and_of_each_side() -> None:
    request = parse_run_request(TRAIN)
    run = BundleSpec.of_run(request, True)
    assert run.adapter is None and run.seed_start == 100
    assert run.settings == EpisodeSettings.from_request(request, thinking=True)
    assert run.settings.group_size == 3 and run.settings.concurrency == 8 and run.settings.thinking is True
    side = EvaluationPlan.of(request, True).bundle("a1")  # type: ignore[union-attr]
    assert (side.adapter, side.seed_start, side.settings.group_size) == ("a1", 106, 2)


def test_episode_settings_share_the_request_fields_and_defaults() -> None:
    request = parse_run_request({"environment_urls": ["http://127.0.0.1:1"]})
    assert request.thinking == "auto"  # resolved against the model's template by the gpu worker
    settings = request.episode_settings(True)
    assert settings == EpisodeSettings()  # one default per field, shared by inheritance
    expected = {name: getattr(request, name) for name in EpisodeSettings.model_fields}
    assert settings.model_dump() == {**expected, "thinking": True}


def test_episode_settings_carry_the_resolved_thinking_bool() -> None:
    request = parse_run_request({"environment_urls": ["http://127.0.0.1:1"], "thinking_budget_tokens": 64})
    with pytest.raises(ValueError, match="resolved"):
        request.episode_settings()  # "auto" cannot reach collection unresolved
    assert request.episode_settings(True).thinking_budget_tokens == 64
    off = request.episode_settings(False)
    assert (off.thinking, off.thinking_budget_tokens) == (False, None)  # no reasoning, no budget
    assert BundleSpec.of_run(request, False).settings == off
    explicit = parse_run_request({"environment_urls": ["http://127.0.0.1:1"], "thinking": False})
    assert explicit.episode_settings().thinking is False  # an explicit bool needs no resolution


@pytest.mark.parametrize(
    ("changes", "trained", "decision", "post", "expected"),
    [
        ({}, True, None, None, True),
        ({}, False, None, None, False),
        ({"auto_load": False}, True, None, None, False),
        ({}, True, "passed", None, True),
        ({}, True, "diagnostic", None, True),
        ({}, True, "failed", None, False),
        ({"environment_eval": None, "post_eval": {"suite": "s", "min_accuracy": 0.5}}, True, None, "promoted", True),
        ({"environment_eval": None, "post_eval": {"suite": "s", "min_accuracy": 0.5}}, True, None, "rejected", False),
        ({"environment_eval": None, "post_eval": {"suite": "s"}}, True, None, "rejected", True),
    ],
)
def test_promotion_decision(changes: dict, trained: bool, decision: str | None, post: str | None, expected: bool) -> None:
    request = parse_run_request({**TRAIN, **changes})
    assert promotion_decision(
        request, trained=trained, evaluation_decision=decision, post_eval_outcome=post
    ) is expected


def test_run_status_keeps_the_v1_json_keys_and_folds_progress() -> None:
    status = RunStatus(run_id="r1")
    status.progress = Progress.planned(2, 3)
    status.progress.add_group(3.0, 3, latency_ms=1.5, tokens=10)
    status.progress.add_group(3.0, 3, latency_ms=2.25, tokens=5, group_index=1, worker="w@gpu-2", attempt=2)
    document = json.loads(to_json(status))
    assert document["schema"] == "kiln.run-status.v1"
    assert document["progress"] == {
        "groups_completed": 2, "groups_total": 2, "rollouts_completed": 6, "rollouts_total": 6,
        "mean_return": 1.0, "model_latency_ms": 3.75, "model_tokens": 15,
        "groups": [{"group_index": 1, "worker": "w@gpu-2", "attempt": 2}],
    }
    assert {"phase", "state", "failure", "admission", "interruptions", "environment_evaluation"} <= set(document)


def test_endings_name_the_stage() -> None:
    queued = RunStatus()
    queued.enter("queue")
    queued.cancel()
    assert (queued.state, queued.phase, queued.cancelled_stage) == ("cancelled", "cancelled", "queue")
    assert queued.warnings == ["cancelled while queued (no environment was contacted)"]
    training = RunStatus()
    training.enter("training")
    assert training.stage() == "training"
    training.fail(Failure(code="training_failed", message="x", stage=training.stage()))
    assert (training.state, training.phase, training.failure.stage) == ("failed", "failed", "training")  # type: ignore[union-attr]


def test_typed_records_cross_the_data_converter_unchanged() -> None:
    """What admission returns is what the workflow and the activities receive (aliases included)."""
    from temporalio.contrib.pydantic import pydantic_data_converter

    from kiln.core.records import AdmissionResult, GroupSet, TrainInput

    request = parse_run_request({**TRAIN, "training_config": {"learning_rate": 3e-4, "echo": {"lambda": 0.2}}})
    admitted = AdmissionResult(
        request=request, request_sha256="sha256:x", reset_templates=[{}, {}], reset_plan_sha256="sha256:y",
        gpu_task_queue="g", queue_workflow_id="q",
    )
    converter = pydantic_data_converter.payload_converter
    [payload] = converter.to_payloads([admitted])
    [back] = converter.from_payloads([payload], [AdmissionResult])
    assert back == admitted
    assert back.request.effective_training_config().learning_rate == 3e-4
    assert back.request.effective_training_config().echo.lambda_ == 0.2  # type: ignore[union-attr]
    train = TrainInput(run_id="r", groups=GroupSet(indexes=[], count=0), training_config=request.effective_training_config(),
                       output_adapter="a1", behavior_policy={})
    [payload] = converter.to_payloads([train])
    assert converter.from_payloads([payload], [TrainInput])[0] == train


def test_a_run_admitted_before_run_parallel_groups_existed_keeps_four_groups_in_flight() -> None:
    """Histories recorded before the field existed carry no ``parallel_groups``: read back, the
    admission result and the collection plan say 4, the gate those runs were recorded with."""
    from pydantic import ValidationError

    from kiln.core.records import AdmissionResult, CollectionPlan
    from kiln.core.settings import Settings

    admission = AdmissionResult.model_validate({
        "request": parse_run_request({"kind": "rollout", "environment_urls": ["http://127.0.0.1:1"]}).model_dump(),
        "request_sha256": "0" * 64, "reset_templates": [{}], "reset_plan_sha256": "0" * 64,
        "gpu_task_queue": "kiln-gpu", "queue_workflow_id": "kiln-run-queue",
    })
    assert admission.parallel_groups == 4
    plan = CollectionPlan.model_validate({
        "run_id": "r", "label": "group", "slots": [], "environments": [], "reset_templates": [],
        "settings": EpisodeSettings().model_dump(), "behavior_policy": {}, "on_interrupt": "resume",
        "capacity_wait_seconds": 0, "control_queue": "c", "gpu_queue": "g", "heartbeat_s": 30.0,
    })
    assert plan.parallel_groups == 4 and plan.chunk([]).parallel_groups == 4
    assert Settings(run_parallel_groups=32).parallel_groups_per_run == 32
    for bad in (0, 257):
        with pytest.raises(ValidationError, match="run_parallel_groups"):
            Settings(run_parallel_groups=bad)


def test_groups_in_flight_per_run_default_to_the_engines_size() -> None:
    """Unset, a run keeps 4 groups in flight with hf and, with vllm, as many as a gpu worker runs
    at once (capped at 256); a set value wins on either engine."""
    from kiln.core.settings import Settings

    assert Settings(engine="hf", run_parallel_groups=None).parallel_groups_per_run == 4
    assert Settings(engine="vllm", run_parallel_groups=None).parallel_groups_per_run == 32
    assert Settings(engine="vllm", run_parallel_groups=None,
                    vllm_max_concurrent_activities=12).parallel_groups_per_run == 12
    assert Settings(engine="vllm", run_parallel_groups=None,
                    vllm_max_concurrent_activities=1000).parallel_groups_per_run == 256
    assert Settings(engine="vllm", run_parallel_groups=6).parallel_groups_per_run == 6
    assert Settings(engine="hf", run_parallel_groups=6).parallel_groups_per_run == 6
