"""``KilnTrainDatasetWorkflow``: train an adapter from a saved rollouts JSONL (``kiln train grpo``).

split (validate the corpus, pin its behaviour policy) → train (the same ``train_adapter`` activity
as a live run, same on-policy proof) → publish (dataset, adapter, receipt; manifest last).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from kiln.records import (
        DatasetSplit,
        PublishResult,
        PublishTrainingInput,
        TrainDatasetInput,
        TrainInput,
        TrainResult,
    )
    from workflows import options
    from workflows.failures import failure_from, training_status

TRAIN_DATASET_WORKFLOW = "KilnTrainDatasetWorkflow"


@workflow.defn(name=TRAIN_DATASET_WORKFLOW)
class TrainDatasetWorkflow:
    def __init__(self) -> None:
        self._status: dict[str, Any] = {
            "schema": "kiln.run-status.v1",
            "kind": "train_dataset",
            "phase": "splitting",
            "state": "running",
            "progress": {"groups_completed": 0, "groups_total": 0, "rollouts_completed": 0, "rollouts_total": 0},
            "training": None,
            "manifest": None,
            "artifacts": [],
            "warnings": [],
            "failure": None,
        }

    @workflow.query(description="The dataset-training run's status: phase, training, manifest, failure.")
    def status(self) -> dict[str, Any]:
        return self._status

    @workflow.run
    async def run(self, inp: TrainDatasetInput) -> dict[str, Any]:
        run_id = workflow.info().workflow_id
        self._status["run_id"] = run_id
        try:
            await self._execute(run_id, inp)
        except (ActivityError, ApplicationError) as err:
            if is_cancelled_exception(err):
                self._status.update(state="cancelled", phase="cancelled")
                raise
            failure = failure_from(err, self._status["phase"])
            self._status.update(state="failed", phase="failed", failure=failure)
            raise ApplicationError(f"{failure['code']}: {failure['message']}", failure, type=failure["code"], non_retryable=True) from None
        except asyncio.CancelledError:
            self._status.update(state="cancelled", phase="cancelled")
            raise
        return self._status

    async def _execute(self, run_id: str, inp: TrainDatasetInput) -> None:
        control = workflow.info().task_queue
        split: DatasetSplit = await workflow.execute_activity(
            "split_dataset",
            inp.dataset,
            result_type=DatasetSplit,
            task_queue=control,
            schedule_to_close_timeout=options.PUBLISH_TIMEOUT,
            retry_policy=options.PUBLISH_RETRY,
            summary="validate the rollouts and split them into groups",
        )
        total = len(split.groups)
        self._status["progress"].update(groups_total=total, groups_completed=total)
        self._status["behavior_policy"] = split.behavior_policy
        self._status["phase"] = "training"
        gpu_queue = split.gpu_task_queue
        training: TrainResult = await workflow.execute_activity(
            "train_adapter",
            TrainInput(
                run_id=run_id,
                groups=split.groups,
                training_config=inp.training_config,
                output_adapter=inp.output_adapter,
                behavior_policy=split.behavior_policy,
                base_adapter=split.base_adapter,
            ),
            result_type=TrainResult,
            task_queue=gpu_queue,
            start_to_close_timeout=options.TRAIN_TIMEOUT,
            heartbeat_timeout=timedelta(seconds=split.heartbeat_timeout_s),
            retry_policy=options.TRAIN_RETRY,
            summary=f"GRPO+ECHO training of {inp.output_adapter} from a saved dataset",
        )
        self._status["training"] = training_status(training)
        self._status["warnings"].extend(training.selection.get("warnings", []))
        self._status["phase"] = "publishing"
        published: PublishResult = await workflow.execute_activity(
            "publish_training",
            PublishTrainingInput(
                run_id=run_id,
                dataset=inp.dataset,
                output_adapter=inp.output_adapter,
                training=training,
                promote=inp.auto_load and training.trained,
            ),
            result_type=PublishResult,
            task_queue=control,
            schedule_to_close_timeout=options.PUBLISH_TIMEOUT,
            retry_policy=options.PUBLISH_RETRY,
            summary="publish adapter and receipt",
        )
        self._status["manifest"] = {"uri": published.manifest_uri, "sha256": published.manifest_sha256}
        self._status["artifacts"] = [a.model_dump() for a in published.artifacts]
        self._status["promoted"] = inp.auto_load and training.trained
        self._status.update(state="completed", phase="completed")
