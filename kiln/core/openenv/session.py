"""One lock-step OpenEnv WebSocket session.

Owns: the status-only ``/health`` check before every upgrade, the ``/ws`` connection, strict
lock-step request/reply with a per-request timeout, reply validation, poisoning, keepalive while
the policy generates, and best-effort close. Replies are ``kiln.core.openenv.replies``; opening a
session through capacity refusals is ``kiln.core.openenv.session_open``.

Error mapping (reference-behaviour §10):

* ``EnvironmentUnavailable`` (retryable): the health check fails, the upgrade fails (only the
  HTTP status is reported), a reply does not come within the request timeout, or the socket
  closes while a reply is awaited or while idle.
* ``EnvironmentProtocolError`` (not retryable): a binary frame, a frame over ``max_frame_bytes``,
  malformed JSON or frame shape, an unexpected reply type, any unsolicited message, or a frame that
  reflects the bearer token. ``details["reason"]`` names which.

Every transport failure poisons the session: it is closed and never used again, nothing is
resent. Wire error replies are not failures: they come back as ``StepResult(kind="protocol_error")``;
terminal codes mark the session closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from kiln.core.boundedjson import JsonBoundsError
from kiln.core.canonical import compact_json, strict_loads
from kiln.core.telemetry.prometheus import observe_round_trip
from kiln.core.errors import (
    EnvironmentProtocolError,
    EnvironmentUnavailable,
    KilnError,
)
from kiln.core.openenv.credentials import bearer_headers, contains_token, prepare_token
from kiln.core.openenv.probe import health_probe
from kiln.core.openenv.replies import TERMINAL_CODES, StepResult, observation_problem
from kiln.core.openenv.urls import EnvironmentUrl, coerce_url

MAX_CLIENT_FRAME_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_FRAME_BYTES = 512 * 1024
_CLOSE_TIMEOUT_S = 2.0

# websockets logs handshake headers (Authorization included) at DEBUG: keep that logger below DEBUG.
_WIRE_LOGGER = logging.getLogger("kiln.core.openenv.wire")
_WIRE_LOGGER.setLevel(logging.INFO)
log = logging.getLogger(__name__)


class _SocketClosed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _closed_reason(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, ConnectionClosed):
        sent, rcvd = exc.sent, exc.rcvd
        if (sent is not None and sent.code == 1009) or (rcvd is not None and rcvd.code == 1009):
            return "oversize_frame", "a frame exceeded the size limit (close 1009)"
        code = rcvd.code if rcvd is not None else (sent.code if sent is not None else None)
        # Only a normal close (1000/1001, or none) can be a capacity refusal whose frame was lost;
        # a server error (1011) or any other code is reported as itself.
        reason = "closed" if code in (None, 1000, 1001) else "closed_abnormally"
        return reason, "the socket closed" + (f" (code {code})" if code is not None else "")
    return "closed", f"the connection failed ({type(exc).__name__})"


def keepalive_interval(request_timeout_s: float) -> float:
    """``clamp(request_timeout / 4, 10 ms, 10 s)``."""
    return min(max(request_timeout_s / 4.0, 0.01), 10.0)


class EnvSession:
    """A strictly lock-step session on ``/ws``. Build with :meth:`open`."""

    def __init__(
        self,
        url: EnvironmentUrl,
        ws: ClientConnection,
        *,
        bearer_token: str | None,
        request_timeout_s: float,
        max_frame_bytes: int,
    ) -> None:
        self.url = url
        self.request_timeout_s = request_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.closed = False
        self.poisoned = False
        self.requests_sent = 0
        self._ws = ws
        self._token = bearer_token
        self._poison_error: KilnError | None = None
        self._poison_event = asyncio.Event()
        self._waiter: asyncio.Future | None = None
        self._early: list[str | bytes] = []
        self._lost: tuple[str, str] | None = None
        self._busy = False
        self._close_task: asyncio.Task | None = None
        self._finished = False
        self._answered = False  # an observation or state reply arrived (a real session)
        # Called once, synchronously, before the socket starts closing (the capacity book's
        # release: it must never count a session the server may already have freed).
        self.on_close: Callable[[], None] | None = None
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    # ----------------------------------------------------------------- opening
    @classmethod
    async def open(
        cls,
        url: EnvironmentUrl,
        *,
        bearer_token: str | None = None,
        request_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> "EnvSession":
        """Health check (exactly 200), then upgrade ``/ws``."""
        env_url = coerce_url(url)
        token = prepare_token(env_url, bearer_token)
        sock = await health_probe(
            env_url,
            bearer_token=token,
            connect_timeout_s=connect_timeout_s,
            timeout_s=request_timeout_s,
        )
        ws_url = env_url.websocket_url
        extra: dict[str, Any] = {} if sock is None else {"sock": sock}
        try:
            ws = await connect(
                ws_url,
                **extra,
                additional_headers=bearer_headers(token),
                open_timeout=connect_timeout_s,
                max_size=max_frame_bytes,
                compression=None,
                proxy=None,
                user_agent_header="kiln-openenv/1",
                close_timeout=_CLOSE_TIMEOUT_S,
                logger=_WIRE_LOGGER,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise EnvironmentUnavailable(
                f"WebSocket upgrade {ws_url}: HTTP {status}",
                retryable=status in (408, 425, 429, 500, 502, 503, 504),
                details={"http_status": status, "url": ws_url},
            ) from None
        except (TimeoutError, asyncio.TimeoutError):
            raise EnvironmentUnavailable(
                f"WebSocket upgrade {ws_url}: timed out after {connect_timeout_s:g}s",
                details={"url": ws_url, "reason": "timeout"},
            ) from None
        except ConnectionRefusedError:
            raise EnvironmentUnavailable(
                f"WebSocket upgrade {ws_url}: connection refused", details={"url": ws_url}
            ) from None
        except (OSError, InvalidHandshake, ConnectionClosed) as exc:
            raise EnvironmentUnavailable(
                f"WebSocket upgrade {ws_url}: failed ({type(exc).__name__})",
                details={"url": ws_url},
            ) from None
        finally:
            if sock is not None and sock.fileno() != -1 and "ws" not in locals():
                sock.close()
        return cls(
            env_url,
            ws,
            bearer_token=token,
            request_timeout_s=request_timeout_s,
            max_frame_bytes=max_frame_bytes,
        )

    # ------------------------------------------------------------------ reader
    async def _read_loop(self) -> None:
        try:
            while True:
                message = await self._ws.recv()
                self._dispatch(message)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - ConnectionClosed or anything the library raises
            self._connection_lost(exc)

    def _dispatch(self, message: str | bytes) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_result(message)
            return
        if self.requests_sent == 0 and not self._early:
            self._early.append(message)  # a connect-time refusal, read as the first reply
            return
        if self.closed:
            return
        self._poison(
            EnvironmentProtocolError(
                f"{self.url.websocket_url}: the server sent a message nobody asked for",
                details={"reason": "unsolicited_frame", "url": self.url.websocket_url},
            )
        )

    def _connection_lost(self, exc: BaseException) -> None:
        self._lost = _closed_reason(exc)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_exception(_SocketClosed(*self._lost))
            return
        if not self.closed and not self._early:
            reason, detail = self._lost
            self._poison(self._transport_error(reason, f"{detail} while idle"))

    # --------------------------------------------------------------- poisoning
    def _transport_error(self, reason: str, detail: str) -> KilnError:
        where = self.url.websocket_url
        details = {"reason": reason, "url": where}
        if reason in ("timeout", "closed", "closed_abnormally"):
            return EnvironmentUnavailable(f"{where}: {detail}", details=details)
        return EnvironmentProtocolError(f"{where}: {detail}", details=details)

    def _poison(self, error: KilnError) -> KilnError:
        if not self.poisoned and not self.closed:
            self.poisoned = True
            self._poison_error = error
            # A socket closed before any request is the connect-time refusal race (retried like
            # CAPACITY_REACHED): ordinary, counted by the caller, not worth a warning.
            level = logging.DEBUG if not self._answered else logging.WARNING
            log.log(level, "openenv session poisoned: %s", error.message)
            self._poison_event.set()
            self._start_close(send_close=False)
        return error

    def _check_usable(self) -> None:
        if self.poisoned and self._poison_error is not None:
            err = self._poison_error
            raise type(err)(err.message, details=err.details)
        if self.closed:
            raise EnvironmentProtocolError(
                f"{self.url.websocket_url}: the session is closed",
                details={"reason": "session_closed", "url": self.url.websocket_url},
            )

    # ----------------------------------------------------------------- requests
    async def _exchange(self, message: dict, expected: str) -> tuple[str, dict]:
        """Send one request and return ``(kind, data)`` with kind ``expected`` or ``"error"``."""
        self._check_usable()
        if self._busy:
            raise RuntimeError("EnvSession is lock-step: a request is already in flight")
        self._busy = True
        try:
            first = self.requests_sent == 0
            self.requests_sent += 1
            if first and self._early:
                raw = self._early.pop(0)
            else:
                started = time.perf_counter()
                raw = await self._send_and_wait(message)
                observe_round_trip(message.get("type"), time.perf_counter() - started)
            return self._decode(raw, expected)
        finally:
            self._busy = False

    async def _send_and_wait(self, message: dict) -> str | bytes:
        if self._lost is not None:
            reason, detail = self._lost
            raise self._poison(self._transport_error(reason, detail))
        text = compact_json(message).decode("utf-8")
        if len(text) > MAX_CLIENT_FRAME_BYTES or len(text.encode("utf-8")) > MAX_CLIENT_FRAME_BYTES:
            raise EnvironmentProtocolError(
                f"{self.url.websocket_url}: request frame exceeds {MAX_CLIENT_FRAME_BYTES} bytes",
                details={"reason": "request_too_large"},
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            async with asyncio.timeout(self.request_timeout_s):
                try:
                    await self._ws.send(text)
                except ConnectionClosed:
                    pass  # a reply may still be queued (capacity refusal); the reader decides
                return await waiter
        except TimeoutError:
            self._waiter = None
            raise self._poison(
                self._transport_error("timeout", f"no reply within {self.request_timeout_s:g}s (request abandoned)")
            ) from None
        except _SocketClosed as exc:
            raise self._poison(self._transport_error(exc.reason, exc.detail)) from None
        finally:
            if self._waiter is waiter:
                self._waiter = None
            if not waiter.done():
                waiter.cancel()

    def _malformed(self, reason: str, detail: str) -> KilnError:
        return self._poison(self._transport_error(reason, detail))

    def _decode(self, raw: str | bytes, expected: str) -> tuple[str, dict]:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            raise self._malformed("binary_frame", "the server sent a binary frame")
        if contains_token(raw, self._token):
            raise self._malformed("credential_reflected", "a frame reflected the bearer credential")
        try:
            frame = strict_loads(raw)
        except JsonBoundsError as exc:  # valid JSON, but a non-finite number, huge integer or deep nesting
            raise self._malformed("malformed_frame", f"the frame breaks Kiln's JSON bounds ({exc.reason})") from None
        except ValueError:
            raise self._malformed("malformed_json", "the server sent malformed JSON") from None
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            raise self._malformed("malformed_frame", "the frame is not an object with a 'type'")
        kind, data = frame["type"], frame.get("data")
        if kind == "error":
            if (
                not isinstance(data, dict)
                or not isinstance(data.get("code"), str)
                or not isinstance(data.get("message", ""), str)
            ):
                raise self._malformed("malformed_frame", "the error frame has no string code")
            if data["code"] in TERMINAL_CODES:
                self.closed = True
                self._start_close(send_close=False)
            return "error", data
        if kind != expected:
            raise self._malformed("unexpected_reply", f"expected a {expected!r} reply, got type {kind[:40]!r}")
        if not isinstance(data, dict):
            raise self._malformed("malformed_frame", f"the {kind} frame data is not an object")
        problem = observation_problem(data) if kind == "observation" else None
        if problem is not None:
            raise self._malformed("malformed_frame", problem)
        self._answered = True
        return kind, data

    async def reset(self, payload: dict) -> StepResult:
        """Send ``{"type":"reset","data":payload}``."""
        if not isinstance(payload, dict):
            raise TypeError("reset payload must be a JSON object")
        return StepResult.of(*await self._exchange({"type": "reset", "data": payload}, "observation"))

    async def step(self, action: dict) -> StepResult:
        """Send ``{"type":"step","data":action}`` (the bare action object)."""
        if not isinstance(action, dict):
            raise TypeError("action must be a JSON object")
        return StepResult.of(*await self._exchange({"type": "step", "data": action}, "observation"))

    async def state(self) -> dict:
        """Read-only ``state``; a wire error reply raises ``EnvironmentProtocolError``."""
        kind, data = await self._exchange({"type": "state"}, "state")
        if kind == "error":
            raise EnvironmentProtocolError(
                f"{self.url.websocket_url}: state request answered with {data['code'][:64]}",
                details={"protocol_code": data["code"][:64], "reason": "state_error"},
            )
        return data

    # ---------------------------------------------------------------- keepalive
    async def run_with_keepalive(self, coro_or_awaitable: Awaitable[Any]) -> Any:
        """Await the policy while the session stays alive.

        Pings are answered by the WebSocket layer; every ``keepalive_interval`` one read-only
        ``state`` exchange runs (its reply is consumed, not recorded); any unsolicited frame or
        socket failure poisons the session, cancels the awaitable and raises.
        """
        task = asyncio.ensure_future(coro_or_awaitable)
        try:
            self._check_usable()
        except BaseException:
            task.cancel()
            raise
        interval = keepalive_interval(self.request_timeout_s)
        poisoned = asyncio.ensure_future(self._poison_event.wait())
        try:
            while True:
                done, _ = await asyncio.wait({task, poisoned}, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
                self._check_usable()
                if task in done:
                    await asyncio.sleep(0)  # let the reader see frames already buffered
                    self._check_usable()
                    return task.result()
                kind, data = await self._exchange({"type": "state"}, "state")
                if kind == "error" and data["code"] in TERMINAL_CODES:
                    raise EnvironmentProtocolError(
                        f"{self.url.websocket_url}: keepalive state answered with {data['code']}",
                        details={"protocol_code": data["code"], "reason": "keepalive"},
                    )
        finally:
            poisoned.cancel()
            if not task.done():
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001 - a cancelled task ends with any error; closing goes on
                    pass

    # ------------------------------------------------------------------ closing
    def _start_close(self, *, send_close: bool) -> None:
        hook, self.on_close = self.on_close, None
        if hook is not None:
            hook()
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._shutdown(send_close))

    async def _shutdown(self, send_close: bool) -> None:
        try:
            if send_close and self._lost is None:
                async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                    await self._ws.send('{"type":"close"}')
        except BaseException:  # noqa: BLE001 - a close frame is best effort: the socket may be gone
            pass
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT_S + 0.5):
                await self._ws.close()
        except BaseException:  # noqa: BLE001 - closing a dead socket may raise anything; the session is over
            pass

    async def close(self) -> None:
        """Best-effort ``{"type":"close"}``, then close the socket. Idempotent; never raises."""
        if self._finished:
            return
        self._finished = True
        healthy = not self.poisoned and not self.closed and not self._busy
        self.closed = True
        try:
            self._start_close(send_close=healthy)
            if self._close_task is not None:
                await asyncio.shield(self._close_task)
        except BaseException:  # noqa: BLE001 - the close task reports nothing the caller can act on
            pass
        self._reader.cancel()
        try:
            await self._reader
        except BaseException:  # noqa: BLE001 - the reader ends with whatever ended the socket
            pass
