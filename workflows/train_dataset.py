"""``KilnTrainDatasetWorkflow``: train an adapter from a saved rollouts JSONL (``kiln train grpo``).

split (validate the corpus, pin its behavior policy) → training (the same ``train_adapter``
activity as a live run, same on-policy proof) → publication (dataset, adapter, receipt; manifest
last). Status, failure and cancel mapping are those of the live run (``workflows.status``).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.control import ControlActivities
    from activities.gpu import GpuActivities
    from kiln.core.records import PublishResult, TrainInput, TrainResult
    from kiln.core.side_records import DatasetSplit, PublishTrainingInput, TrainDatasetInput
    from kiln.core.run_status import Progress, RunStatus
    from workflows.names import TRAIN_DATASET_WORKFLOW
    from workflows.options import ActivityCaller
    from workflows.status import StatusKeeper


@workflow.defn(name=TRAIN_DATASET_WORKFLOW)
class TrainDatasetWorkflow(StatusKeeper):
    def __init__(self) -> None:
        self._status = RunStatus(kind="train_dataset", phase="split")

    @workflow.query(description="The dataset-training run's status: phase, training, manifest, failure.")
    def status(self) -> RunStatus:
        return self._status

    @workflow.run
    async def run(self, inp: TrainDatasetInput) -> RunStatus:
        return await self._guarded(lambda: self._execute(inp))

    async def _execute(self, inp: TrainDatasetInput) -> None:
        run_id = self._status.run_id
        retried = self._status.record_retry
        call = ActivityCaller(control_queue=workflow.info().task_queue, on_retry=retried)
        split: DatasetSplit = await call(
            ControlActivities.split_dataset, inp.dataset, summary="validate the rollouts and split them into groups"
        )
        total = split.groups.count
        self._status.progress = Progress(groups_total=total, groups_completed=total)
        self._status.behavior_policy = split.behavior_policy
        self._enter("training")
        call = ActivityCaller(
            control_queue=workflow.info().task_queue,
            gpu_queue=split.gpu_task_queue,
            heartbeat=timedelta(seconds=split.heartbeat_timeout_s),
            on_retry=retried,
        )
        training: TrainResult = await call(
            GpuActivities.train_adapter,
            TrainInput(
                run_id=run_id,
                groups=split.groups,
                training_config=inp.training_config,
                output_adapter=inp.output_adapter,
                behavior_policy=split.behavior_policy,
                base_adapter=split.base_adapter,
                report_to=inp.report_to,
            ),
            summary=f"GRPO+ECHO training of {inp.output_adapter} from a saved dataset",
        )
        self._status.record_training(training)
        self._enter("publication")
        promote = inp.auto_load and training.trained
        published: PublishResult = await call(
            ControlActivities.publish_training,
            PublishTrainingInput(
                run_id=run_id,
                dataset=inp.dataset,
                output_adapter=inp.output_adapter,
                training=training,
                promote=promote,
            ),
            summary="publish adapter and receipt",
        )
        self._status.record_publication(published, promoted=promote)
