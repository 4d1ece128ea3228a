"""The small records each run stage takes and returns (they cross Temporal, so stay small).

Anything large — inspections, group documents, adapters, bundles — lives in S3 and crosses as a
``StoredObject`` reference ``{uri, sha256, bytes}``. No record here may approach 256 KiB.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StoredObject(Record):
    """A content-addressed S3 object."""

    uri: str
    sha256: str
    bytes: int


class AdmissionInput(Record):
    run_id: str
    request: dict[str, Any]


class AdmissionResult(Record):
    request: dict[str, Any]
    request_sha256: str
    reset_templates: list[dict[str, Any]]
    reset_plan_sha256: str
    gpu_task_queue: str


class DiscoveryInput(Record):
    run_id: str
    environment_urls: list[str]
    credential_ids: list[str | None] = Field(default_factory=list)


class EnvironmentRef(Record):
    """One discovered environment: its identity digests and the stored inspection."""

    base_url: str
    name: str
    discovery_sha256: str | None
    schema_sha256: str
    inspection: StoredObject


class DiscoveryResult(Record):
    environments: list[EnvironmentRef]


class RevalidationInput(Record):
    run_id: str
    environments: list[EnvironmentRef]
    credential_ids: list[str | None] = Field(default_factory=list)


class PolicyInput(Record):
    adapter: str | None = None


class PolicyResult(Record):
    behavior_policy: dict[str, Any]


class CollectGroupInput(Record):
    run_id: str
    group_index: int
    environment_index: int
    seed: int
    reset_payload: dict[str, Any]
    inspection: StoredObject
    settings: dict[str, Any]
    behavior_policy: dict[str, Any]
    adapter: str | None = None
    credential_id: str | None = None


class CollectGroupResult(Record):
    group_index: int
    group: StoredObject
    returns: list[float]
    steps: int
    terminations: dict[str, int]
    model_tokens: int
    model_latency_ms: float
    attempt: int = 1


class TrainInput(Record):
    run_id: str
    groups: list[StoredObject]
    training_config: dict[str, Any]
    output_adapter: str
    behavior_policy: dict[str, Any]
    base_adapter: str | None = None


class AdapterFile(Record):
    name: str
    object: StoredObject


class TrainResult(Record):
    trained: bool
    skip_reason: str | None = None
    selection: dict[str, Any]
    adapter_files: list[AdapterFile] = Field(default_factory=list)
    adapter_sha256: str | None = None
    receipt: StoredObject | None = None
    steps: int = 0
    final_loss: float | None = None


class PublishInput(Record):
    run_id: str
    request: dict[str, Any]
    environments: list[EnvironmentRef]
    groups: list[StoredObject]
    behavior_policy: dict[str, Any]
    reset_plan_sha256: str
    training: TrainResult | None = None


class PublishedArtifact(Record):
    name: str
    uri: str
    sha256: str
    bytes: int


class PublishResult(Record):
    manifest_uri: str
    manifest_sha256: str
    artifacts: list[PublishedArtifact]
    stats: dict[str, Any]
