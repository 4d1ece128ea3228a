"""The errors of a run's own work: requests, environments, models and engines, storage,
training, evaluation and orchestration. Each class fixes its stable ``code``.
"""

from __future__ import annotations

from kiln.core.errors.base import KilnError


class InvalidRequest(KilnError):
    """The run request (or a CLI/API argument) is malformed; nothing was started."""

    code = "openenv_invalid_request"
    http_status = 400
    stage = "admission"


class InvalidUrl(InvalidRequest):
    """An environment URL does not parse, or is not an http(s) base URL."""

    code = "openenv_invalid_url"


class ModelNotServed(InvalidRequest):
    """The request's ``model`` names no model the workers serve (``KILN_MODELS_DIR``)."""

    code = "model_not_served"


class RemoteEnvironmentForbidden(KilnError):
    """An environment host is not loopback and ``KILN_ALLOW_REMOTE_ENVIRONMENTS`` is off."""

    code = "openenv_remote_environment_forbidden"
    http_status = 403
    stage = "admission"


class InvalidCredential(InvalidRequest):
    """A ``credential_ids`` entry names no ``KILN_CREDENTIALS`` id, or one bound to another origin."""

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
    """The environment stayed full for ``capacity_wait_seconds``; names the group, its size, the most
    sessions ever granted and the advertised ``max_sessions``."""

    code = "environment_capacity_exhausted"
    retryable = True
    http_status = 503


class InvalidActionSchema(KilnError):
    """The environment advertises an action schema that does not compile (or is external)."""

    code = "environment_protocol_error"
    http_status = 502


class EnvironmentIdentityChanged(KilnError):
    """Revalidation found an environment's identity changed (schema, metadata, tools); nothing is
    published."""

    code = "environment_identity_changed"
    retryable = True
    stage = "revalidation"
    http_status = 409


class CollectionFailed(KilnError):
    """A seed group could not be collected (e.g. candidates saw different resets under
    ``reset_determinism: strict``)."""

    code = "collection_failed"
    retryable = True
    stage = "collection"


class ExecutorInterrupted(KilnError):
    """A worker died while running an activity attempt; the attempt is retried."""

    code = "executor_interrupted"
    retryable = True


class RunInterrupted(KilnError):
    """A worker died under the run and the request says ``on_interrupt: "fail"``."""

    code = "run_interrupted"
    retryable = True


class PolicyIdentityChanged(KilnError):
    """The workers' behaviour policy is not the one the run (or its sealed training contract) names."""

    code = "policy_identity_changed"
    stage = "collection"


class ModelNotFound(KilnError):
    """``KILN_MODEL_PATH`` (or a model folder) does not exist or does not load."""

    code = "model_not_found"
    http_status = 400


class ModelUnsupported(ModelNotFound):
    """The model folder cannot serve as a chat policy: an architecture the model family table does
    not know, a family the engine cannot serve (details name ``architecture``, ``missing`` and the
    ``supported`` families), no chat template, no end-of-turn token, no thinking mode where one
    was asked for."""

    code = "model_unsupported"


class DeviceUnavailable(KilnError):
    """``KILN_DEVICE``/``KILN_DTYPE`` name a device or dtype this machine cannot provide."""

    code = "device_unavailable"
    http_status = 400


class AdapterNotFound(KilnError):
    """The request names an adapter that has never been published."""

    code = "adapter_not_found"
    http_status = 404


class EngineUnavailable(KilnError):
    """The rollout engine process (``KILN_ENGINE=vllm``) is missing, died or failed a request; the
    worker restarts it and the groups in flight are retried."""

    code = "engine_unavailable"
    retryable = True
    http_status = 503


class ArtifactPublicationFailed(KilnError):
    """Publishing the run's artifacts failed (a put, a re-verification, the manifest write)."""

    code = "artifact_publication_failed"
    stage = "publication"


class ArtifactIntegrityFailed(KilnError):
    """Stored or downloaded bytes do not match the manifest (size, SHA-256, headers)."""

    code = "openenv_artifact_integrity_failed"
    http_status = 409


class ArtifactNotFound(KilnError):
    """The run has published no artifacts yet, or none of that name."""

    code = "openenv_artifact_not_found"
    http_status = 404


class StorageUnavailable(KilnError):
    """S3 could not be reached or answered an error (retried)."""

    code = "storage_unavailable"
    retryable = True
    http_status = 503


class RetainedBudgetExceeded(KilnError):
    """The run's artifacts would exceed ``KILN_RETAINED_BUDGET_BYTES``."""

    code = "retained_budget_exceeded"
    stage = "publication"


class TrainingFailed(KilnError):
    """Training could not produce an adapter; ``details.reason`` names why (docs/errors.md lists the reasons)."""

    code = "training_failed"
    stage = "training"


class TrainingEvidenceInvalid(KilnError):
    """The trainer's receipt or adapter manifest does not match what was admitted."""

    code = "training_evidence_invalid"
    stage = "training"


class RunCapacityFull(KilnError):
    """More runs are active + queued than ``max_tracked_runs`` allows."""

    code = "openenv_run_capacity_full"
    http_status = 503
    retryable = True
    stage = "admission"


