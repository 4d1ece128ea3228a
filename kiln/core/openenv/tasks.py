"""OpenEnv Task API catalogs: discovery of splits and task rows, never episodes.

Owns: building Task API URLs (the environment name is ONE percent-encoded path segment), the five
provider routes, and the catalog algorithm (choose the environment from ``/list_environments``,
501/404 → ``unsupported``, case-insensitive split match, bounded pages). Task rows are untrusted
JSON for display only: they never become reset payloads or artifacts.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from kiln.core.errors import EnvironmentProtocolError, EnvironmentUnavailable, InvalidRequest
from kiln.core.openenv.credentials import prepare_token
from kiln.core.openenv.httpio import check_health, make_client, request_json
from kiln.core.openenv.urls import EnvironmentUrl, coerce_url

TASK_CATALOG_SCHEMA = "kiln.openenv-task-catalog.v1"
MAX_PAGE = 200
DEFAULT_PAGE = 50
MAX_RAW_ITEMS = 16_384
_UNSUPPORTED_STATUSES = (404, 501)


class TaskApiUnsupported(Exception):
    """The server has no TaskProvider (HTTP 501) or no Task API at all (HTTP 404)."""


def _selection_error(message: str) -> InvalidRequest:
    return InvalidRequest(message, code="openenv_invalid_task_selection")


def task_route(url: EnvironmentUrl, environment_name: str, route: str) -> str:
    """``{base}/{percent-encoded env name}/{route}``."""
    return f"{url.base_url}/{quote(environment_name, safe='')}/{route}"


@dataclass(eq=False)
class TaskClient:
    """Thin typed access to the five Task API routes of one server and environment."""

    client: httpx.AsyncClient
    url: EnvironmentUrl
    environment_name: str
    _: KW_ONLY
    bearer_token: str | None = field(repr=False)  # a secret: never in a repr or a log line
    timeout_s: float
    connect_timeout_s: float

    async def _call(self, method: str, route: str, body: Any = None) -> Any:
        status, value = await request_json(
            self.client,
            method,
            task_route(self.url, self.environment_name, route),
            json_body=body,
            bearer_token=self.bearer_token,
            timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            ok_statuses=_UNSUPPORTED_STATUSES,
        )
        if status in _UNSUPPORTED_STATUSES:
            raise TaskApiUnsupported(route)
        return value

    def _bad(self, route: str, reason: str) -> EnvironmentProtocolError:
        return EnvironmentProtocolError(
            f"{task_route(self.url, self.environment_name, route)}: {reason}", details={"route": route}
        )

    async def splits(self) -> list[dict]:
        value = await self._call("GET", "splits")
        if not isinstance(value, list) or len(value) > MAX_RAW_ITEMS:
            raise self._bad("splits", "splits is not an array (of at most 16384 items)")
        for item in value:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise self._bad("splits", "a split is not an object with a string name")
        return value

    async def num_tasks(self, split: str) -> int:
        value = await self._call("POST", "num_tasks", {"split": split})
        count = value.get("num_tasks") if isinstance(value, dict) else None
        if not isinstance(count, int) or isinstance(count, bool):
            raise self._bad("num_tasks", "num_tasks is not an integer")
        if count < 0:
            raise self._bad("num_tasks", "num_tasks is negative")
        return count

    async def task(self, split: str, index: int) -> Any:
        value = await self._call("POST", "task", {"split": split, "index": index})
        if not isinstance(value, dict) or "task" not in value:
            raise self._bad("task", "response has no 'task'")
        return value["task"]

    async def task_range(self, split: str, start: int | None = None, stop: int | None = None) -> list:
        body: dict[str, Any] = {"split": split}
        if start is not None:
            body["start"] = start
        if stop is not None:
            body["stop"] = stop
        value = await self._call("POST", "task_range", body)
        tasks = value.get("tasks") if isinstance(value, dict) else None
        if not isinstance(tasks, list) or len(tasks) > MAX_RAW_ITEMS:
            raise self._bad("task_range", "response has no 'tasks' array (of at most 16384 items)")
        return tasks

    async def tasks(self, split: str) -> list:
        value = await self._call("POST", "tasks", {"split": split})
        tasks = value.get("tasks") if isinstance(value, dict) else None
        if not isinstance(tasks, list) or len(tasks) > MAX_RAW_ITEMS:
            raise self._bad("tasks", "response has no 'tasks' array (of at most 16384 items)")
        return tasks


def _choose_environment(advertised: list[str], requested: str | None) -> str:
    if requested is None:
        if len(advertised) == 1:
            return advertised[0]
        raise _selection_error(f"environment name required: the server advertises {len(advertised)} environments")
    for name in advertised:
        if name.lower() == requested.lower():
            return name
    raise _selection_error("unknown environment name for this server")


async def task_catalog(
    url: str | EnvironmentUrl,
    *,
    environment_name: str | None = None,
    split: str | None = None,
    start: int = 0,
    limit: int = DEFAULT_PAGE,
    bearer_token: str | None = None,
    connect_timeout_s: float = 10.0,
    timeout_s: float = 60.0,
) -> dict:
    """One page of a server's task catalog.

    Returns ``{environment_name, task_api, splits[, selected_split, num_tasks, start, stop], tasks}``.
    Raises ``InvalidRequest`` (``openenv_invalid_task_page`` / ``openenv_invalid_task_selection``)
    for bad arguments, ``EnvironmentUnavailable`` / ``EnvironmentProtocolError`` otherwise.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest("task page limit must be 1..200", code="openenv_invalid_task_page")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidRequest("task page start must be >= 0", code="openenv_invalid_task_page")
    env_url = coerce_url(url)
    token = prepare_token(env_url, bearer_token)
    async with make_client(bearer_token=token, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s) as client:
        await check_health(client, env_url.route("/health"), timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        status, advertised = await request_json(
            client,
            "GET",
            env_url.route("/list_environments"),
            bearer_token=token,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            ok_statuses=(404,),
        )
        if status == 404:  # older servers: no /list_environments, hence no Task API
            return {
                "environment_name": environment_name,
                "task_api": "unsupported",
                "splits": [],
                "tasks": [],
            }
        if not isinstance(advertised, list) or not all(isinstance(n, str) for n in advertised):
            raise EnvironmentProtocolError(f"GET {env_url.route('/list_environments')}: not an array of strings")
        name = _choose_environment(advertised, environment_name)
        tasks_api = TaskClient(
            client,
            env_url,
            name,
            bearer_token=token,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        catalog: dict[str, Any] = {"environment_name": name, "task_api": "available"}
        try:
            splits = await tasks_api.splits()
        except TaskApiUnsupported:
            return {**catalog, "task_api": "unsupported", "splits": [], "tasks": []}
        catalog["splits"] = splits
        if split is None:
            return {**catalog, "tasks": []}
        chosen = next((s["name"] for s in splits if s["name"].lower() == split.lower()), None)
        if chosen is None:
            valid = [str(s["name"]) for s in splits][:64]
            error = _selection_error(
                f"unknown split {split[:64]!r} for this environment; valid splits: "
                + (", ".join(valid) if valid else "(none advertised)")
            )
            error.details = {"split": split[:64], "valid_splits": valid}
            raise error
        try:
            count = await tasks_api.num_tasks(chosen)
            stop = min(start + limit, count)
            rows = await tasks_api.task_range(chosen, start, stop) if start < stop else []
        except TaskApiUnsupported:
            raise EnvironmentUnavailable(
                f"{task_route(env_url, name, 'num_tasks')}: the Task API stopped answering"
            ) from None
        if len(rows) > limit:
            raise EnvironmentProtocolError(
                f"{task_route(env_url, name, 'task_range')}: page longer than the limit {limit}"
            )
        return {
            **catalog,
            "selected_split": chosen,
            "num_tasks": count,
            "start": start,
            "stop": stop,
            "tasks": rows,
        }
