"""Discovery and identity revalidation of a run's environments."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import canonical_json
from kiln.core.errors import EnvironmentIdentityChanged
from kiln.core.openenv.credential_config import resolve_bearer_token
from kiln.core.openenv.discovery import identity_differences, inspect_environment
from kiln.core.rollout.group import environment_name
from kiln.core.records import DiscoveryInput, DiscoveryResult, EnvironmentRef, RevalidationInput, StoredObject


def _credential(credentials: dict[str, Any], credential_ids: list[str | None], index: int, url: str) -> str | None:
    if not credential_ids:
        return None
    return resolve_bearer_token(credentials, credential_ids[index], url)


async def discover(
    store: S3Store, inp: DiscoveryInput, *, credentials: dict[str, Any] | None = None
) -> DiscoveryResult:
    """Inspect every URL in order and store each inspection as a content-addressed object."""
    environments: list[EnvironmentRef] = []
    for index, url in enumerate(inp.environment_urls):
        inspection = await inspect_environment(
            url, bearer_token=_credential(credentials or {}, inp.credential_ids, index, url)
        )
        ref = await asyncio.to_thread(store.put_blob, canonical_json(inspection))
        identity = inspection["identity"]
        environments.append(
            EnvironmentRef(
                base_url=identity["base_url"],
                name=environment_name(identity),
                discovery_sha256=identity.get("discovery_sha256"),
                schema_sha256=identity["schema_sha256"],
                inspection=StoredObject.of(ref),
            )
        )
    return DiscoveryResult(environments=environments)


def load_inspection(store: S3Store, obj: StoredObject) -> dict[str, Any]:
    return json.loads(store.get_bytes(obj.ref()))


async def revalidate(store: S3Store, inp: RevalidationInput, *, credentials: dict[str, Any] | None = None) -> None:
    """Re-inspect every endpoint; any drift fails with ``environment_identity_changed``."""
    for index, env in enumerate(inp.environments):
        first = await asyncio.to_thread(load_inspection, store, env.inspection)
        second = await inspect_environment(
            env.base_url,
            bearer_token=_credential(credentials or {}, inp.credential_ids, index, env.base_url),
        )
        changed = identity_differences(first, second)
        if changed:
            raise EnvironmentIdentityChanged(
                f"environment {env.base_url} changed between discovery and revalidation: " + ", ".join(changed),
                hint="the environment server was restarted or redeployed mid-run; "
                "submit a new run against the current environment",
                details={"environment_url": env.base_url, "changed_fields": changed},
            )
