"""The errors of a run's own work: requests, environments, models and engines, storage,
training, evaluation and orchestration. Each class fixes its stable ``code``.
"""

from __future__ import annotations

from kiln.core.errors.base import KilnError


class InvalidRequest(KilnError, code="openenv_invalid_request", http_status=400, stage="admission"):
    """The run request (or a CLI/API argument) is malformed; nothing was started."""


class InvalidUrl(InvalidRequest, code="openenv_invalid_url"):
    """An environment URL does not parse, or is not an http(s) base URL."""


class ModelNotServed(InvalidRequest, code="model_not_served"):
    """The request's ``model`` names no model the workers serve (``KILN_MODELS_DIR``)."""


class RemoteEnvironmentForbidden(
    KilnError, code="openenv_remote_environment_forbidden", http_status=403, stage="admission"
):
    """An environment host is not loopback and ``KILN_ALLOW_REMOTE_ENVIRONMENTS`` is off."""


class InvalidCredential(InvalidRequest, code="openenv_invalid_credential"):
    """A ``credential_ids`` entry names no ``KILN_CREDENTIALS`` id, or one bound to another origin."""


class EnvironmentUnavailable(KilnError, code="environment_unavailable", retryable=True, http_status=502):
    """The environment could not be reached, or answered with an unusable HTTP status."""


class EnvironmentProtocolError(KilnError, code="environment_protocol_error", http_status=502):
    """The environment broke the OpenEnv protocol (bad frame, oversize, unsolicited, reflection)."""


class EnvironmentCapacityExhausted(KilnError, code="environment_capacity_exhausted", retryable=True, http_status=503):
    """The environment stayed full for ``capacity_wait_seconds``; names the group, its size, the most
    sessions ever granted and the advertised ``max_sessions``."""


class InvalidActionSchema(KilnError, code="environment_protocol_error", http_status=502):
    """The environment advertises an action schema that does not compile (or is external)."""


class EnvironmentIdentityChanged(
    KilnError, code="environment_identity_changed", retryable=True, stage="revalidation", http_status=409
):
    """Revalidation found an environment's identity changed (schema, metadata, tools); nothing is
    published."""


class CollectionFailed(KilnError, code="collection_failed", retryable=True, stage="collection"):
    """A seed group could not be collected (e.g. candidates saw different resets under
    ``reset_determinism: strict``)."""


class ExecutorInterrupted(KilnError, code="executor_interrupted", retryable=True):
    """A worker died while running an activity attempt; the attempt is retried."""


class RunInterrupted(KilnError, code="run_interrupted", retryable=True):
    """A worker died under the run and the request says ``on_interrupt: "fail"``."""


class PolicyIdentityChanged(KilnError, code="policy_identity_changed", stage="collection"):
    """The workers' behaviour policy is not the one the run (or its sealed training contract) names."""


class ModelNotFound(KilnError, code="model_not_found", http_status=400):
    """``KILN_MODEL_PATH`` (or a model folder) does not exist or does not load."""


class ModelUnsupported(ModelNotFound, code="model_unsupported"):
    """The model folder cannot serve as a chat policy: an architecture the model family table does
    not know, a family the engine cannot serve (details name ``architecture``, ``missing`` and the
    ``supported`` families), no chat template, no end-of-turn token, no thinking mode where one
    was asked for."""


class DeviceUnavailable(KilnError, code="device_unavailable", http_status=400):
    """``KILN_DEVICE``/``KILN_DTYPE`` name a device or dtype this machine cannot provide."""


class AdapterNotFound(KilnError, code="adapter_not_found", http_status=404):
    """The request names an adapter that has never been published."""


class EngineUnavailable(KilnError, code="engine_unavailable", retryable=True, http_status=503):
    """The rollout engine process (``KILN_ENGINE=vllm``) is missing, died or failed a request; the
    worker restarts it and the groups in flight are retried."""


class ArtifactPublicationFailed(KilnError, code="artifact_publication_failed", stage="publication"):
    """Publishing the run's artifacts failed (a put, a re-verification, the manifest write)."""


class ArtifactIntegrityFailed(KilnError, code="openenv_artifact_integrity_failed", http_status=409):
    """Stored or downloaded bytes do not match the manifest (size, SHA-256, headers)."""


class ArtifactNotFound(KilnError, code="openenv_artifact_not_found", http_status=404):
    """The run has published no artifacts yet, or none of that name."""


class StorageUnavailable(KilnError, code="storage_unavailable", retryable=True, http_status=503):
    """S3 could not be reached or answered an error (retried)."""


class RetainedBudgetExceeded(KilnError, code="retained_budget_exceeded", stage="publication"):
    """The run's artifacts would exceed ``KILN_RETAINED_BUDGET_BYTES``."""


class TrainingFailed(KilnError, code="training_failed", stage="training"):
    """Training could not produce an adapter; ``details.reason`` names why (docs/errors.md lists the reasons)."""


class TrainingEvidenceInvalid(KilnError, code="training_evidence_invalid", stage="training"):
    """The trainer's receipt or adapter manifest does not match what was admitted."""


class RunCapacityFull(KilnError, code="openenv_run_capacity_full", http_status=503, retryable=True, stage="admission"):
    """More runs are active + queued than ``max_tracked_runs`` allows."""


class RunNotFound(KilnError, code="openenv_run_not_found", http_status=404):
    """No run has this id."""


class RunCancelled(KilnError, code="cancelled"):
    """The run was cancelled; ``cancelled_stage`` names the stage it stopped in."""


