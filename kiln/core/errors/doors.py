"""The errors of Kiln's doors: the REST API's answers, the API client, the command line and
``kiln serve``. Each class fixes its stable ``code``.
"""

from __future__ import annotations

from kiln.core.errors.base import KilnError


class ApiUnavailable(KilnError, code="api_unavailable", retryable=True):
    """The Kiln API could not be reached at all (nothing listening, DNS, TLS, a dropped socket)."""


class OutputExists(KilnError, code="openenv_artifact_output_exists", http_status=409):
    """A download would overwrite a file (or names a folder) and ``--force`` was not given."""


class ServeConfigurationInvalid(KilnError, code="serve_configuration_invalid"):
    """``kiln serve`` refused its configuration; nothing was started."""


class ServeStartFailed(KilnError, code="serve_start_failed"):
    """A part of ``kiln serve`` failed to start; everything it had started was stopped."""


class ApiConfigurationError(KilnError, code="api_configuration_invalid"):
    """The API's own settings are unusable (a non-loopback bind without ``KILN_API_TOKEN``)."""


class IdempotencyConflict(KilnError, code="openenv_run_idempotency_conflict", http_status=409):
    """An ``idempotency_key`` was reused with a different request body."""


class RunNotCancellable(KilnError, code="openenv_run_not_cancellable", http_status=409):
    """The run already ended; there is nothing to cancel."""


class Unauthorized(KilnError, code="unauthorized", http_status=401):
    """The request carries no bearer token, or the wrong one."""


class RouteNotFound(KilnError, code="not_found", http_status=404):
    """No API route has this path."""


class MethodNotAllowed(KilnError, code="method_not_allowed", http_status=405):
    """The route exists, but not for this HTTP method (the answer's ``Allow`` names those that do)."""


class RequestBodyTimeout(KilnError, code="request_body_timeout", http_status=408, retryable=True):
    """The request body did not arrive in time (``KILN_API_BODY_TIMEOUT_S``); the connection closes."""


class RequestTooLarge(KilnError, code="openenv_request_too_large", http_status=413):
    """The request body is over the route's size limit."""


class ServeGaveUp(KilnError, code="serve_gave_up"):
    """A child of ``kiln serve`` kept failing right after each restart; serve stopped everything."""


UNCLAIMED_HINT = (
    "Kiln's run workflows run on the control task queue (KILN_CONTROL_TASK_QUEUE, default kiln-control): "
    "cancel this run and start it there, or start a worker that polls this queue"
)


class RunUnclaimed(KilnError, code="run_unclaimed", http_status=409):
    """A follow ended on a run that no worker has picked up, and none polls its task queue."""


# --- The command line's own parse errors ---------------------------------
class CliUsageError(KilnError, code="cli_usage_error", http_status=400):
    """The command line did not parse (an unknown option or command, a bad choice or type, a
    missing argument); nothing ran. Under ``--json`` it is printed as the usual error envelope."""
