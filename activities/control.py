"""Control-queue activities: admission, discovery, identity revalidation, publication (CPU, I/O)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from temporalio import activity
from temporalio.client import WithStartWorkflowOperation, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from kiln.core.artifacts.store import S3Store
from kiln.core.contracts import parse_run_request, reset_plan_sha256
from kiln.core.request_digest import request_digest
from kiln.core.openenv.urls import normalize_url, require_allowed_host
from kiln.core.full_admission import require_full_fits, training_dtype
from kiln.core.served_models import model_task_queue, require_served, served_models
from kiln.core.stages.discovery import discover, revalidate
from kiln.core.stages.publication import publish
from kiln.core.settings import Settings
from kiln.core.records import (
    ActivityResult,
    AdmissionInput,
    AdmissionResult,
    DiscoveryInput,
    DiscoveryResult,
    EvaluateInput,
    EvaluationResult,
    PublishInput,
    PublishResult,
    RevalidationInput,
    SideBundle,
    SideBundleInput,
)
from kiln.core.evaluation.static_suite import load_suite
from kiln.core.openenv.credential_config import check_credential
from kiln.core.stages.dataset import split_dataset
from kiln.core.stages.evaluation import evaluate, store_side_bundle
from kiln.core.stages.publication import publish_training
from kiln.core.artifacts.group_sets import group_set
from kiln.core.records import GroupIndexInput, GroupSet, IterationFiles, IterationInput, StoredObject
from kiln.core.side_records import DatasetSplit, PublishTrainingInput
from kiln.core.stages.iteration import store_iteration
from activities.common import activity_methods, heartbeating, kiln_errors, run_committing_with_heartbeats
from kiln.core.errors import RunCapacityFull
from kiln.core.side_records import QueueState, SlotReply, SlotRequest
from workflows.names import QUEUE_WORKFLOW, queue_workflow_id  # type names only (see test_layering)


class ControlActivities:
    """Holds the process-wide dependencies of the control worker."""

    def __init__(self, settings: Settings, store: S3Store) -> None:
        self.settings = settings
        self.store = store

    @activity.defn(name="admit_run")
    @kiln_errors
    async def admit_run(self, inp: AdmissionInput) -> AdmissionResult:
        request = parse_run_request(inp.submission)
        # model_not_served lists the served ones; model_unsupported names an architecture Kiln cannot serve
        require_served(request.model, self.settings.models_dir, engine=self.settings.engine)
        for url in request.environment_urls:
            require_allowed_host(normalize_url(url), allow_remote=self.settings.allow_remote_environments)
        for index, credential_id in enumerate(request.credential_ids):
            check_credential(self.settings.credentials, credential_id, request.environment_urls[index])
        if request.post_eval is not None:
            load_suite(request.post_eval.suite)  # post_eval_suite_not_found names the installed ones
        model_dir = served_models(self.settings.models_dir).get(request.model) if request.model else None
        require_full_fits(
            request,
            engine=self.settings.engine,
            model_dir=model_dir or self.settings.default_model_path,
            dtype=training_dtype(self.settings.dtype, self.settings.device),
            budget_bytes=self.settings.retained_budget_bytes,
        )
        templates = request.reset_templates()
        return AdmissionResult(
            request=request,
            request_sha256=request_digest(request),
            reset_templates=templates,
            reset_plan_sha256=reset_plan_sha256(templates),
            gpu_task_queue=model_task_queue(self.settings.gpu_task_queue, request.model),
            queue_workflow_id=queue_workflow_id(self.settings.control_task_queue),
            heartbeat_timeout_s=self.settings.heartbeat_timeout_s,
            warnings=request.reset_option_warnings(),
            parallel_groups=self.settings.parallel_groups_per_run,
        )

    @activity.defn(name="enqueue_run")
    @kiln_errors
    async def enqueue_run(self, inp: SlotRequest) -> SlotReply:
        """Join the FIFO run queue (starting the queue workflow if needed): update-with-start.

        Temporal admits at most 10 in-flight updates per workflow: when many runs are submitted at
        once the update is refused with RESOURCE_EXHAUSTED, and is simply tried again (jittered
        backoff, bounded by the activity's own timeout) — a burst of submissions queues them all.
        """
        delay = 0.1
        while True:
            try:
                return await self._request_slot(inp)
            except RPCError as err:
                if err.status != RPCStatusCode.RESOURCE_EXHAUSTED:
                    raise
                await asyncio.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 2.0)

    async def _request_slot(self, inp: SlotRequest) -> SlotReply:
        settings = self.settings
        try:
            return await activity.client().execute_update_with_start_workflow(
                "request_slot",
                inp,
                start_workflow_operation=WithStartWorkflowOperation(
                    QUEUE_WORKFLOW,
                    QueueState(
                        max_active_runs=settings.max_active_runs,
                        max_tracked_runs=settings.max_tracked_runs,
                    ),
                    id=queue_workflow_id(settings.control_task_queue),
                    task_queue=settings.control_task_queue,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                ),
                result_type=SlotReply,
            )
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type == RunCapacityFull.code:
                raise RunCapacityFull(cause.message, retryable=False) from None
            raise

    @activity.defn(name="discover_environments")
    @kiln_errors
    async def discover_environments(self, inp: DiscoveryInput) -> DiscoveryResult:
        return await heartbeating(discover(self.store, inp, credentials=self.settings.credentials))

    @activity.defn(name="revalidate_environments")
    @kiln_errors
    async def revalidate_environments(self, inp: RevalidationInput) -> ActivityResult | None:
        """Re-inspect and compare identities; returns only the attempt (histories before it: None)."""
        await heartbeating(revalidate(self.store, inp, credentials=self.settings.credentials))
        return ActivityResult()

    @activity.defn(name="publish_run")
    @kiln_errors
    async def publish_run(self, inp: PublishInput) -> PublishResult:
        return await run_committing_with_heartbeats(
            publish, self.store, inp, budget_bytes=self.settings.retained_budget_bytes
        )

    @activity.defn(name="index_groups")
    @kiln_errors
    async def index_groups(self, inp: GroupIndexInput) -> GroupSet:
        """Store one collection chunk's group references as a group index (kiln.core.artifacts.group_sets)."""
        return await heartbeating(asyncio.to_thread(group_set, self.store, [inp.groups]))

    @activity.defn(name="store_iteration")
    @kiln_errors
    async def store_iteration(self, inp: IterationInput) -> IterationFiles:
        """Store one online-RL iteration's bundle and record (kiln.core.stages.iteration)."""
        return await heartbeating(asyncio.to_thread(store_iteration, self.store, inp))

    @activity.defn(name="store_side_bundle")
    @kiln_errors
    async def store_side_bundle(self, inp: SideBundleInput) -> SideBundle:
        return await heartbeating(asyncio.to_thread(store_side_bundle, self.store, inp))

    @activity.defn(name="evaluate_run")
    @kiln_errors
    async def evaluate_run(self, inp: EvaluateInput) -> EvaluationResult:
        return await heartbeating(asyncio.to_thread(evaluate, self.store, inp))

    @activity.defn(name="split_dataset")
    @kiln_errors
    async def split_dataset(self, dataset: StoredObject) -> DatasetSplit:
        groups, policy, base_adapter = await heartbeating(asyncio.to_thread(split_dataset, self.store, dataset))
        return DatasetSplit(
            groups=groups,
            behavior_policy=policy,
            base_adapter=base_adapter,
            gpu_task_queue=self.settings.gpu_task_queue,
            heartbeat_timeout_s=self.settings.heartbeat_timeout_s,
        )

    @activity.defn(name="publish_training")
    @kiln_errors
    async def publish_training(self, inp: PublishTrainingInput) -> PublishResult:
        return await heartbeating(asyncio.to_thread(publish_training, self.store, inp))

    def all(self) -> list[Any]:
        return activity_methods(self)
