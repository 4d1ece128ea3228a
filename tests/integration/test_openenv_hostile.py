"""Every misbehaviour of the hostile server ends with its documented code, within a bounded time,
and the bearer token never appears in an error, its dict form or any log record."""

import asyncio
import logging
import time

import httpx
import pytest

from kiln.core.errors import (
    EnvironmentCapacityExhausted,
    EnvironmentProtocolError,
    EnvironmentUnavailable,
    InvalidActionSchema,
    KilnError,
)
from kiln.core.openenv import EnvSession, inspect_environment, normalize_url, open_session_and_reset
from tests.support.servers import serve_module

TOKEN = "kiln-test-SECRET-9f8e7d6c5b4a"


@pytest.fixture(scope="module")
def hostile():
    with serve_module("tests.support.hostile_server", health_path="/ok/health") as base_url:
        yield base_url


@pytest.fixture(autouse=True)
def no_secret_in_logs(caplog):
    caplog.set_level(logging.DEBUG)
    yield
    assert TOKEN not in caplog.text
    for record in caplog.records:
        assert TOKEN not in str(record.args)


def _assert_clean(error: KilnError) -> None:
    assert TOKEN not in str(error) and TOKEN not in repr(error)
    assert TOKEN not in str(error.to_dict())


async def _hits(base: str) -> dict:
    async with httpx.AsyncClient(trust_env=False) as client:
        return (await client.get(f"{base}/_hits")).json()


async def _inspect_error(base: str, case: str) -> KilnError:
    started = time.monotonic()
    with pytest.raises(KilnError) as info:
        await inspect_environment(f"{base}/{case}", bearer_token=TOKEN, timeout_s=5)
    assert time.monotonic() - started < 5
    _assert_clean(info.value)
    return info.value


async def test_baseline_case_works(hostile):
    inspection = await inspect_environment(f"{hostile}/ok", bearer_token=TOKEN)
    assert inspection["identity"]["authentication"] == "bearer"
    assert TOKEN not in str(inspection)
    session, reset, retries = await open_session_and_reset(
        normalize_url(f"{hostile}/ok"), {"seed": 1}, capacity_wait_s=2, bearer_token=TOKEN)
    try:
        assert retries == 0 and reset.observation["observation"]["count"] == 0
        assert (await session.step({"amount": 3})).done is True
    finally:
        await session.close()


@pytest.mark.parametrize(
    "case, error_type, text",
    [
        ("health503", EnvironmentUnavailable, "/health503/health: HTTP 503"),
        ("redirect_health", EnvironmentUnavailable, "/health: HTTP 302 redirect refused"),
        ("redirect", EnvironmentUnavailable, "/redirect/metadata: HTTP 302 redirect refused"),
        ("reflect", EnvironmentProtocolError, "reflected the bearer credential"),
        ("bigmeta", EnvironmentProtocolError, "exceeds the 2097152-byte limit"),
        ("streambig", EnvironmentProtocolError, "exceeds the 2097152-byte limit"),
        ("badjson", EnvironmentProtocolError, "/badjson/metadata: response body is not valid JSON"),
        ("extref_http", InvalidActionSchema, "external references are never fetched"),
        ("extref_file", InvalidActionSchema, "external references are never fetched"),
        ("extref_nested", InvalidActionSchema, "external references are never fetched"),
        ("badref", InvalidActionSchema, "names a location that does not exist"),
    ],
)
async def test_discovery_cases(hostile, case, error_type, text):
    error = await _inspect_error(hostile, case)
    assert type(error) is error_type
    assert text in error.message
    if error_type is InvalidActionSchema:
        assert error.code == "environment_protocol_error"
        assert "_probe" not in error.message and "/etc/" not in error.message
    if case == "health503":
        assert error.retryable and error.details["http_status"] == 503
    if case.startswith("redirect"):
        assert not error.retryable


async def test_nothing_external_was_ever_fetched(hostile):
    for case in ("redirect", "redirect_health", "extref_http", "extref_nested", "health503"):
        await _inspect_error(hostile, case)
    with pytest.raises(EnvironmentUnavailable) as info:
        await EnvSession.open(normalize_url(f"{hostile}/health503"), bearer_token=TOKEN)
    assert info.value.message.endswith("/health503/health: HTTP 503")
    hits = await _hits(hostile)
    assert hits.get("_probe redirected", 0) == 0
    assert hits.get("_probe external-schema", 0) == 0
    assert hits.get("_probe far", 0) == 0
    assert hits.get("health503 ws", 0) == 0  # /ws never contacted after a failed health check
    assert hits.get("redirect_health metadata", 0) == 0  # nothing after the failed health check


