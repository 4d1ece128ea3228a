"""Example OpenEnv environment servers (each a real ``openenv.core`` ``create_app`` server).

``kiln example-env NAME --port P`` serves one of them with uvicorn on loopback.
"""

from __future__ import annotations

import importlib
from typing import Any

EXAMPLE_ENVS = {
    "counter": "examples.envs.counter.server",
    "taskbank": "examples.envs.taskbank.server",
    "guess": "examples.envs.guess.server",
}


def build_example_app(name: str, **options: Any) -> Any:
    """Build the FastAPI app of example environment ``name``."""
    if name not in EXAMPLE_ENVS:
        raise KeyError(f"unknown example environment {name!r}; known: {sorted(EXAMPLE_ENVS)}")
    module = importlib.import_module(EXAMPLE_ENVS[name])
    return module.build_app(**options)
