"""``create_app(settings)``: the REST facade over Temporal and S3 (OpenAPI at ``/docs``).

Routes stay thin: runs live in ``api.run_routes``, environment discovery and the training
preflight in ``api.discovery_routes``. Every failure answers the KilnError envelope
(``api.errors``). Access and body-size rules are ASGI middleware (``api.access``).
"""

from __future__ import annotations

from fastapi import FastAPI
from temporalio.client import Client

from api import dataset_routes, discovery_routes, metrics_routes, page_routes, run_routes
from api.access import BearerAccess, BodyLimit, LoopbackOnly, SecretToken, bound_host, required_token
from api.errors import ERROR_RESPONSES, install_error_handlers
from api.page_access import TokenCookie
from api.services import Services
from api.strict_json import StrictJson
from kiln.api_models import Health
from kiln.artifacts.store import S3Store
from kiln.settings import Settings

MAX_BODY_BYTES = 1024 * 1024


def create_app(settings: Settings, *, client: Client | None = None, store: S3Store | None = None) -> FastAPI:
    """Build the API. Refuses (``api_configuration_invalid``) a non-loopback bind without a token.

    ``client``/``store`` may be injected (tests); otherwise they are created on first use.
    """
    token = required_token(settings)
    app = FastAPI(
        title="Kiln",
        version="0.1.0",
        description="OpenEnv environments in, verified LoRA adapters out. Every run is a Temporal workflow.",
    )
    app.state.services = Services(settings, client=client, store=store)
    install_error_handlers(app)

    @app.get("/healthz", tags=["health"], response_model=Health)
    async def healthz() -> Health:
        return Health()

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
            for name in ("HTTPValidationError", "ValidationError"):
                document.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def app_from_env() -> FastAPI:
    """uvicorn factory: ``uvicorn --factory api.app:app_from_env``.

    The token rule follows the address uvicorn really binds (``--host``), not ``KILN_API_HOST``;
    a bind Kiln can not see (not uvicorn, or an inherited fd) is treated as remote.
    """
    from kiln.settings import load_settings

    settings = load_settings()
    host = bound_host()
    return create_app(settings.model_copy(update={"api_host": host if host is not None else "0.0.0.0"}))
