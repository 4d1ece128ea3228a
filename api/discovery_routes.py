"""``/v1/openenv/inspect``, ``/v1/openenv/tasks`` and ``/v1/openenv/training/preflight``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from kiln.core.errors import InspectionFailed, TaskCatalogFailed
from api.preflight import PreflightRequest, preflight
from api.services import Services, services
from kiln.api_models import Inspections, PreflightReceipt, TaskCatalogs
from kiln.core.errors import EnvironmentProtocolError, EnvironmentUnavailable, InvalidRequest, KilnError
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.openenv.tasks import task_catalog
from kiln.core.openenv.urls import EnvironmentUrl, normalize_url, require_allowed_host
from kiln.core.openenv.credential_config import resolve_bearer_token
from kiln.core.request_fields import ENVIRONMENT_URLS

router = APIRouter(prefix="/v1/openenv", tags=["environments"])


class EnvironmentsBody(BaseModel):
    """Environment URLs with optional opaque credential ids aligned to them."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    environment_urls: list[str] = Field(validation_alias=ENVIRONMENT_URLS, min_length=1, max_length=64)
    credential_ids: list[str | None] = Field(default_factory=list)

    def targets(
        self, allow_remote: bool, credentials: dict[str, Any] | None = None
    ) -> list[tuple[EnvironmentUrl, str | None]]:
        """Each normalised, allowed URL with its bearer token (None = public)."""
        if self.credential_ids and len(self.credential_ids) != len(self.environment_urls):
            raise InvalidRequest("credential_ids must be empty or have one entry per environment URL")
        out = []
        for index, text in enumerate(self.environment_urls):
            url = normalize_url(text)
            require_allowed_host(url, allow_remote=allow_remote)
            credential = self.credential_ids[index] if self.credential_ids else None
            out.append((url, resolve_bearer_token(credentials or {}, credential, url)))
        return out


class TasksBody(EnvironmentsBody):
    """``POST /v1/openenv/tasks`` body."""

    environment_name: str | None = Field(default=None, min_length=1, max_length=256)
    split: str | None = Field(default=None, min_length=1, max_length=256)
    start: int = 0
    limit: int = 50


def _wrap(error: KilnError, cls: type[KilnError], url: EnvironmentUrl) -> KilnError:
    return cls(
        f"{url.base_url}: {error.message}",
        hint=error.hint,
        retryable=error.retryable,
        details={"cause": error.code, "base_url": url.base_url},
    )


INSPECT_TIMEOUT_S = 20.0  # the whole request, however many URLs (they are inspected in parallel)


def _inspection_failed(url: EnvironmentUrl) -> KilnError:
    """One uniform failure: the same words for a closed port, a status, a timeout or a bad body,
    so ``/inspect`` can not be used to map which loopback ports answer and how."""
    return InspectionFailed(
        f"{url.base_url}: could not be inspected as an OpenEnv environment "
        f"(GET /health, /metadata, /schema within {INSPECT_TIMEOUT_S:g}s)",
        hint="check that the URL serves OpenEnv; `kiln inspect URL` on the environment's host "
        "shows the detailed reason",
        details={"base_url": url.base_url},
    )


async def _inspect_one(url: EnvironmentUrl, token: str | None) -> Any:
    try:
        return await inspect_environment(url, bearer_token=token, connect_timeout_s=5.0, timeout_s=INSPECT_TIMEOUT_S)
    except (EnvironmentUnavailable, EnvironmentProtocolError):
        return _inspection_failed(url)


@router.post("/inspect", response_model=Inspections)
async def inspect(body: EnvironmentsBody, svc: Services = Depends(services)) -> Inspections:
    """Discover each environment (in parallel, at most 20 s in all): identity, digests and action
    schema. Any failure answers 502 ``openenv_inspection_failed`` naming the first URL."""
    targets = body.targets(svc.settings.allow_remote_environments, svc.settings.credentials)
    tasks = [asyncio.ensure_future(_inspect_one(url, token)) for url, token in targets]
    done, pending = await asyncio.wait(tasks, timeout=INSPECT_TIMEOUT_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    inspections = []
    for (url, _token), task in zip(targets, tasks, strict=True):
        result = task.result() if task in done else _inspection_failed(url)
        if isinstance(result, KilnError):
            raise result
        inspections.append(result)
    return Inspections(environments=inspections)


@router.post("/tasks", response_model=TaskCatalogs)
async def tasks(body: TasksBody, svc: Services = Depends(services)) -> TaskCatalogs:
    """One page of each environment's Task API catalog; discovery only, never episodes."""
    if not 1 <= body.limit <= 200 or body.start < 0:
        raise InvalidRequest("task page needs 1 <= limit <= 200 and start >= 0", code="openenv_invalid_task_page")
    catalogs = []
    for url, token in body.targets(svc.settings.allow_remote_environments, svc.settings.credentials):
        try:
            catalog = await task_catalog(
                url,
                environment_name=body.environment_name,
                split=body.split,
                start=body.start,
                limit=body.limit,
                bearer_token=token,
            )
        except (EnvironmentUnavailable, EnvironmentProtocolError) as error:
            raise _wrap(error, TaskCatalogFailed, url) from None
        catalogs.append({"base_url": url.base_url, "catalog": catalog})
    return TaskCatalogs.model_validate({"catalogs": catalogs})


@router.post("/training/preflight", response_model=PreflightReceipt)
async def training_preflight(body: PreflightRequest, svc: Services = Depends(services)) -> PreflightReceipt:
    """Seal a training contract: defaults filled, behaviour policy resolved by a gpu worker."""
    return await preflight(await svc.client(), svc.settings, body)
