"""An older-profile OpenEnv server (mimics ``openenv-core`` 0.3.0) for compatibility tests.

Differences from ``openenv`` 0.10.0 that Kiln must tolerate: no ``/list_environments`` (404), no
Task API (every ``/{env}/...`` route is a plain 404), no ``reset_observation`` in ``/schema``, and
observation ``metadata`` dropped from WebSocket observations. The WebSocket ``/ws`` protocol is the
same lock-step protocol (including the connect-time ``CAPACITY_REACHED`` refusal).

Run: ``python -m tests.support.old_profile_server --port P [--max-concurrent-envs N]``.
"""

from __future__ import annotations

import json
import random
from typing import Any, Optional

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tests.support.server_main import serve_main


class OldAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any] = Field(default_factory=dict)
    amount: int = Field(ge=1, le=5)


class OldObservation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    done: bool = False
    reward: Optional[float] = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    count: int = 0
    target: int = 0


class OldState(BaseModel):
    model_config = ConfigDict(extra="allow")
    episode_id: Optional[str] = None
    step_count: int = 0


class _Counter:
    def __init__(self) -> None:
        self.count = 0
        self.target = 0
        self.step_count = 0
        self.episode_id: Optional[str] = None

    def reset(self, seed: Optional[int] = None, **_: Any) -> dict:
        self.target = random.Random(seed).randint(3, 6)
        self.count, self.step_count, self.episode_id = 0, 0, f"seed-{seed}"
        return self._observation(None, False)

    def step(self, action: OldAction) -> dict:
        self.step_count += 1
        self.count += action.amount
        done = self.count >= self.target
        return self._observation(1 if self.count <= self.target else 0, done)

    def _observation(self, reward: Any, done: bool) -> dict:
        # 0.3.0 drops observation metadata completely (observation, reward, done only).
        return {
            "observation": {"count": self.count, "target": self.target},
            "reward": reward,
            "done": done,
        }

    def state(self) -> dict:
        return {
            "episode_id": self.episode_id,
            "step_count": self.step_count,
            "count": self.count,
            "target": self.target,
        }


def _error(code: str, message: str, **extra: Any) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **extra}})


def build_app(max_concurrent_envs: int = 1) -> FastAPI:
    app = FastAPI(title="OpenEnv Environment HTTP API", version="1.0.0")
    active = {"n": 0}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "healthy"}

    @app.get("/metadata")
    async def metadata() -> dict:
        return {
            "name": "OldCounterEnvironment",
            "description": "OldCounterEnvironment environment",
            "readme_content": None,
            "version": "1.0.0",
            "author": None,
            "documentation_url": None,
        }

    @app.get("/schema")
    async def schema() -> dict:
        return {
            "action": OldAction.model_json_schema(),
            "observation": OldObservation.model_json_schema(),
            "state": OldState.model_json_schema(),
        }

    @app.post("/reset")
    async def http_reset(body: dict | None = None) -> dict:
        return _Counter().reset(**(body or {}))

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        if active["n"] >= max_concurrent_envs:
            await websocket.send_text(
                _error(
                    "CAPACITY_REACHED",
                    f"Server at capacity: {active['n']}/{max_concurrent_envs} sessions active. "
                    "Cannot accept new connections.",
                    active_sessions=active["n"],
                    max_sessions=max_concurrent_envs,
                )
            )
            await websocket.close(1000)
            return
        active["n"] += 1
        env = _Counter()
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    await websocket.send_text(_error("SESSION_ERROR", "'text'"))
                    await websocket.close(1000)
                    return
                try:
                    request = json.loads(text)
                except ValueError as exc:
                    await websocket.send_text(_error("INVALID_JSON", f"Invalid JSON: {exc}"))
                    continue
                if not isinstance(request, dict):
                    await websocket.send_text(
                        _error("SESSION_ERROR", f"'{type(request).__name__}' object has no attribute 'get'")
                    )
                    await websocket.close(1000)
                    return
                kind = request.get("type")
                if kind == "close":
                    await websocket.close(1000)
                    return
                if kind == "reset":
                    data = request.get("data") or {}
                    reply = {"type": "observation", "data": env.reset(**data)}
                elif kind == "step":
                    try:
                        action = OldAction.model_validate(request.get("data"))
                    except ValidationError as exc:
                        await websocket.send_text(
                            json.dumps(
                                {
                                    "type": "error",
                                    "data": {
                                        "message": "Invalid message",
                                        "code": "VALIDATION_ERROR",
                                        "errors": json.loads(exc.json()),
                                    },
                                }
                            )
                        )
                        continue
                    reply = {"type": "observation", "data": env.step(action)}
                elif kind == "state":
                    reply = {"type": "state", "data": env.state()}
                else:
                    await websocket.send_text(
                        _error("UNKNOWN_TYPE", f"Unknown message type: {kind or ''}")
                    )
                    continue
                await websocket.send_text(json.dumps(reply))
        except WebSocketDisconnect:
            return
        finally:
            active["n"] -= 1

    return app


def main(argv: list[str] | None = None) -> None:
    serve_main(build_app, __doc__, argv)


if __name__ == "__main__":
    main()
