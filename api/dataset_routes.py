"""Training from a saved rollouts file: upload the JSONL, then start a dataset-training run.

``PUT /v1/datasets`` stores the raw bytes content-addressed (≤ 256 MiB) and answers the reference;
``POST /v1/train/grpo`` starts ``KilnTrainDatasetWorkflow`` on that reference (202 + run status).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from api.services import Services, services
from kiln.contracts import TrainingConfig, check_adapter_name
from kiln.errors import InvalidRequest
from kiln.records import StoredObject, TrainDatasetInput
from workflows.names import TRAIN_DATASET_WORKFLOW

UPLOAD_PATH = "/v1/datasets"
MAX_DATASET_BYTES = 256 * 1024 * 1024

router = APIRouter(tags=["training"])


class TrainFromDatasetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: StoredObject
    output_adapter: str
    training_config: TrainingConfig = Field(default_factory=TrainingConfig)
    auto_load: bool = True


@router.put(UPLOAD_PATH, status_code=201)
async def upload_dataset(request: Request, svc: Services = Depends(services)) -> dict[str, Any]:
    """Store a rollouts JSONL (raw body) content-addressed; answers ``{uri, sha256, bytes}``."""
    body = await request.body()
    if not body:
        raise InvalidRequest("the dataset body is empty: send the rollouts JSONL bytes")
    store = svc.artifacts().store
    ref = await asyncio.to_thread(store.put_blob, body)
    return {"uri": ref.uri, "sha256": ref.sha256, "bytes": ref.bytes}


@router.post("/v1/train/grpo", status_code=202)
async def train_from_dataset(body: TrainFromDatasetRequest, svc: Services = Depends(services)) -> JSONResponse:
    """Start a GRPO+ECHO training run from an uploaded dataset (same activity as a live run)."""
    try:
        check_adapter_name(body.output_adapter, "output_adapter")
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    runs = await svc.runs()
    run_id = str(uuid.uuid4())
    await runs.client.start_workflow(
        TRAIN_DATASET_WORKFLOW,
        TrainDatasetInput(
            dataset=body.dataset,
            output_adapter=body.output_adapter,
            training_config=body.training_config,
            auto_load=body.auto_load,
        ),
        id=run_id,
        task_queue=svc.settings.control_task_queue,
        static_summary=f"train {body.output_adapter} from {body.dataset.sha256}",
    )
    return JSONResponse(status_code=202, content=await runs.status(run_id))
