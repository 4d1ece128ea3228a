"""Run status warnings (issue 25): in a run of several iterations every warning says which
iteration it came from (``iteration k:``); under ``reset_determinism: warn`` every group whose
candidates saw different resets adds one warning naming the fields."""

from __future__ import annotations

from kiln.core.records import TrainResult
from kiln.core.run_status import RunStatus, training_figures

SKIPPED = "group 0 has no reward variation (every candidate returned 1.0); skipped"


def _skipped_training() -> TrainResult:
    return TrainResult(trained=False, selection={"warnings": [SKIPPED]}, skip_reason="every seed group was skipped")


def test_training_warnings_of_a_multi_iteration_run_name_their_iteration() -> None:
    status = RunStatus(iterations_total=3, iteration=2)
    status.record_training(_skipped_training())
    assert status.warnings == [f"iteration 2: {SKIPPED}"]
    status.iteration = 3
    status.record_training(_skipped_training())
    assert status.warnings[-1] == f"iteration 3: {SKIPPED}"


def test_a_one_iteration_run_keeps_its_warnings_as_they_are() -> None:
    status = RunStatus(iterations_total=1, iteration=1)
    status.record_training(_skipped_training())
    assert status.warnings == [SKIPPED]


def test_reset_differences_name_the_group_and_the_fields() -> None:
    from kiln.core.run_status import reset_warning

    fields = ["reset_observation.observation.side", "reset_observation.observation.turn"]
    assert reset_warning("group", 3, fields) == (
        "group 3: candidates saw different resets in reset_observation.observation.side, "
        "reset_observation.observation.turn (reset_determinism: warn)"
    )
    assert reset_warning("eval baseline", 0, fields[:1]).startswith("eval baseline group 0: candidates saw")
    many = [f"reset_observation.f{i}" for i in range(10)]
    assert reset_warning("group", 1, many).endswith("reset_observation.f7 and 2 more (reset_determinism: warn)")
    # Collected for iteration 4 (perhaps while iteration 3 trains): the message names iteration 4,
    # and the status keeps that, never the iteration in progress.
    status = RunStatus(iterations_total=5, iteration=3)
    status.warn(reset_warning("iteration 4 group", 7, fields[:1]))
    status.warn(reset_warning("eval candidate", 2, fields[:1]))
    assert status.warnings == [
        "iteration 4: group 7: candidates saw different resets in reset_observation.observation.side "
        "(reset_determinism: warn)",
        "iteration 3: eval candidate group 2: candidates saw different resets in "
        "reset_observation.observation.side (reset_determinism: warn)",
    ]


def _trained(kl_to_base: float | None) -> TrainResult:
    return TrainResult(trained=True, steps=2, selection={}, kl_to_base=kl_to_base)


def test_a_training_far_from_the_base_model_warns_with_what_to_change() -> None:
    from kiln.core.run_status import KL_TO_BASE_WARN_NATS

    status = RunStatus(iterations_total=3, iteration=1)
    status.record_training(_trained(4.14))  # the figure, after one iteration
    assert status.warnings == [
        "iteration 1: the trained adapter is 4.14 nats per action token from the base model (KL to base "
        "above 1): the policy moved far in one training; lower training_config.learning_rate or epochs, "
        "set training_config.target_kl to end the training early, or add a kl_coeff penalty"
    ]
    quiet = RunStatus(iterations_total=1, iteration=1)
    for kl in (None, 0.25, KL_TO_BASE_WARN_NATS):  # unknown, small, exactly at the threshold
        quiet.record_training(_trained(kl))
    assert quiet.warnings == []


def test_the_training_block_holds_the_results_own_figures_and_nothing_else() -> None:
    status = RunStatus()
    status.record_training(
        TrainResult(trained=True, selection={"warnings": []}, adapter_sha256="ab" * 32, steps=4, final_loss=0.25, kl=0.5)
    )
    assert status.training is not None
    assert status.training.model_dump() == {
        "trained": True,
        "steps": 4,
        "final_loss": 0.25,
        "adapter_sha256": "ab" * 32,
        "selection": {"warnings": []},
        "skip_reason": None,
    }


def test_an_iterations_training_figures_are_named_as_status_and_metrics_name_them() -> None:
    trained = TrainResult(
        trained=True, selection={}, steps=3, final_loss=0.125, kl=0.25, kl_to_previous=0.5, kl_to_base=0.75,
        early_stop_step=2, adapter_sha256="cd" * 32,
    )
    assert training_figures(trained) == {
        "trained": True, "steps": 3, "loss": 0.125, "kl": 0.25, "kl_to_previous": 0.5, "kl_to_base": 0.75,
        "early_stop_step": 2, "adapter_sha256": "cd" * 32,
    }
    assert training_figures(None) == {
        "trained": False, "steps": 0, "loss": None, "kl": None, "kl_to_previous": None, "kl_to_base": None,
        "early_stop_step": None, "adapter_sha256": None,
    }
