"""A deliberately misbehaving OpenEnv-like server on loopback, one behaviour per path prefix.

Use base URL ``http://127.0.0.1:P/<case>``; every route of that base (``/health``, ``/metadata``,
``/schema``, ``/list_environments``, ``/openapi.json``, ``/ws``) then misbehaves as ``<case>`` says.
``GET /_hits`` returns how often each ``<case> <route>`` was requested (including the probe
targets of redirects and external ``$ref``s, which Kiln must never touch).

Cases (discovery): ``ok``, ``health503``, ``redirect_health``, ``redirect`` (``/metadata`` → 302),
``reflect`` (bodies and frames echo the Authorization header), ``bigmeta`` (Content-Length over
2 MiB), ``streambig`` (chunked body over 2 MiB), ``badjson``, ``extref_http``, ``extref_file``,
``extref_nested``, ``badref``.
Cases (WebSocket): ``malformed_json``, ``binary``, ``oversize`` (600 KiB frame), ``unsolicited``
(an extra frame 100 ms after the reset reply), ``capacity`` (refusal after the handshake),
``capfirst-N-<nonce>`` (refuse the first N connections), ``slow`` (reset reply after 3 s),
``wrong_type``, ``close_no_reply``, ``session_error`` (on step), ``inf_reward``, ``close1011``
(the server closes with 1011 instead of answering the reset), ``huge_reward`` (every step rewards
1e308, so two steps overflow a float return), ``stall_step`` (steps are never answered).
Cases (documents): ``deepmeta`` (``/metadata`` nested 100 000 levels deep).

Run: ``python -m tests.support.hostile_server --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse

ACTION_SCHEMA = {
    "$defs": {"Op": {"enum": ["add", "sub"], "type": "string"}},
    "additionalProperties": False,
    "properties": {
        "metadata": {"type": "object", "additionalProperties": True},
        "op": {"$ref": "#/$defs/Op", "default": "add"},
        "amount": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["amount"],
    "title": "HostileAction",
    "type": "object",
}


def _error(code: str, message: str, **extra: Any) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **extra}})


def _observation(count: int, reward: Any = None, done: bool = False, extra: str = "") -> dict:
    return {
        "type": "observation",
        "data": {"observation": {"metadata": {}, "count": count, "note": extra}, "reward": reward, "done": done},
    }


def build_app() -> FastAPI:
    app = FastAPI(title="hostile", version="1.0.0")
    hits: Counter[str] = Counter()

    def auth(request: Request | WebSocket) -> str:
        return request.headers.get("authorization", "")

    @app.get("/_hits")
    async def get_hits() -> dict:
        return dict(hits)

    @app.get("/_probe/{name}")
    async def probe(name: str) -> dict:
        hits[f"_probe {name}"] += 1
        return {"type": "object"}

    @app.get("/{case}/health")
    async def health(case: str) -> Response:
        hits[f"{case} health"] += 1
        if case == "health503":
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        if case == "redirect_health":
            return RedirectResponse("/_probe/redirected", status_code=302)
        return JSONResponse({"status": "healthy"})

    @app.get("/{case}/metadata")
    async def metadata(case: str, request: Request) -> Response:
        hits[f"{case} metadata"] += 1
        body = {"name": "hostile", "description": f"case {case}", "version": "0.0.1"}
        if case == "redirect":
            return RedirectResponse("/_probe/redirected", status_code=302)
        if case == "reflect":
            body["description"] = f"you sent {auth(request)}"
        if case == "deepmeta":
            depth = 100_000
            return Response(b'{"name":' + b"[" * depth + b"]" * depth + b"}", media_type="application/json")
        if case == "badjson":
            return PlainTextResponse('{"name": "x", ', media_type="application/json")
        if case == "bigmeta":
            blob = b'{"name":"x","description":"' + b"a" * (3 * 1024 * 1024) + b'"}'
            return Response(blob, media_type="application/json")
        if case == "streambig":

            async def chunks():
                yield b'{"name":"x","description":"'
                for _ in range(48):
                    yield b"a" * 65536
                yield b'"}'

            return StreamingResponse(chunks(), media_type="application/json")
        return JSONResponse(body)

    @app.get("/{case}/schema")
    async def schema(case: str, request: Request) -> dict:
        hits[f"{case} schema"] += 1
        action: Any = ACTION_SCHEMA
        port = request.url.port
        if case == "extref_http":
            action = {"$ref": f"http://127.0.0.1:{port}/_probe/external-schema"}
        elif case == "extref_file":
            action = {"type": "object", "properties": {"x": {"$ref": "file:///etc/hostname"}}}
        elif case == "extref_nested":
            action = {
                "type": "object",
                "$defs": {"Far": {"$ref": f"http://127.0.0.1:{port}/_probe/far#/x"}},
                "properties": {"amount": {"$ref": "#/$defs/Far"}},
            }
        elif case == "badref":
            action = {"type": "object", "properties": {"amount": {"$ref": "#/$defs/Missing"}}}
        return {"action": action, "observation": {"type": "object"}, "state": {"type": "object"}}

    @app.get("/{case}/list_environments")
    async def list_environments(case: str) -> list:
        hits[f"{case} list_environments"] += 1
        return ["hostile"]

    @app.get("/{case}/openapi.json")
    async def openapi(case: str) -> dict:
        hits[f"{case} openapi"] += 1
        return {"openapi": "3.1.0", "info": {"title": "hostile", "version": "1.0.0"}, "paths": {}}

    @app.websocket("/{case}/ws")
    async def ws(websocket: WebSocket, case: str) -> None:
        hits[f"{case} ws"] += 1
        await websocket.accept()
        if case == "capacity" or (
            case.startswith("capfirst-") and hits[f"{case} ws"] <= int(case.split("-")[1])
        ):
            await websocket.send_text(
                _error(
                    "CAPACITY_REACHED",
                    "Server at capacity: 1/1 sessions active. Cannot accept new connections.",
                    active_sessions=1,
                    max_sessions=1,
                )
            )
            await websocket.close(1000)
            return
        count = 0
        try:
            while True:
                text = await websocket.receive_text()
                request = json.loads(text)
                kind = request.get("type")
                if kind == "close":
                    await websocket.close(1000)
                    return
                if kind == "state":
                    await websocket.send_text(json.dumps({"type": "state", "data": {"count": count}}))
                    continue
                if kind == "reset":
                    count = 0
                    if case == "malformed_json":
                        await websocket.send_text('{"type": "observation", "data": {')
                        continue
                    if case == "binary":
                        await websocket.send_bytes(json.dumps(_observation(0)).encode())
                        continue
                    if case == "oversize":
                        await websocket.send_text(json.dumps(_observation(0, extra="x" * (600 * 1024))))
                        continue
                    if case == "slow":
                        await asyncio.sleep(3.0)
                    if case == "wrong_type":
                        await websocket.send_text(json.dumps({"type": "state", "data": {}}))
                        continue
                    if case == "close_no_reply":
                        await websocket.close(1000)
                        return
                    if case == "close1011":
                        await websocket.close(1011)
                        return
                    if case == "reflect":
                        await websocket.send_text(json.dumps(_observation(0, extra=auth(websocket))))
                        continue
                    if case == "inf_reward":
                        await websocket.send_text(
                            '{"type":"observation","data":{"observation":{},"reward":1e999,"done":false}}'
                        )
                        continue
                    await websocket.send_text(json.dumps(_observation(0)))
                    if case == "unsolicited":
                        await asyncio.sleep(0.1)
                        await websocket.send_text(json.dumps(_observation(0, extra="surprise")))
                    continue
                if kind == "step":
                    if case == "session_error":
                        await websocket.send_text(_error("SESSION_ERROR", "boom"))
                        await websocket.close(1000)
                        return
                    if case == "stall_step":
                        await asyncio.sleep(3600)
                    count += int((request.get("data") or {}).get("amount", 1))
                    reward = 1e308 if case == "huge_reward" else 1
                    await websocket.send_text(json.dumps(_observation(count, reward=reward, done=count >= 3 and case != "huge_reward")))
                    continue
                await websocket.send_text(_error("UNKNOWN_TYPE", f"Unknown message type: {kind}"))
        except WebSocketDisconnect:
            return

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="hostile OpenEnv test server")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(), host="127.0.0.1", port=args.port, log_level="warning", ws_ping_interval=None)


if __name__ == "__main__":
    main()
