"""Worker roles: which activities each role's workers take, and the adapter LRU a sampler keeps."""

from __future__ import annotations

import inspect

import pytest

from activities.gpu import GpuActivities
from workers.factory import GPU_ROLES, TRAINING_ACTIVITIES
from workflows.names import train_task_queue
from workflows.options import OPTIONS as BY_ACTIVITY

OPTIONS = {activity.__name__: options for activity, options in BY_ACTIVITY.items()}  # by activity name


def test_training_has_its_own_queue_and_every_other_gpu_activity_samples() -> None:
    gpu = GpuActivities.__new__(GpuActivities)  # only its activity list: no runtime, no store
    names = {method.__name__ for method in gpu.all()}
    assert names == {"resolve_policy", "collect_group", "train_adapter", "post_evaluate", "world_model_gain"}
    assert TRAINING_ACTIVITIES == {"train_adapter"}
    assert {name for name in names if OPTIONS[name].queue == "train"} == {"train_adapter"}
    assert {OPTIONS[name].queue for name in names - TRAINING_ACTIVITIES} == {"gpu"}
    assert train_task_queue("kiln-gpu") == "kiln-gpu@train"
    assert train_task_queue("kiln-gpu.qwen3") == "kiln-gpu.qwen3@train"
    assert GPU_ROLES == ("gpu", "sampler", "trainer")


def test_a_sampler_keeps_more_adapters_than_a_run_samples_with_at_once() -> None:
    """An episode finishes under the adapter it began with. Whatever ``max_staleness`` (up to its
    cap), a run collects one iteration at a time (``kiln.core.stale_pipeline``), so at once it samples
    with at most three adapters: the collection's, and a paired evaluation's candidate and baseline;
    the runtime's LRU holds at least that many."""
    from kiln.core.contracts import RunRequest
    from kiln.core.policy.runtime import PolicyRuntime

    bounds = RunRequest.model_fields["max_staleness"].metadata
    largest = min(b.le for b in bounds if hasattr(b, "le"))
    held = inspect.signature(PolicyRuntime.load).parameters["max_adapters"].default
    assert largest == 4 and held >= 3


@pytest.mark.parametrize("role", ["sampler", "trainer", "gpu"])
def test_the_worker_entry_accepts_every_role(role: str) -> None:
    from workers.__main__ import USAGE

    assert role in USAGE.split("usage: python -m workers ", 1)[1].split("|")


def test_a_trainer_alone_trains_on_its_own_model_and_a_gpu_worker_borrows_the_runtime(tmp_path) -> None:
    from kiln.core.settings import Settings

    gpu = GpuActivities(Settings(home=tmp_path, device="cpu"), store=None, model_path=tmp_path)
    assert gpu.samples and gpu._train_launch() == (None, None)  # the runtime's model, in this process
    gpu.samples = False  # what workers.factory sets for `python -m workers trainer`
    launch, placement = gpu._train_launch()
    assert launch is None and (placement.device, placement.dtype) == ("cpu", "float32")
    ranks = GpuActivities(Settings(home=tmp_path, device="cpu", train_devices="2", train_collective_timeout_s=9),
                          store=None, model_path=tmp_path)
    launch, placement = ranks._train_launch()
    assert launch.devices == ("cpu", "cpu") and launch.collective_timeout_s == 9 and placement.device == "cpu"


@pytest.mark.timeout(30)
def test_the_control_role_registers_every_control_activity_once() -> None:
    from activities.control import ControlActivities

    control = ControlActivities.__new__(ControlActivities)  # only its activity list
    names = [method.__name__ for method in control.all()]
    assert sorted(names) == [
        "admit_run",
        "discover_environments",
        "enqueue_run",
        "evaluate_run",
        "index_groups",
        "publish_run",
        "publish_training",
        "revalidate_environments",
        "split_dataset",
        "store_iteration",
        "store_side_bundle",
    ]
    assert {name for name in names if OPTIONS[name].queue != "control"} == set()