class RunNotFound(KilnError):
    """No run has this id."""

    code = "openenv_run_not_found"
    http_status = 404


class RunCancelled(KilnError):
    """The run was cancelled; ``cancelled_stage`` names the stage it stopped in."""

    code = "cancelled"


class InternalError(KilnError):
    """An unexpected failure; a Python exception's class name appears only in the message, never as the code."""

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


class TrackerUnavailable(KilnError):
    """The run's ``report_to`` tracker cannot start on the gpu worker (package missing)."""

    code = "tracker_unavailable"
    http_status = 400
    stage = "training"


CAPACITY_WAIT_CODE = "environment_at_capacity"


class EnvironmentEvaluationFailed(KilnError):
    """The paired held-out evaluation cannot produce evidence (drift, bad bundle, failed promotion).

    The catalogue marks ``environment_evaluation_failed`` retryable by default (a re-collection may
    succeed); pairing drift between two given bundles is raised with ``retryable=False`` because
    re-pairing the same files cannot change the answer.
    """

    code = "environment_evaluation_failed"
    retryable = True
    stage = "evaluation"


class EvaluationReceiptInvalid(EnvironmentEvaluationFailed):
    """A receipt breaks the schema or its consistency rules (a bug, never retried)."""

    retryable = False


class EnvironmentAtCapacity(KilnError):
    """An attempt could not get a session in its short window; the workflow waits and retries.

    Not retryable for Temporal (the workflow's timer does the waiting, no slot is held);
    ``details`` carry what was observed so the final error can name it.
    """

    code = CAPACITY_WAIT_CODE
    retryable = False
    http_status = 503
    expected = True  # one INFO line in the worker's log, no traceback


class DatasetInvalid(InvalidRequest):
    """A rollouts JSONL given for training is not one Kiln wrote (a line, a field, the newline)."""

    code = "training_invalid_dataset"


class InvalidDatasetRef(InvalidRequest):
    """A ``POST /v1/train/grpo`` dataset reference is not what ``PUT /v1/datasets`` answered."""

    code = "openenv_invalid_dataset_ref"


class ReplayDrift(KilnError):
    """The environment answered differently from the recorded transcript."""

    code = "openenv_replay_drift"
    http_status = 409


class VerificationFailed(KilnError):
    """A bundle failed offline verification; ``details`` locate the first violation."""

    code = "openenv_verification_failed"
    http_status = 409


class TaskCatalogFailed(KilnError):
    """An environment's Task API catalogue could not be read (``POST /v1/openenv/tasks``)."""

    code = "openenv_task_catalog_failed"
    http_status = 502


class InspectionFailed(KilnError):
    """An environment could not be inspected (its metadata, schema or tools)."""

    code = "openenv_inspection_failed"
    http_status = 502


class PreflightFailed(KilnError):
    """The training preflight (sealing a contract) found no gpu worker in time, or failed there."""

    code = "openenv_training_preflight_failed"
    http_status = 503
    retryable = True


# --- Deterministic model faults ---------------------------------------------
class ModelFault(KilnError):
    """The policy model itself fails inside its forward pass (a layer kind the engine cannot
    serve, a config that does not match its architecture). It fails the same way on every
    attempt, so it is never retried: the run ends at once with this code, the model's family and
    architecture, and the cause."""

    code = "model_fault"
    retryable = False
    http_status = 500


class HarnessUnsupported(KilnError):
    """The server is an OpenEnv agent harness (RFC 005: its action is one user message to an agent
    that runs its own model); Kiln trains the policy that acts, so it does not collect from it."""

    code = "openenv_harness_unsupported"
    http_status = 400
    stage = "discovery"


# --- Reliability: runs ended outside Kiln -----------------------------------------------------------------


class RunTerminated(KilnError):
    """The run's workflow was terminated through Temporal (``temporal workflow terminate``), not
    cancelled through Kiln: the message names who terminated it and why, as Temporal recorded."""

    code = "run_terminated"
    stage = "orchestration"


# --- A trainer across devices ---


class TrainingRankFailed(TrainingFailed):
    """A rank of a training spread over several devices died or failed in a collective; every
    rank was stopped. Retryable: the retry resumes from the last checkpoint rank 0 wrote."""

    code = "training_rank_failed"
    retryable = True


# --- Deterministic rollout-engine faults ---------------------------------
class EngineFault(KilnError):
    """The rollout engine failed in a way that repeats on every attempt (a kernel its build lacks,
    a layer it cannot run, weights it cannot load): not retried; the message carries the cause from
    the engine's log."""

    code = "engine_fault"
    retryable = False
    http_status = 500


# --- The vllm engine's topology (tensor parallel, engines per worker) ---
class EngineSettingsInvalid(KilnError):
    """``KILN_VLLM_TENSOR_PARALLEL`` / ``KILN_VLLM_ENGINES`` ask for a vllm engine topology that has
    no meaning (below 1) or that this machine cannot provide (more GPUs than are visible); the
    message names the setting, the value and the GPUs visible."""

    code = "engine_settings_invalid"
    retryable = False
    http_status = 400
