"""The records of the side workflows: the FIFO run queue, training preflight, and training from a
saved rollouts dataset (``kiln train grpo``). The run's own stage records are ``kiln.core.records``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.core.records import ActivityResult, AdapterRef, GroupSet, Record, StoredObject, TrainResult
from kiln.core.training_config import TrainingConfig


class DatasetSplit(ActivityResult):
    groups: GroupSet
    behavior_policy: dict[str, Any]
    base_adapter: AdapterRef | None = None
    gpu_task_queue: str
    heartbeat_timeout_s: float = 30.0


class TrainDatasetInput(Record):
    """A training run from a saved rollouts JSONL (``kiln train grpo``)."""

    dataset: StoredObject
    output_adapter: str
    training_config: TrainingConfig = Field(default_factory=TrainingConfig)
    auto_load: bool = True
    report_to: Literal["none", "tensorboard", "trackio", "wandb"] = "none"  # as on a live run


class PublishTrainingInput(Record):
    run_id: str
    dataset: StoredObject
    output_adapter: str
    training: TrainResult
    promote: bool


class QueueState(Record):
    """The FIFO run queue's state (carried across continue-as-new)."""

    max_active_runs: int = 4
    max_tracked_runs: int = 128
    sequence: int = 0
    active: list[str] = Field(default_factory=list)
    waiting: list[str] = Field(default_factory=list)
    sequences: dict[str, int] = Field(default_factory=dict)


class SlotRequest(Record):
    run_id: str


class SlotReply(ActivityResult):
    sequence: int
    position: int  # 0 = active (slot granted), n = n-th in line


class PreflightInput(Record):
    """Which behavior adapter to resolve (None = base model) and where the gpu workers listen."""

    adapter: str | None = None
    gpu_task_queue: str


class PreflightResult(Record):
    behavior_policy: dict[str, Any]
