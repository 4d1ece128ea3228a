"""Make sure Kiln's search attributes exist on the namespace a worker serves (idempotent).

Owns: comparing the namespace's attributes with :data:`kiln.core.search_attributes.SEARCH_ATTRIBUTES`,
creating the missing ones through the operator service, and — where the namespace refuses
(Temporal Cloud, missing permission, a full attribute table) — one error line that gives the
operator the exact ``temporal operator search-attribute create`` command to run once. Where the
operator service itself is denied (a Temporal Cloud API key), visibility queries tell which
attributes the namespace knows.
"""

from __future__ import annotations

import asyncio
import re
import time

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import CountWorkflowExecutionsRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from kiln.core.errors import SearchAttributesMissing
from kiln.core.search_attributes import SEARCH_ATTRIBUTES

VISIBLE_WITHIN_S = 15.0


def _indexed_type(kind: str) -> int:
    """``"KeywordList"`` -> ``INDEXED_VALUE_TYPE_KEYWORD_LIST``."""
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", kind).upper()
    return IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{snake}")


def create_commands(namespace: str, missing: dict[str, str]) -> str:
    """The CLI command(s) that create ``missing`` (one per type), joined with `` && ``."""
    by_kind: dict[str, list[str]] = {}
    for name, kind in missing.items():
        by_kind.setdefault(kind, []).append(name)
    return " && ".join(
        f"temporal operator search-attribute create --namespace {namespace} "
        + " ".join(f"--name {name}" for name in names)
        + f" --type {kind}"
        for kind, names in by_kind.items()
    )


async def _existing(client: Client, namespace: str) -> dict[str, int]:
    listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    return {**dict(listed.system_attributes), **dict(listed.custom_attributes)}


async def missing_by_query(client: Client, namespace: str) -> dict[str, str]:
    """Kiln's attributes a visibility query does not know (for namespaces that deny listing).

    A query naming an unknown attribute fails with INVALID_ARGUMENT; a known one just counts.
    """
    missing: dict[str, str] = {}
    for name, kind in SEARCH_ATTRIBUTES.items():
        try:
            await client.workflow_service.count_workflow_executions(
                CountWorkflowExecutionsRequest(namespace=namespace, query=f"{name} = 'kiln-probe'")
            )
        except RPCError as err:
            if err.status != RPCStatusCode.INVALID_ARGUMENT:
                raise
            missing[name] = kind
    return missing


def _refused(namespace: str, missing: dict[str, str], why: str) -> SearchAttributesMissing:
    return SearchAttributesMissing(
        f"Temporal namespace {namespace!r} lacks Kiln's search attributes {', '.join(missing)} and "
        f"Kiln may not create them ({why}); create them once with: {create_commands(namespace, missing)}",
        hint="run the command (or `tcld namespace search-attributes add` on Temporal Cloud), then restart",
    )


async def ensure_search_attributes(client: Client, namespace: str) -> list[str]:
    """Create the missing Kiln search attributes; returns the names created (``[]`` if none).

    Safe to run from every worker at once: an attribute another process created meanwhile counts
    as present. Raises :class:`SearchAttributesMissing` (one line, with the fix) when the
    namespace refuses, or when an attribute exists with another type.
    """
    try:
        existing = await _existing(client, namespace)
    except RPCError as err:
        # Temporal Cloud keys may not use the operator service: probe with visibility queries.
        try:
            missing = await missing_by_query(client, namespace)
        except RPCError:
            missing = dict(SEARCH_ATTRIBUTES)
        if missing:
            raise _refused(namespace, missing, f"the operator service answered {err.status.name}") from None
        return []
    wrong = {
        name: kind
        for name, kind in SEARCH_ATTRIBUTES.items()
        if name in existing and existing[name] != _indexed_type(kind)
    }
    if wrong:
        raise SearchAttributesMissing(
            f"Temporal namespace {namespace!r} has search attribute(s) {', '.join(wrong)} with another "
            f"type than Kiln needs ({', '.join(f'{n}={k}' for n, k in wrong.items())})",
            hint="remove them (`temporal operator search-attribute remove`) and restart a Kiln worker",
        )
    missing = {name: kind for name, kind in SEARCH_ATTRIBUTES.items() if name not in existing}
    if not missing:
        return []
    request = AddSearchAttributesRequest(
        namespace=namespace,
        search_attributes={name: _indexed_type(kind) for name, kind in missing.items()},  # type: ignore[misc]  # protobuf enum map
    )
    try:
        await client.operator_service.add_search_attributes(request)
    except RPCError as err:
        if err.status != RPCStatusCode.ALREADY_EXISTS:
            first_line = (err.message or "").splitlines()[0][:200] if err.message else ""
            raise _refused(namespace, missing, f"{err.status.name}: {first_line}".rstrip(": ")) from None
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while True:
        still = [name for name in missing if name not in await _existing(client, namespace)]
        if not still:
            return list(missing)
        if time.monotonic() > deadline:
            raise _refused(namespace, {n: missing[n] for n in still}, "created but not visible after 15s")
        await asyncio.sleep(0.25)
