"""The names of Kiln's workflows and their search-attribute keys: what the API, the CLI and
activities submit, signal, or query Temporal's visibility store by.

No workflow code: a process that starts or lists workflows by name (the API, the control
activities' update-with-start) imports this module and nothing else from ``workflows/``. The
attribute names themselves live in ``kiln.core.search_attributes`` (the dev server registers them).
"""

from temporalio.common import SearchAttributeKey

from kiln.core import search_attributes as _attributes

WORKFLOW_NAME = "OpenEnvRunWorkflow"
TRAIN_DATASET_WORKFLOW = "KilnTrainDatasetWorkflow"
PREFLIGHT_WORKFLOW = "PreflightWorkflow"
QUEUE_WORKFLOW = "KilnRunQueue"
CHUNK_WORKFLOW = "KilnCollectChunkWorkflow"


# Training runs on its own task queue beside each gpu queue (workers `trainer` and `gpu` poll it;
# `sampler` and `gpu` poll the gpu queue itself): docs/deploying.md "Worker roles".
TRAIN_QUEUE_PATCH = "kiln-train-queue"


def train_task_queue(gpu_task_queue: str) -> str:
    """The trainers' task queue of a gpu (sampler) task queue: ``<gpu queue>@train``."""
    return f"{gpu_task_queue}@train"


def queue_workflow_id(control_task_queue: str) -> str:
    """The id of the one run-queue workflow serving a control task queue."""
    return f"kiln-run-queue-{control_task_queue}"


# The typed keys of Kiln's search attributes: the workflows set them, the API lists runs by them.
KILN_PHASE = SearchAttributeKey.for_keyword(_attributes.PHASE)
KILN_STATUS = SearchAttributeKey.for_keyword(_attributes.STATUS)
KILN_ENVIRONMENT = SearchAttributeKey.for_keyword(_attributes.ENVIRONMENT)
KILN_OUTPUT_ADAPTER = SearchAttributeKey.for_keyword(_attributes.OUTPUT_ADAPTER)
KILN_RUN_KIND = SearchAttributeKey.for_keyword(_attributes.RUN_KIND)
