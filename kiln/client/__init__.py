"""Kiln from Python: ``from kiln.client import Client``.

    client = Client("http://127.0.0.1:8000", token=None)
    run = client.train("http://127.0.0.1:8990", output_adapter="counter-agent", groups=4)
    print(run.training.steps, run.manifest.sha256)

Answers are typed (``RunView``, ``RunList``, follow events); failures raise the ``KilnError`` of
the same ``code`` the API, CLI and run status use (``kiln.errors``).
"""

from kiln.client.client import AsyncClient, Client, raise_for_outcome
from kiln.client.events import (
    PhaseChanged,
    ProgressMade,
    RunEnded,
    RunEvent,
    TrainingStep,
    WarningRaised,
)
from kiln.contracts import EchoConfig, EnvironmentEvalConfig, GateConfig, RunRequest, TrainingConfig
from kiln.errors import KilnError
from kiln.run_view import RunList, RunSummary, RunView

__all__ = [
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
