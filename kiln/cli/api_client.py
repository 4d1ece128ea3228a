"""A small client of Kiln's REST API for the CLI (``KILN_API_URL``, default the local one)."""

from __future__ import annotations

from typing import Any

import httpx

from kiln.errors import KilnError, error_from_dict


class ApiUnavailable(KilnError):
    code = "api_unavailable"
    retryable = True


class ApiClient:
    def __init__(self, base_url: str, *, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s, follow_redirects=False)

    def _call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiUnavailable(
                f"cannot reach the Kiln API at {self.base_url}: {type(exc).__name__}",
                hint="start it with `kiln serve` or set KILN_API_URL",
            ) from None
        try:
            body = response.json()
        except ValueError:
            body = {"code": "internal_error", "message": response.text[:500]}
        if response.status_code >= 400:
            if isinstance(body, dict) and "code" in body:
                raise error_from_dict(body)
            raise KilnError(f"{method} {path} answered HTTP {response.status_code}")
        return response.status_code, body

    def submit(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self._call("POST", "/v1/openenv/runs", json=request)

    def status(self, run_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/openenv/runs/{run_id}")[1]

    def runs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/openenv/runs")[1]["runs"]

    def cancel(self, run_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/openenv/runs/{run_id}/cancel")[1]