class InternalError(KilnError, code="internal_error"):
    """An unexpected failure; a Python exception's class name appears only in the message, never as the code."""


class TemporalUnavailable(KilnError, code="temporal_unavailable", retryable=True, http_status=503):
    """Temporal could not be reached (within the worker's bounded connection retries)."""


class TemporalConfigInvalid(KilnError, code="temporal_config_invalid"):
    """A ``KILN_TEMPORAL_*`` connection setting is unusable (a missing PEM file, half a key pair)."""


class SearchAttributesMissing(KilnError, code="temporal_search_attributes_missing"):
    """The namespace lacks Kiln's search attributes and refused to create them (Temporal Cloud)."""


class TrackerUnavailable(KilnError, code="tracker_unavailable", http_status=400, stage="training"):
    """The run's ``report_to`` tracker cannot start on the gpu worker (package missing)."""


CAPACITY_WAIT_CODE = "environment_at_capacity"


class EnvironmentEvaluationFailed(KilnError, code="environment_evaluation_failed", retryable=True, stage="evaluation"):
    """The paired held-out evaluation cannot produce evidence (drift, bad bundle, failed promotion).

    The catalogue marks ``environment_evaluation_failed`` retryable by default (a re-collection may
    succeed); pairing drift between two given bundles is raised with ``retryable=False`` because
    re-pairing the same files cannot change the answer.
    """


class EvaluationReceiptInvalid(EnvironmentEvaluationFailed, retryable=False):
    """A receipt breaks the schema or its consistency rules (a bug, never retried)."""


class EnvironmentAtCapacity(KilnError, code=CAPACITY_WAIT_CODE, retryable=False, http_status=503, expected=True):
    """An attempt could not get a session in its short window; the workflow waits and retries.

    Not retryable for Temporal (the workflow's timer does the waiting, no slot is held);
    ``details`` carry what was observed so the final error can name it. Expected: one INFO line in
    the worker's log, no traceback.
    """


class DatasetInvalid(InvalidRequest, code="training_invalid_dataset"):
    """A rollouts JSONL given for training is not one Kiln wrote (a line, a field, the newline)."""


class InvalidDatasetRef(InvalidRequest, code="openenv_invalid_dataset_ref"):
    """A ``POST /v1/train/grpo`` dataset reference is not what ``PUT /v1/datasets`` answered."""


class ReplayDrift(KilnError, code="openenv_replay_drift", http_status=409):
    """The environment answered differently from the recorded transcript."""


class VerificationFailed(KilnError, code="openenv_verification_failed", http_status=409):
    """A bundle failed offline verification; ``details`` locate the first violation."""


class TaskCatalogFailed(KilnError, code="openenv_task_catalog_failed", http_status=502):
    """An environment's Task API catalogue could not be read (``POST /v1/openenv/tasks``)."""


class InspectionFailed(KilnError, code="openenv_inspection_failed", http_status=502):
    """An environment could not be inspected (its metadata, schema or tools)."""


class PreflightFailed(KilnError, code="openenv_training_preflight_failed", http_status=503, retryable=True):
    """The training preflight (sealing a contract) found no gpu worker in time, or failed there."""


# --- Deterministic model faults ---------------------------------------------
class ModelFault(KilnError, code="model_fault", retryable=False, http_status=500):
    """The policy model itself fails inside its forward pass (a layer kind the engine cannot
    serve, a config that does not match its architecture). It fails the same way on every
    attempt, so it is never retried: the run ends at once with this code, the model's family and
    architecture, and the cause."""


class HarnessUnsupported(KilnError, code="openenv_harness_unsupported", http_status=400, stage="discovery"):
    """The server is an OpenEnv agent harness (RFC 005: its action is one user message to an agent
    that runs its own model); Kiln trains the policy that acts, so it does not collect from it."""


# --- Reliability: runs ended outside Kiln -----------------------------------------------------------------


class RunTerminated(KilnError, code="run_terminated", stage="orchestration"):
    """The run's workflow was terminated through Temporal (``temporal workflow terminate``), not
    cancelled through Kiln: the message names who terminated it and why, as Temporal recorded."""


# --- A trainer across devices ---


class TrainingRankFailed(TrainingFailed, code="training_rank_failed", retryable=True):
    """A rank of a training spread over several devices died or failed in a collective; every
    rank was stopped. Retryable: the retry resumes from the last checkpoint rank 0 wrote."""


# --- Deterministic rollout-engine faults ---------------------------------
class EngineFault(KilnError, code="engine_fault", retryable=False, http_status=500):
    """The rollout engine failed in a way that repeats on every attempt (a kernel its build lacks,
    a layer it cannot run, weights it cannot load): not retried; the message carries the cause from
    the engine's log."""


# --- The vllm engine's topology (tensor parallel, engines per worker) ---
class EngineSettingsInvalid(KilnError, code="engine_settings_invalid", retryable=False, http_status=400):
    """``KILN_VLLM_TENSOR_PARALLEL`` / ``KILN_VLLM_ENGINES`` ask for a vllm engine topology that has
    no meaning (below 1) or that this machine cannot provide (more GPUs than are visible); the
    message names the setting, the value and the GPUs visible."""


# --- Full fine-tuning (training_config.adapter: full) ---
class FullTrainingUnsupported(KilnError, code="full_training_unsupported", retryable=False, http_status=400):
    """``training_config.adapter: full`` asked for with what full training does not support: the vllm
    engine (it serves LoRA adapters only), a LoRA adapter to start from, several train devices, or
    a plan whose full weights alone exceed ``KILN_RETAINED_BUDGET_BYTES``; the message names the
    setting and the fix."""
