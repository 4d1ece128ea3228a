"""Training from a saved rollouts file: upload the JSONL, then start a dataset-training run.

``PUT /v1/datasets`` stores the raw bytes content-addressed (≤ 256 MiB) and answers the reference;
``POST /v1/train/grpo`` starts ``KilnTrainDatasetWorkflow`` on that reference (202 + run status).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from api.run_routes import view_response
from api.runs import run_id_for_key
from api.services import Services, services
from kiln.api_models import DatasetUploaded
from kiln.core.artifacts.store import BLOB_PREFIX
from kiln.core.canonical import digest_json
from kiln.core.request_fields import check_adapter_name
from kiln.core.training_config import TrainingConfig
from kiln.core.errors import ArtifactNotFound, InvalidDatasetRef, InvalidRequest
from kiln.core.records import StoredObject
from kiln.core.side_records import TrainDatasetInput
from kiln.core.run_view import RunView
from kiln.core.stages.dataset import FIRST_LINE_CHECKED_BYTES, check_first_line
from workflows.names import TRAIN_DATASET_WORKFLOW

UPLOAD_PATH = "/v1/datasets"
MAX_DATASET_BYTES = 256 * 1024 * 1024
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_IDEMPOTENCY_SCOPE = "train/grpo:"

router = APIRouter(tags=["training"])


class DatasetRef(BaseModel):
    """A dataset uploaded with ``PUT /v1/datasets``: exactly the reference that call answered."""

    model_config = ConfigDict(extra="forbid", strict=True)

    uri: str = Field(max_length=512, description="s3://<kiln bucket>/blobs/sha256/<sha256>")
    sha256: str = Field(max_length=80, description="sha256:<64 lowercase hex>; the uri ends with the same hex")
    bytes: int = Field(ge=1, le=MAX_DATASET_BYTES, description="size in bytes (<= 256 MiB)")


class TrainFromDatasetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    dataset: DatasetRef
    output_adapter: str
    training_config: TrainingConfig = Field(default_factory=TrainingConfig)
    auto_load: bool = True
    report_to: Literal["none", "tensorboard", "trackio", "wandb"] = "none"
    idempotency_key: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._:-]{1,128}$",
        description="Retrying with the same key and body answers the existing run (200).",
    )


def check_dataset_ref(ref: DatasetRef, bucket: str) -> StoredObject:
    """The ref as a ``StoredObject`` when it names a blob in Kiln's own bucket, else 400."""
    hex_digest = ref.sha256.removeprefix("sha256:")
    if not ref.sha256.startswith("sha256:") or not _HEX64.match(hex_digest):
        raise InvalidDatasetRef(
            "dataset.sha256 must be 'sha256:' + 64 lowercase hex digits",
            hint="send the reference PUT /v1/datasets answered",
        )
    expected = f"s3://{bucket}/{BLOB_PREFIX}"
    if ref.uri != expected + hex_digest:
        raise InvalidDatasetRef(
            f"dataset.uri must be {expected}<hex> with the same digest as dataset.sha256",
            hint="upload the JSONL with PUT /v1/datasets (or `kiln train grpo --input`) and send "
            "the reference it answers; other buckets and schemes are never read",
        )
    return StoredObject(uri=ref.uri, sha256=ref.sha256, bytes=ref.bytes)


def check_stored_dataset(store: Any, dataset: StoredObject) -> None:
    """The referenced dataset exists with the size the reference gives, and its first line is a
    rollouts group (400 otherwise, before any run starts)."""
    try:
        size, head = store.read_head(dataset.ref(), FIRST_LINE_CHECKED_BYTES)
    except ArtifactNotFound:
        raise InvalidDatasetRef(
            f"dataset.uri {dataset.uri} names no stored dataset",
            hint="upload the JSONL with PUT /v1/datasets (or `kiln train grpo "
            "--input`) and send the reference it answers",
        ) from None
    if size != dataset.bytes:
        raise InvalidDatasetRef(
            f"dataset.bytes is {dataset.bytes}, but the stored dataset holds {size} bytes",
            hint="send the reference PUT /v1/datasets answered, unchanged",
        )
    check_first_line(head, size)


@router.put(
    UPLOAD_PATH,
    status_code=201,
    response_model=DatasetUploaded,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def upload_dataset(request: Request, svc: Services = Depends(services)) -> DatasetUploaded:
    """Store a rollouts JSONL (raw body) content-addressed; answers ``{uri, sha256, bytes}``."""
    body = await request.body()
    if not body:
        raise InvalidRequest("the dataset body is empty: send the rollouts JSONL bytes")
    check_first_line(body[:FIRST_LINE_CHECKED_BYTES], len(body))
    store = svc.artifacts().store
    ref = await asyncio.to_thread(store.put_blob, body)
    return DatasetUploaded(uri=ref.uri, sha256=ref.sha256, bytes=ref.bytes)


@router.post(
    "/v1/train/grpo",
    status_code=202,
    response_model=RunView,
    responses={200: {"description": "idempotent replay", "model": RunView}},
)
async def train_from_dataset(body: TrainFromDatasetRequest, svc: Services = Depends(services)) -> JSONResponse:
    """Start a GRPO+ECHO training run from an uploaded dataset (same activity as a live run)."""
    try:
        check_adapter_name(body.output_adapter, "output_adapter")
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    dataset = check_dataset_ref(body.dataset, svc.settings.s3_bucket)
    await asyncio.to_thread(check_stored_dataset, svc.artifacts().store, dataset)
    runs = await svc.runs()
    view, created = await runs.start_once(
        TRAIN_DATASET_WORKFLOW,
        TrainDatasetInput(
            dataset=dataset,
            output_adapter=body.output_adapter,
            training_config=body.training_config,
            auto_load=body.auto_load,
            report_to=body.report_to,
        ),
        run_id=run_id_for_key(body.idempotency_key, _IDEMPOTENCY_SCOPE),
        digest=digest_json(body.model_dump(mode="json", by_alias=True)),
        idempotency_key=body.idempotency_key,
        summary=f"train {body.output_adapter} from {dataset.sha256}",
    )
    return view_response(view, created)
