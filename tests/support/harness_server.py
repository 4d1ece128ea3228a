"""An OpenEnv 0.10 harness server (RFC 005), built with the real ``openenv`` package: a
``HarnessEnvironment`` whose adapter wraps a scripted agent (each message is answered by one
``llm_chunk`` and ``turn_complete``), served in production mode (``/harness`` registered) or
simulation mode. Kiln refuses it at inspect (``openenv_harness_unsupported``). Run:
``python -m tests.support.harness_server --port P [--production]``.
"""

from __future__ import annotations

import argparse
from typing import Any, AsyncIterator

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.types import Observation
from openenv.core.harness.adapter import AgenticHarnessAdapter
from openenv.core.harness.environment import HarnessAction, HarnessEnvironment
from openenv.core.harness.events import HarnessEvent, HarnessEventType


class EchoAgent(AgenticHarnessAdapter):
    """A scripted harness: it echoes each message back in one turn."""

    def __init__(self) -> None:
        self.running = False

    async def start(self, working_directory: str) -> None:
        self.running = True

    async def stop(self) -> None:
        self.running = False

    async def inject_tools(self, tools: Any) -> None:  # noqa: D102
        return None

    async def send_message_streaming(self, message: str) -> AsyncIterator[HarnessEvent]:  # type: ignore[override]
        yield HarnessEvent(type=HarnessEventType.LLM_CHUNK, data={"text": f"echo: {message}"})
        yield HarnessEvent(type=HarnessEventType.TURN_COMPLETE, data={})

    async def is_alive(self) -> bool:
        return self.running


class EchoHarnessEnvironment(HarnessEnvironment):
    def __init__(self) -> None:
        super().__init__(EchoAgent())


def build_app(production: bool = False) -> Any:
    return create_app(EchoHarnessEnvironment, HarnessAction, Observation, env_name="echo_harness",
                      mode="production" if production else "simulation")


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--production", action="store_true")
    args = parser.parse_args(argv)
    uvicorn.run(build_app(args.production), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
