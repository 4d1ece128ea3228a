"""The typed bodies of the API's answers other than runs (``kiln.core.run_view`` has those).

Each route declares one of these as its ``response_model``, so the OpenAPI document describes
every answer, and ``kiln.client`` parses the same models. Bodies that carry a document Kiln does
not own (an environment's ``/schema``, a task catalog page, a metric event) keep it as a JSON
object inside a typed envelope. Pure pydantic.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.artifacts.manifest import MANIFEST_SCHEMA
from kiln.core.openenv.tasks import TASK_CATALOG_SCHEMA
from kiln.core.run_status import ArtifactStatus
from kiln.core.telemetry.live import METRICS_SCHEMA

INSPECTION_SCHEMA = "kiln.openenv-inspection.v1"
PREFLIGHT_SCHEMA = "kiln.openenv-training-preflight.v1"


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Health(_Answer):
    """``GET /healthz``: 200 while the API answers; how each component is."""

    status: Literal["ok", "degraded"] = Field(
        default="ok", description="ok when every component is running and Temporal is reachable, else degraded."
    )
    components: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Each child kiln serve supervises (state, restarts, last exit) and temporal's "
        "connection (reachable / unreachable) as this API sees it now.",
    )


class EnvironmentInspection(_Answer):
    """One environment's discovery: its identity (name, digests, capabilities) and raw schema."""

    identity: dict[str, Any] = Field(description="Identity: name, base URL, digests, capabilities.")
    schema_: dict[str, Any] = Field(alias="schema", description="The environment's `/schema` document.")


class Inspections(_Answer):
    """``POST /v1/openenv/inspect``."""

    schema_: str = Field(default=INSPECTION_SCHEMA, alias="schema")
    environments: list[EnvironmentInspection]


class TaskCatalogPage(_Answer):
    base_url: str
    catalog: dict[str, Any] = Field(
        description="`{environment_name, task_api, splits[, selected_split, num_tasks, start, stop], tasks}`"
    )


class TaskCatalogs(_Answer):
    """``POST /v1/openenv/tasks``: one page of each environment's task catalog."""

    schema_: str = Field(default=TASK_CATALOG_SCHEMA, alias="schema")
    catalogs: list[TaskCatalogPage]


class PreflightReceipt(_Answer):
    """``POST /v1/openenv/training/preflight``: the sealed training contract."""

    schema_: str = Field(default=PREFLIGHT_SCHEMA, alias="schema")
    contract: dict[str, Any] = Field(description="The sealed `TrainingContract` (JSON).")
    effective_config: dict[str, Any] = Field(description="The `TrainingConfig` with every default filled in.")
    behavior_policy: dict[str, Any] = Field(description="The behaviour policy's identity, from a gpu worker.")
    auto_load: bool
    checked_unix_ms: int
    capacity_reserved: bool = False


class RunMetrics(_Answer):
    """``GET /v1/openenv/runs/{id}/metrics``: the live metric events so far."""

    schema_: str = Field(default=METRICS_SCHEMA, alias="schema")
    run_id: str
    events: list[dict[str, Any]] = Field(
        description="Group events (reward curve), training steps and online-RL iteration rows."
    )


class EpisodePage(_Answer):
    """``GET /v1/openenv/runs/{id}/episodes``: ``limit`` sampled episodes from ``offset``."""

    total: int
    offset: int
    limit: int
    episodes: list[dict[str, Any]] = Field(
        description="One object per episode: group, candidate, seed, reset observation, return, "
        "termination, turns (reasoning, action, observation, reward)."
    )


class ManifestArtifact(ArtifactStatus):
    """One published artifact: what run status lists, plus its media type."""

    media_type: str


class RunManifest(BaseModel):
    """``GET /v1/openenv/runs/{id}/artifacts``: the run's manifest, byte for byte as published
    (the run's own top-level fields, such as digests of its inputs, are kept)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    schema_: str = Field(default=MANIFEST_SCHEMA, alias="schema")
    run_id: str
    artifacts: list[ManifestArtifact]


class DatasetUploaded(_Answer):
    """``PUT /v1/datasets``: the stored dataset's reference (send it back to ``/v1/train/grpo``)."""

    uri: str
    sha256: str
    bytes: int


__all__ = [
    "DatasetUploaded",
    "EnvironmentInspection",
    "EpisodePage",
    "Health",
    "Inspections",
    "ManifestArtifact",
    "PreflightReceipt",
    "RunManifest",
    "RunMetrics",
    "TaskCatalogPage",
    "TaskCatalogs",
]
