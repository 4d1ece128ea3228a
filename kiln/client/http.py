"""The one HTTP layer of Kiln's REST API, under ``kiln.client.Client`` and the CLI alike.

Where: ``KILN_API_URL``, else the settings' ``KILN_API_HOST``/``KILN_API_PORT`` (the same default
the API binds, ``Settings.api_port``; a wildcard bind is reached on loopback). Sends
``Authorization: Bearer $KILN_API_TOKEN`` when a token is set; never follows redirects; turns error envelopes back into KilnErrors with the same code; run payloads are
parsed into ``kiln.core.run_view`` models (``RunView``, ``RunSummary``). A request that is safe to
repeat (a GET, a submission with an idempotency key) is retried with backoff while the API
answers 503 ``temporal_unavailable`` (Temporal restarting), for up to ``outage_wait_s``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any, Self
from urllib.parse import quote

import httpx

from kiln.core.errors import ApiUnavailable, KilnError, error_from_dict
from kiln.core.run_view import RunList, RunView
from kiln.core.tolerant import TOLERANT_CONTEXT

_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}


def resolve_api_url(url: str | None = None) -> str:
    """``url``; else ``KILN_API_URL``; else ``http://KILN_API_HOST:KILN_API_PORT`` with the API's
    own defaults (a wildcard bind such as ``0.0.0.0`` is reached at 127.0.0.1)."""
    if url:
        return url.rstrip("/")
    from kiln.core.settings import load_settings

    settings = load_settings()
    if settings.api_url:
        return settings.api_url.rstrip("/")
    host = "127.0.0.1" if settings.api_host in _WILDCARD_HOSTS else settings.api_host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.api_port}"


def resolve_token(token: str | None = None) -> str | None:
    """``token``; else ``KILN_API_TOKEN``; blank means none."""
    if token is None:
        token = os.environ.get("KILN_API_TOKEN")
    return (token or "").strip() or None


def run_path(run_id: str, *parts: str) -> str:
    """``/v1/openenv/runs/<run_id>[/part…]`` with each component percent-encoded."""
    path = f"/v1/openenv/runs/{quote(run_id, safe='')}"
    for part in parts:
        path += "/" + quote(part, safe="/")
    return path


def artifact_path(run_id: str, name: str) -> str:
    """The canonical download path of a manifest-declared artifact."""
    return run_path(run_id, "artifacts", name)


OUTAGE_CODE = "temporal_unavailable"


def _repeatable(method: str, kwargs: dict[str, Any]) -> bool:
    """A GET, or a POST whose JSON body names an idempotency key (the server dedupes it)."""
    body = kwargs.get("json")
    return method == "GET" or (isinstance(body, dict) and body.get("idempotency_key") is not None)


class Closing:
    """A client that holds connections: ``with Client() as c`` closes it at the end of the block."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ApiClient(Closing):
    """Typed calls of the REST API; ``base_url``/``token`` None resolve as the module says."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout_s: float = 30.0,
        token: str | None = None,
        outage_wait_s: float = 60.0,
    ) -> None:
        self.base_url = resolve_api_url(base_url)
        self.outage_wait_s = outage_wait_s
        token = resolve_token(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s, follow_redirects=False, headers=headers)

    def __repr__(self) -> str:  # never shows the token
        return f"ApiClient({self.base_url!r})"

    def close(self) -> None:
        self._client.close()

    def alive(self) -> bool:
        """``GET /healthz`` answers 200 (the API process is up; no dependency is checked)."""
        try:
            return self._client.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def _unavailable(self, exc: Exception) -> ApiUnavailable:
        return ApiUnavailable(
            f"cannot reach the Kiln API at {self.base_url}: {type(exc).__name__}",
            hint="start it with `kiln serve`, or point KILN_API_URL (or KILN_API_HOST/KILN_API_PORT) at it",
        )

    @staticmethod
    def _raise_for(response: httpx.Response, method: str, path: str) -> None:
        if response.status_code < 400:
            return
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "code" in body:
            raise error_from_dict(body)
        raise KilnError(f"{method} {path} answered HTTP {response.status_code}")

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; a repeatable one is retried while the API reports a Temporal outage."""
        deadline = time.monotonic() + (self.outage_wait_s if _repeatable(method, kwargs) else 0.0)
        delay = 0.5
        while True:
            try:
                response = self._client.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                raise self._unavailable(exc) from None
            if response.status_code != 503 or time.monotonic() + delay > deadline:
                return response
            try:
                code = response.json().get("code")
            except (ValueError, AttributeError):
                code = None
            if code != OUTAGE_CODE:
                return response
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        response = self._request(method, path, **kwargs)
        self._raise_for(response, method, path)
        try:
            return response.status_code, response.json()
        except ValueError:
            raise KilnError(f"{method} {path} answered a body that is not JSON") from None

    def get_bytes(self, path: str) -> bytes:
        response = self._request("GET", path, headers={"Accept-Encoding": "identity"})
        self._raise_for(response, "GET", path)
        return response.content

    @contextlib.contextmanager
    def stream(self, path: str) -> Iterator[httpx.Response]:
        """A streamed GET (identity encoding, no redirects); error envelopes raise KilnErrors."""
        try:
            with self._client.stream("GET", path, headers={"Accept-Encoding": "identity"}) as response:
                if response.status_code >= 400:
                    response.read()
                    self._raise_for(response, "GET", path)
                yield response
        except httpx.HTTPError as exc:
            raise self._unavailable(exc) from None

    # ------------------------------------------------------------------ runs
    def submit(self, request: dict[str, Any], *, preflight: bool = True) -> tuple[int, RunView]:
        """Submit a run; ``preflight=False`` skips the server's submit-time ``/health`` check."""
        params = None if preflight else {"preflight": "false"}
        code, body = self._call("POST", "/v1/openenv/runs", json=request, params=params)
        return code, RunView.model_validate(body, context=TOLERANT_CONTEXT)

    def status(self, run_id: str) -> RunView:
        return RunView.model_validate(self._call("GET", run_path(run_id))[1], context=TOLERANT_CONTEXT)

    def runs(self, state: str | None = None) -> RunList:
        """``GET /v1/openenv/runs``: ``{"schema", "runs": [...]}``, newest first."""
        params = {"state": state} if state else None
        return RunList.model_validate(self._call("GET", "/v1/openenv/runs", params=params)[1], context=TOLERANT_CONTEXT)

    def cancel(self, run_id: str) -> RunView:
        return RunView.model_validate(self._call("POST", run_path(run_id, "cancel"))[1], context=TOLERANT_CONTEXT)

    def manifest_bytes(self, run_id: str) -> bytes:
        return self.get_bytes(run_path(run_id, "artifacts"))

    # ------------------------------------------------------------------ environments
    def tasks(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/openenv/tasks", json=body)[1]

    def upload_dataset(self, data: bytes) -> dict[str, Any]:
        """Store a rollouts JSONL; returns ``{uri, sha256, bytes}``."""
        return self._call(
            "PUT", "/v1/datasets", content=data, headers={"Content-Type": "application/x-ndjson"}, timeout=300.0
        )[1]

    def train_dataset(self, body: dict[str, Any]) -> RunView:
        return RunView.model_validate(self._call("POST", "/v1/train/grpo", json=body)[1], context=TOLERANT_CONTEXT)

    def preflight(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/openenv/training/preflight", json=body, timeout=400.0)[1]
