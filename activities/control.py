"""Control-queue activities: admission, discovery, identity revalidation, publication (CPU, I/O)."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import activity

from kiln.artifacts.store import S3Store
from kiln.contracts import parse_run_request, request_digest, reset_plan_sha256
from kiln.openenv.urls import normalize_url, require_allowed_host
from kiln.steps.discovery import discover, revalidate
from kiln.steps.publication import publish
from kiln.settings import Settings
from kiln.stages import (
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
from kiln.steps.evaluation import evaluate, store_side_bundle
from activities.common import kiln_errors


class ControlActivities:
    """Holds the process-wide dependencies of the control worker."""

    def __init__(self, settings: Settings, store: S3Store) -> None:
        self.settings = settings
        self.store = store

    @activity.defn(name="admit_run")
    @kiln_errors
    async def admit_run(self, inp: AdmissionInput) -> AdmissionResult:
        request = parse_run_request(inp.request)
        for url in request.environment_urls:
            require_allowed_host(
                normalize_url(url), allow_remote=self.settings.allow_remote_environments
            )
        templates = request.reset_templates()
        return AdmissionResult(
            request=request.model_dump(mode="json"),
            request_sha256=request_digest(request),
            reset_templates=templates,
            reset_plan_sha256=reset_plan_sha256(templates),
            gpu_task_queue=self.settings.gpu_task_queue,
        )

    @activity.defn(name="discover_environments")
    @kiln_errors
    async def discover_environments(self, inp: DiscoveryInput) -> DiscoveryResult:
        return await discover(self.store, inp)

    @activity.defn(name="revalidate_environments")
    @kiln_errors
    async def revalidate_environments(self, inp: RevalidationInput) -> None:
        await revalidate(self.store, inp)

    @activity.defn(name="publish_run")
    @kiln_errors
    async def publish_run(self, inp: PublishInput) -> PublishResult:
        return await asyncio.to_thread(publish, self.store, inp)

    @activity.defn(name="store_side_bundle")
    @kiln_errors
    async def store_side_bundle(self, inp: SideBundleInput) -> SideBundle:
        return await asyncio.to_thread(store_side_bundle, self.store, inp)

    @activity.defn(name="evaluate_run")
    @kiln_errors
    async def evaluate_run(self, inp: EvaluateInput) -> EvaluationResult:
        return await asyncio.to_thread(evaluate, self.store, inp)

    def all(self) -> list[Any]:
        return [
            self.admit_run,
            self.discover_environments,
            self.revalidate_environments,
            self.store_side_bundle,
            self.evaluate_run,
            self.publish_run,
        ]
