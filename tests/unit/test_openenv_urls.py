"""URL normalisation and the loopback rule."""

import pytest

from kiln.core.errors import InvalidUrl, RemoteEnvironmentForbidden
from kiln.core.openenv.urls import is_loopback_host, normalize_url, require_allowed_host


@pytest.mark.parametrize(
    "text, base, ws, origin, host",
    [
        ("127.0.0.1:8000/", "http://127.0.0.1:8000", "ws://127.0.0.1:8000/ws", "http://127.0.0.1:8000", "127.0.0.1"),
        ("https://example.test/prefix///", "https://example.test/prefix", "wss://example.test/prefix/ws", "https://example.test", "example.test"),
        ("  http://LOCALHOST:80/  ", "http://localhost:80", "ws://localhost:80/ws", "http://localhost", "localhost"),
        ("http://[::1]:8990", "http://[::1]:8990", "ws://[::1]:8990/ws", "http://[::1]:8990", "::1"),
        ("https://h.test:443/a/b/", "https://h.test:443/a/b", "wss://h.test:443/a/b/ws", "https://h.test", "h.test"),
    ],
)
def test_normalize_vectors(text, base, ws, origin, host):
    url = normalize_url(text)
    assert (url.base_url, url.websocket_url, url.origin, url.host) == (base, ws, origin, host)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("ftp://example.test", "scheme"),
        ("http://token@host", "credentials"),
        ("http://user:pw@host:1", "credentials"),
        ("http://host?token=x", "query"),
        ("http://host/#frag", "fragment"),
        ("http://", "no host"),
        ("", "empty"),
        ("http://host:99999", "port"),
        ("http://ho st", "whitespace"),
    ],
)
def test_normalize_rejects(text, reason):
    with pytest.raises(InvalidUrl) as info:
        normalize_url(text)
    assert info.value.code == "openenv_invalid_url"
    assert reason in info.value.message
    assert info.value.hint  # names the fix


def test_rejected_url_never_echoes_secret_parts():
    for text in ("http://s3cr3t@host", "http://host?token=s3cr3t", "http://host#s3cr3t"):
        with pytest.raises(InvalidUrl) as info:
            normalize_url(text)
        assert "s3cr3t" not in str(info.value)


@pytest.mark.parametrize(
    "host, loopback",
    [("localhost", True), ("LocalHost", True), ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True),
     ("[::1]", True), ("::ffff:127.0.0.1", True), ("10.0.0.1", False), ("example.test", False),
     ("localhost.example", False), ("0.0.0.0", False)],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback_host(host) is loopback


def test_require_allowed_host():
    require_allowed_host(normalize_url("http://[::1]:8990"), allow_remote=False)
    remote = normalize_url("http://example.test:8000")
    with pytest.raises(RemoteEnvironmentForbidden) as info:
        require_allowed_host(remote, allow_remote=False)
    assert info.value.code == "openenv_remote_environment_forbidden"
    assert info.value.http_status == 403
    require_allowed_host(remote, allow_remote=True)


def test_task_route_encodes_environment_name_as_one_segment():
    from kiln.core.openenv.tasks import task_route

    url = normalize_url("http://127.0.0.1:9/prefix/")
    assert task_route(url, "task env/β?#", "splits") == (
        "http://127.0.0.1:9/prefix/task%20env%2F%CE%B2%3F%23/splits"
    )
