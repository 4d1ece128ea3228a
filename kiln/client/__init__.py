"""Kiln from Python: ``from kiln.client import Client``.

    client = Client()  # KILN_API_URL, else the API's host and port (http://127.0.0.1:8780); KILN_API_TOKEN
    run = client.train("http://127.0.0.1:8990", output_adapter="counter-agent", groups=4)
    print(run.training.steps, run.manifest.sha256)

Answers are typed (``RunView``, ``RunList``, follow events); failures raise the ``KilnError`` of
the same ``code`` the API, CLI and run status use. Every error class is importable from here
(``from kiln.client import EnvironmentEvaluationFailed, ApiUnavailable``): they all live in
``kiln.core.errors``, registered as they are defined, so which class a code rebuilds never depends on
what else was imported.
"""

from typing import Any

from kiln.client.client import AsyncClient, Client, raise_for_outcome
from kiln.client.events import (
    PhaseChanged,
    ProgressMade,
    RunEnded,
    RunEvent,
    TrainingStep,
    WarningRaised,
)
from kiln.core.contracts import RunRequest
from kiln.core.training_config import EchoConfig, EnvironmentEvalConfig, GateConfig, TrainingConfig
from kiln.core import errors as _errors
from kiln.core.errors import ApiUnavailable, KilnError
from kiln.core.run_view import RunList, RunSummary, RunView


def __getattr__(name: str) -> Any:
    """Every ``KilnError`` class by its name (``kiln.client.ReplayDrift`` is ``kiln.core.errors.ReplayDrift``)."""
    value = getattr(_errors, name, None)
    if isinstance(value, type) and issubclass(value, KilnError):
        return value
    raise AttributeError(f"module 'kiln.client' has no attribute {name!r}")


def __dir__() -> list[str]:
    errors = [name for name, value in vars(_errors).items() if isinstance(value, type) and issubclass(value, KilnError)]
    return sorted(set(__all__) | set(errors))


__all__ = [
    "ApiUnavailable",
    "AsyncClient",
    "Client",
    "EchoConfig",
    "EnvironmentEvalConfig",
    "GateConfig",
    "KilnError",
    "PhaseChanged",
    "ProgressMade",
    "RunEnded",
    "RunEvent",
    "RunList",
    "RunRequest",
    "RunSummary",
    "RunView",
    "TrainingConfig",
    "TrainingStep",
    "WarningRaised",
    "raise_for_outcome",
]
