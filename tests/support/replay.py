"""The Replayer HEAD's control workers amount to: every workflow type, the workers' data converter
and sandbox. A history that replays here replays on this release's control workers."""

from __future__ import annotations

from temporalio.worker import Replayer

from workers.converter import kiln_data_converter
from workers.sandbox import workflow_runner
from workflows.chunk import CollectChunkWorkflow
from workflows.openenv_run import OpenEnvRunWorkflow
from workflows.preflight import PreflightWorkflow
from workflows.run_queue import RunQueueWorkflow
from workflows.train_dataset import TrainDatasetWorkflow


def head_replayer() -> Replayer:
    return Replayer(
        workflows=[OpenEnvRunWorkflow, CollectChunkWorkflow, RunQueueWorkflow, PreflightWorkflow, TrainDatasetWorkflow],
        data_converter=kiln_data_converter,  # the workers' converter
        workflow_runner=workflow_runner(),  # the workers' sandbox
    )
