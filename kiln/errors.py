"""The one KilnError tree: every failure Kiln reports carries a stable ``code`` string.

The same codes appear in the CLI, the REST API, run status and Temporal failures (the activity
adapters turn a KilnError into an ``ApplicationError`` whose ``type`` is the code). Messages must
never contain secrets (bearer tokens); callers redact before constructing an error.
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGE_BYTES = 4096


def truncate_message(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """Cut a message to ``limit`` UTF-8 bytes, marking the cut with ``...``."""
    raw = message.encode("utf-8")
    if len(raw) <= limit:
        return message
    return raw[: limit - 3].decode("utf-8", errors="ignore") + "..."


class KilnError(Exception):
    """Base of every Kiln failure. Subclasses fix ``code``, ``retryable`` and ``http_status``."""

    code: str = "internal_error"
    retryable: bool = False
    http_status: int = 500
    stage: str | None = None
    # An expected wait, not a failure (an environment at capacity): workers log it as one INFO
    # line without a traceback, and Temporal marks it benign.
    expected: bool = False

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        code: str | None = None,
        retryable: bool | None = None,
        stage: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        self.message = truncate_message(message)
        super().__init__(self.message)
        self.hint = hint
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable
        if stage is not None:
            self.stage = stage
        self.details = dict(details or {})

    def to_dict(self) -> dict[str, Any]:
        """The wire form used by the API, run status and Temporal failure details."""
        out: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.hint:
            out["hint"] = self.hint
        if self.stage:
            out["stage"] = self.stage
        if self.details:
            out["details"] = self.details
        return out

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidRequest(KilnError):
    """The run request (or a CLI/API argument) is malformed; nothing was started."""

    code = "openenv_invalid_request"
    http_status = 400
    stage = "admission"


class InvalidUrl(InvalidRequest):
    code = "openenv_invalid_url"


class ModelNotServed(InvalidRequest):
    """The request's ``model`` names no model the workers serve (``KILN_MODELS_DIR``)."""

    code = "model_not_served"


class RemoteEnvironmentForbidden(KilnError):
    code = "openenv_remote_environment_forbidden"
    http_status = 403
    stage = "admission"


class InvalidCredential(InvalidRequest):
    code = "openenv_invalid_credential"


class EnvironmentUnavailable(KilnError):
    """The environment could not be reached, or answered with an unusable HTTP status."""

    code = "environment_unavailable"
    retryable = True
    http_status = 502


class EnvironmentProtocolError(KilnError):
    """The environment broke the OpenEnv protocol (bad frame, oversize, unsolicited, reflection)."""

    code = "environment_protocol_error"
    http_status = 502


class EnvironmentCapacityExhausted(KilnError):
    code = "environment_capacity_exhausted"
    retryable = True
    http_status = 503


class InvalidActionSchema(KilnError):
    """The environment advertises an action schema that does not compile (or is external)."""

    code = "environment_protocol_error"
    http_status = 502


class EnvironmentIdentityChanged(KilnError):
    code = "environment_identity_changed"
    retryable = True
    stage = "revalidation"
    http_status = 409


class CollectionFailed(KilnError):
    code = "collection_failed"
    retryable = True
    stage = "collection"


class ExecutorInterrupted(KilnError):
    """A worker died while running an activity attempt; the attempt is retried."""

    code = "executor_interrupted"
    retryable = True


class RunInterrupted(KilnError):
    code = "run_interrupted"
    retryable = True


class PolicyIdentityChanged(KilnError):
    code = "policy_identity_changed"
    stage = "collection"


class ModelNotFound(KilnError):
    code = "model_not_found"
    http_status = 400


class ModelUnsupported(ModelNotFound):
    """The model folder loads but cannot serve as a chat policy (no chat template, no end-of-turn
    token, no thinking mode where one was asked for)."""

    code = "model_unsupported"


class DeviceUnavailable(KilnError):
    """``KILN_DEVICE``/``KILN_DTYPE`` name a device or dtype this machine cannot provide."""

    code = "device_unavailable"
    http_status = 400


class AdapterNotFound(KilnError):
    code = "adapter_not_found"
    http_status = 404


class EngineUnavailable(KilnError):
    """The rollout engine process (``KILN_ENGINE=vllm``) is missing, died or failed a request; the
    worker restarts it and the groups in flight are retried."""

    code = "engine_unavailable"
    retryable = True
    http_status = 503


