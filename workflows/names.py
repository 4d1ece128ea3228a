"""The type names of Kiln's workflows: what the API, the CLI and activities submit or signal.

Plain strings, no imports: a process that starts workflows by name (the API, the control
activities' update-with-start) imports this module and nothing else from ``workflows/``.
"""

WORKFLOW_NAME = "OpenEnvRunWorkflow"
TRAIN_DATASET_WORKFLOW = "KilnTrainDatasetWorkflow"
PREFLIGHT_WORKFLOW = "PreflightWorkflow"
QUEUE_WORKFLOW = "KilnRunQueue"
CHUNK_WORKFLOW = "KilnCollectChunkWorkflow"


def queue_workflow_id(control_task_queue: str) -> str:
    """The id of the one run-queue workflow serving a control task queue."""
    return f"kiln-run-queue-{control_task_queue}"
