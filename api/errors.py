"""The API's error envelope: every failure answers ``{code, message, retryable, hint?, details?}``.

KilnError subclasses carry their own code and HTTP status. FastAPI's own failures (request
validation, unknown route, wrong method — with ``Allow``) are mapped onto the same envelope so a
client only ever parses one error shape, and so is a Temporal outage (503 ``temporal_unavailable``,
retryable), whichever route met it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from temporalio.service import RPCError, RPCStatusCode

from kiln.core.errors import (  # the API's own classes live there too; re-exported for old imports
    ApiConfigurationError,
    IdempotencyConflict,
    InspectionFailed,
    InvalidRequest,
    KilnError,
    MethodNotAllowed,
    PreflightFailed,
    RequestTooLarge,
    RouteNotFound,
    RunNotCancellable,
    TaskCatalogFailed,
    TemporalUnavailable,
    Unauthorized,
)
from kiln.core.telemetry.prometheus import count_error

__all__ = [
    "ApiConfigurationError",
    "IdempotencyConflict",
    "InspectionFailed",
    "PreflightFailed",
    "RequestTooLarge",
    "RunNotCancellable",
    "TaskCatalogFailed",
    "Unauthorized",
    "error_response",
    "install_error_handlers",
]


class ErrorEnvelope(BaseModel):
    """The one error shape every route answers."""

    code: str = Field(description="Stable Kiln error code (docs/errors.md)")
    message: str
    retryable: bool
    hint: str | None = None
    stage: str | None = None
    details: dict[str, Any] | None = None


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorEnvelope, "description": text}
    for status, text in (
        (400, "invalid request"),
        (401, "missing or wrong bearer token"),
        (403, "forbidden"),
        (404, "not found"),
        (409, "conflict"),
        (413, "body too large"),
        (502, "an environment did not answer usably"),
        (503, "a dependency is unavailable"),
    )
}


def error_response(error: KilnError) -> JSONResponse:
    """The JSON envelope of ``error`` with its HTTP status (401 adds ``WWW-Authenticate``)."""
    headers = {"WWW-Authenticate": "Bearer"} if error.http_status == 401 else None
    count_error(error.code)
    if error.http_status == 503:
        headers = {"Retry-After": "5"}
    return JSONResponse(status_code=error.http_status, content=error.to_dict(), headers=headers)


# What the Temporal SDK answers when its server cannot be reached (stopped, restarting, overloaded).
_OUTAGE_STATUSES = (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED)


def temporal_outage(error: BaseException) -> TemporalUnavailable | None:
    """``temporal_unavailable`` (503, retryable) when ``error`` says Temporal could not be reached."""
    if isinstance(error, RPCError) and error.status in _OUTAGE_STATUSES:
        return TemporalUnavailable(
            "the Temporal server is not reachable right now",
            hint="retry in a few seconds; `kiln serve` restarts its Temporal by itself, otherwise "
            "check the server at KILN_TEMPORAL_ADDRESS",
        )
    return None


def validation_message(errors: list[dict[str, Any]]) -> str:
    """``field.path: reason`` per problem, without echoing submitted values."""
    parts: list[str] = []
    for item in errors:
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        msg = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc) or 'body'}: {msg}")
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every failure into the one envelope."""

    @app.exception_handler(KilnError)
    async def _kiln(_request: Request, error: KilnError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(_invalid(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            return error_response(RouteNotFound("no such route"))
        if error.status_code == 405:
            allowed = allowed_methods(request)
            response = error_response(
                MethodNotAllowed(
                    "method not allowed on this route",
                    hint=f"use {', '.join(allowed)}" if allowed else None,
                )
            )
            response.headers["Allow"] = ", ".join(allowed)
            return response
        return error_response(_status_error(error.status_code, str(error.detail)))

    @app.exception_handler(RPCError)
    async def _temporal(_request: Request, error: RPCError) -> JSONResponse:
        outage = temporal_outage(error)
        if outage is not None:
            return error_response(outage)
        return error_response(KilnError("internal error: the Temporal server refused the call", code="internal_error"))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, error: Exception) -> JSONResponse:
        outage = temporal_outage(error)
        if outage is not None:
            return error_response(outage)
        return error_response(KilnError(f"internal error: {type(error).__name__}", code="internal_error"))


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app fully accepts on this request's path (the 405 ``Allow``)."""
    return [
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in request.app.routes)
    ]


def _invalid(error: RequestValidationError) -> KilnError:
    return InvalidRequest(
        f"invalid request: {validation_message(list(error.errors()))}",
        hint="fix the named fields; unknown fields are rejected",
    )


def _status_error(status: int, detail: str) -> KilnError:
    error = KilnError(detail, code=f"http_{status}")
    error.http_status = status
    return error