class ArtifactPublicationFailed(KilnError):
    code = "artifact_publication_failed"
    stage = "publication"


class ArtifactIntegrityFailed(KilnError):
    code = "openenv_artifact_integrity_failed"
    http_status = 409


class ArtifactNotFound(KilnError):
    code = "openenv_artifact_not_found"
    http_status = 404


class StorageUnavailable(KilnError):
    code = "storage_unavailable"
    retryable = True
    http_status = 503


class RetainedBudgetExceeded(KilnError):
    code = "retained_budget_exceeded"
    stage = "publication"


class TrainingFailed(KilnError):
    code = "training_failed"
    stage = "training"


class TrainingEvidenceInvalid(KilnError):
    code = "training_evidence_invalid"
    stage = "training"


class RunCapacityFull(KilnError):
    """More runs are active + queued than ``max_tracked_runs`` allows."""

    code = "openenv_run_capacity_full"
    http_status = 503
    retryable = True
    stage = "admission"


class RunNotFound(KilnError):
    code = "openenv_run_not_found"
    http_status = 404


class RunCancelled(KilnError):
    code = "cancelled"


class InternalError(KilnError):
    code = "internal_error"


class TemporalUnavailable(KilnError):
    """Temporal could not be reached (within the worker's bounded connection retries)."""

    code = "temporal_unavailable"
    retryable = True
    http_status = 503


class TemporalConfigInvalid(KilnError):
    """A ``KILN_TEMPORAL_*`` connection setting is unusable (a missing PEM file, half a key pair)."""

    code = "temporal_config_invalid"


class SearchAttributesMissing(KilnError):
    """The namespace lacks Kiln's search attributes and refused to create them (Temporal Cloud)."""

    code = "temporal_search_attributes_missing"


ALL_ERROR_TYPES: tuple[type[KilnError], ...] = (
    InvalidRequest,
    InvalidUrl,
    RemoteEnvironmentForbidden,
    InvalidCredential,
    EnvironmentUnavailable,
    EnvironmentProtocolError,
    EnvironmentCapacityExhausted,
    InvalidActionSchema,
    EnvironmentIdentityChanged,
    CollectionFailed,
    ExecutorInterrupted,
    RunInterrupted,
    PolicyIdentityChanged,
    ModelNotFound,
    AdapterNotFound,
    ArtifactPublicationFailed,
    ArtifactIntegrityFailed,
    ArtifactNotFound,
    StorageUnavailable,
    RetainedBudgetExceeded,
    TrainingFailed,
    TrainingEvidenceInvalid,
    RunCapacityFull,
    RunNotFound,
    RunCancelled,
    InternalError,
    TemporalUnavailable,
    TemporalConfigInvalid,
    SearchAttributesMissing,
)


def _subclasses(base: type[KilnError]) -> list[type[KilnError]]:
    out: list[type[KilnError]] = []
    for sub in base.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def error_type(code: str) -> type[KilnError]:
    """The ``KilnError`` class of ``code``: the listed types first, then any loaded subclass that
    declares that code itself (``ModelNotServed``, ``TrackerUnavailable``, …); else ``KilnError``."""
    for candidate in ALL_ERROR_TYPES:
        if candidate.code == code:
            return candidate
    for candidate in _subclasses(KilnError):
        if candidate.__dict__.get("code") == code and candidate.__init__ is KilnError.__init__:
            return candidate
    return KilnError


def error_from_dict(data: dict[str, Any]) -> KilnError:
    """Rebuild a KilnError from its ``to_dict`` form (used across process boundaries)."""
    code = str(data.get("code") or "internal_error")
    cls = error_type(code)
    return cls(
        str(data.get("message") or code),
        hint=data.get("hint"),
        code=code,
        retryable=bool(data.get("retryable", False)),
        stage=data.get("stage"),
        details=data.get("details") or None,
    )


class TrackerUnavailable(KilnError):
    """The run's ``report_to`` tracker cannot start on the gpu worker (package missing)."""

    code = "tracker_unavailable"
    http_status = 400
    stage = "training"


# --- branch vllm (issue 37): deterministic rollout-engine faults ---------------------------------
class EngineFault(KilnError):
    """The rollout engine failed in a way that repeats on every attempt (a kernel its build lacks,
    a layer it cannot run, weights it cannot load): not retried; the message carries the cause from
    the engine's log."""

    code = "engine_fault"
    retryable = False
    http_status = 500