@pytest.mark.parametrize(
    "case, error_type, reason",
    [
        ("malformed_json", EnvironmentProtocolError, "malformed_json"),
        ("binary", EnvironmentProtocolError, "binary_frame"),
        ("oversize", EnvironmentProtocolError, "oversize_frame"),
        ("wrong_type", EnvironmentProtocolError, "unexpected_reply"),
        ("reflect", EnvironmentProtocolError, "credential_reflected"),
        ("inf_reward", EnvironmentProtocolError, "malformed_frame"),
        ("close_no_reply", EnvironmentUnavailable, "closed"),
        ("slow", EnvironmentUnavailable, "timeout"),
    ],
)
async def test_session_poisoning_cases(hostile, case, error_type, reason):
    session = await EnvSession.open(
        normalize_url(f"{hostile}/{case}"), bearer_token=TOKEN, request_timeout_s=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(KilnError) as info:
            await session.reset({"seed": 1})
        if case == "slow":  # it answers after 3 s: the 0.5 s request timeout fired first
            assert time.monotonic() - started < 2.9
        assert type(info.value) is error_type and info.value.details["reason"] == reason
        _assert_clean(info.value)
        assert session.poisoned
        with pytest.raises(error_type):  # never resent: the poisoned session refuses at once
            await session.step({"amount": 1})
    finally:
        await session.close()
    assert session.closed


async def test_unsolicited_frame_while_idle_poisons(hostile):
    session = await EnvSession.open(normalize_url(f"{hostile}/unsolicited"), bearer_token=TOKEN)
    try:
        reset = await session.reset({})
        assert reset.kind == "observation"
        await asyncio.sleep(0.3)
        assert session.poisoned
        with pytest.raises(EnvironmentProtocolError) as info:
            await session.step({"amount": 1})
        assert info.value.details["reason"] == "unsolicited_frame"
    finally:
        await session.close()


async def test_unsolicited_frame_during_policy_cancels_it(hostile):
    session = await EnvSession.open(normalize_url(f"{hostile}/unsolicited"), bearer_token=TOKEN, request_timeout_s=10)
    cancelled = asyncio.Event()

    async def slow_policy():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        await session.reset({})
        started = time.monotonic()
        with pytest.raises(EnvironmentProtocolError) as info:
            await session.run_with_keepalive(slow_policy())
        assert time.monotonic() - started < 30  # the 60 s policy was cancelled, not awaited
        assert info.value.details["reason"] == "unsolicited_frame" and cancelled.is_set()
    finally:
        await session.close()


async def test_capacity_refusal_after_handshake(hostile):
    url = normalize_url(f"{hostile}/capacity")
    started = time.monotonic()
    with pytest.raises(EnvironmentCapacityExhausted) as info:
        await open_session_and_reset(url, {"seed": 1}, capacity_wait_s=0.5, bearer_token=TOKEN)
    assert time.monotonic() - started < 10  # gave up after its 0.5 s wait, not a request timeout
    assert info.value.details["protocol_code"] == "CAPACITY_REACHED"
    assert info.value.details["refusals"] == 3  # refusals at ~0, 0.25, 0.5 s
    _assert_clean(info.value)


async def test_capacity_refusals_then_success_are_counted(hostile):
    url = normalize_url(f"{hostile}/capfirst-2-a1")
    session, reset, retries = await open_session_and_reset(url, {"seed": 1}, capacity_wait_s=5, bearer_token=TOKEN)
    try:
        assert retries == 2 and reset.kind == "observation"
    finally:
        await session.close()


async def test_terminal_code_closes_session(hostile):
    session = await EnvSession.open(normalize_url(f"{hostile}/session_error"), bearer_token=TOKEN)
    try:
        await session.reset({})
        result = await session.step({"amount": 1})
        assert result.kind == "protocol_error" and result.code == "SESSION_ERROR" and result.terminal
        assert session.closed and not session.poisoned
        with pytest.raises(EnvironmentProtocolError) as info:
            await session.state()
        assert info.value.details["reason"] == "session_closed"
    finally:
        await session.close()


async def test_session_probe_refuses_redirect_and_sends_no_upgrade(hostile):
    with pytest.raises(EnvironmentUnavailable) as info:
        await EnvSession.open(normalize_url(f"{hostile}/redirect_health"), bearer_token=TOKEN)
    assert info.value.message.endswith("/redirect_health/health: HTTP 302 redirect refused (redirects are never followed)")
    _assert_clean(info.value)
    hits = await _hits(hostile)
    assert hits.get("redirect_health ws", 0) == 0 and hits.get("_probe redirected", 0) == 0
