"""``create_app(settings)``: the REST facade over Temporal and S3 (OpenAPI at ``/docs``, offline).

Routes stay thin: runs live in ``api.run_routes``, environment discovery and the training
preflight in ``api.discovery_routes``. Every failure answers the KilnError envelope
(``api.errors``). Access and body-size rules are ASGI middleware (``api.access``).
"""

from __future__ import annotations


from fastapi import FastAPI
from temporalio.client import Client

from api import dataset_routes, discovery_routes, metrics_routes, page_routes, run_routes
from api.access import BearerAccess, BodyLimit, LoopbackOnly, SecretToken, bound_host, required_token
from api.body_timeout import BodyTimeout
from api.docs_pages import install_docs_pages
from api.errors import ERROR_RESPONSES, install_error_handlers
from api.health import health
from api.runs import RUN_STATES
from api.page_access import TokenCookie
from api.services import Services
from api.strict_json import StrictJson
from kiln.api_models import Health
from kiln.core.artifacts.store import S3Store
from kiln.core.settings import Settings

MAX_BODY_BYTES = 1024 * 1024
UPLOAD_TIMEOUT_FACTOR = 10  # a dataset upload (up to 256 MiB) gets 10x the body timeout
# Enumerated query parameters, stated as enums in the OpenAPI document: (path, method, name) → values.
QUERY_ENUMS: dict[tuple[str, str, str], list[str]] = {
    ("/v1/openenv/runs", "get", "state"): list(RUN_STATES),
}


def create_app(settings: Settings, *, client: Client | None = None, store: S3Store | None = None) -> FastAPI:
    """Build the API. Refuses (``api_configuration_invalid``) a non-loopback bind without a token.

    ``client``/``store`` may be injected (tests); otherwise they are created on first use.
    """
    token = required_token(settings)
    app = FastAPI(
        title="Kiln",
        version="0.1.0",
        description="OpenEnv environments in, verified LoRA adapters out. Every run is a Temporal workflow.",
        docs_url=None,  # api.docs_pages serves /docs and /redoc with local assets (no CDN)
        redoc_url=None,
    )
    app.state.services = Services(settings, client=client, store=store)
    install_error_handlers(app)
    install_docs_pages(app)

    @app.get("/healthz", tags=["health"], response_model=Health)
    async def healthz() -> Health:
        """200 while the API answers; ``status`` ok/degraded and each component (``api.health``)."""
        return Health.model_validate(await health(app.state.services))

    app.include_router(page_routes.data, responses=ERROR_RESPONSES)
    app.include_router(run_routes.router, responses=ERROR_RESPONSES)
    app.include_router(page_routes.router)
    app.include_router(metrics_routes.router)
    app.include_router(discovery_routes.router, responses=ERROR_RESPONSES)
    app.include_router(dataset_routes.router, responses=ERROR_RESPONSES)
    _document_errors_as_400(app)
    app.add_middleware(StrictJson)  # inside BodyLimit: only bodies within the size bound are parsed
    app.add_middleware(
        BodyLimit,
        limit=MAX_BODY_BYTES,
        path_limits={dataset_routes.UPLOAD_PATH: dataset_routes.MAX_DATASET_BYTES},
    )
    app.add_middleware(  # around BodyLimit: the body it reads up front arrives in bounded time
        BodyTimeout,
        timeout_s=settings.api_body_timeout_s,
        path_timeouts={dataset_routes.UPLOAD_PATH: settings.api_body_timeout_s * UPLOAD_TIMEOUT_FACTOR},
    )
    if token is not None:
        app.add_middleware(BearerAccess, token=SecretToken(token))  # outermost: runs before the body is read
        app.add_middleware(TokenCookie)  # browsers: ?token= once → cookie → bearer (GET/HEAD only)
    else:
        app.add_middleware(LoopbackOnly)
    return app


def _document_errors_as_400(app: FastAPI) -> None:
    """The OpenAPI document states what the API answers: validation failures are 400 in the Kiln
    envelope (``api.errors``), never FastAPI's default 422."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = build()
            for path in document.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for (route, method, name), values in QUERY_ENUMS.items():
                operation = document.get("paths", {}).get(route, {}).get(method, {})
                for parameter in operation.get("parameters", []):
                    if parameter.get("in") == "query" and parameter.get("name") == name:
                        _set_enum(parameter.setdefault("schema", {}), values)
            for name in ("HTTPValidationError", "ValidationError"):
                document.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to override the schema


def _set_enum(schema: dict, values: list[str]) -> None:
    """Put ``enum`` on the string branch of a (possibly optional, ``anyOf``) parameter schema."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "string":
            branch["enum"] = values


def app_from_env() -> FastAPI:
    """uvicorn factory: ``uvicorn --factory api.app:app_from_env``.

    The token rule follows the address uvicorn really binds (``--host``), not ``KILN_API_HOST``;
    a bind Kiln can not see (not uvicorn, or an inherited fd) is treated as remote.
    """
    from kiln.core.settings import load_settings

    settings = load_settings()
    host = bound_host()
    return create_app(settings.model_copy(update={"api_host": host if host is not None else "0.0.0.0"}))
