"""The errors of Kiln's doors: the REST API's answers, the API client, the command line and
``kiln serve``. Each class fixes its stable ``code``.
"""

from __future__ import annotations

from kiln.core.errors.base import KilnError


class ApiUnavailable(KilnError):
    """The Kiln API could not be reached at all (nothing listening, DNS, TLS, a dropped socket)."""

    code = "api_unavailable"
    retryable = True


class OutputExists(KilnError):
    """A download would overwrite a file (or names a folder) and ``--force`` was not given."""

    code = "openenv_artifact_output_exists"
    http_status = 409


class ServeConfigurationInvalid(KilnError):
    """``kiln serve`` refused its configuration; nothing was started."""

    code = "serve_configuration_invalid"


class ServeStartFailed(KilnError):
    """A part of ``kiln serve`` failed to start; everything it had started was stopped."""

    code = "serve_start_failed"


class ApiConfigurationError(KilnError):
    """The API's own settings are unusable (a non-loopback bind without ``KILN_API_TOKEN``)."""

    code = "api_configuration_invalid"


class IdempotencyConflict(KilnError):
    """An ``idempotency_key`` was reused with a different request body."""

    code = "openenv_run_idempotency_conflict"
    http_status = 409


class RunNotCancellable(KilnError):
    """The run already ended; there is nothing to cancel."""

    code = "openenv_run_not_cancellable"
    http_status = 409


class Unauthorized(KilnError):
    """The request carries no bearer token, or the wrong one."""

    code = "unauthorized"
    http_status = 401


class RouteNotFound(KilnError):
    """No API route has this path."""

    code = "not_found"
    http_status = 404


class MethodNotAllowed(KilnError):
    """The route exists, but not for this HTTP method (the answer's ``Allow`` names those that do)."""

    code = "method_not_allowed"
    http_status = 405


class RequestBodyTimeout(KilnError):
    """The request body did not arrive in time (``KILN_API_BODY_TIMEOUT_S``); the connection closes."""

    code = "request_body_timeout"
    http_status = 408
    retryable = True


class RequestTooLarge(KilnError):
    """The request body is over the route's size limit."""

    code = "openenv_request_too_large"
    http_status = 413


class ServeGaveUp(KilnError):
    """A child of ``kiln serve`` kept failing right after each restart; serve stopped everything."""

    code = "serve_gave_up"


UNCLAIMED_HINT = (
    "Kiln's run workflows run on the control task queue (KILN_CONTROL_TASK_QUEUE, default kiln-control): "
    "cancel this run and start it there, or start a worker that polls this queue"
)


class RunUnclaimed(KilnError):
    """A follow ended on a run that no worker has picked up, and none polls its task queue."""

    code = "run_unclaimed"
    http_status = 409


# --- The command line's own parse errors ---------------------------------
class CliUsageError(KilnError):
    """The command line did not parse (an unknown option or command, a bad choice or type, a
    missing argument); nothing ran. Under ``--json`` it is printed as the usual error envelope."""

    code = "cli_usage_error"
    http_status = 400
