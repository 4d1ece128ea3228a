"""Where ``Client()`` goes with no arguments: ``KILN_API_URL``, else the settings' host and port
(the API's own default, defined once in ``Settings``), with ``KILN_API_TOKEN``; and the one follow
loop's rules (placeholders skipped and told once, the end, a run no worker picks up)."""

from __future__ import annotations

import ast
import socket
from pathlib import Path

import pytest

from kiln.client import ApiUnavailable, Client
from kiln.client.follow import watch
from kiln.core.run_view import RunView
from kiln.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("KILN_API_URL", "KILN_API_HOST", "KILN_API_PORT", "KILN_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.timeout(30)
def test_no_arguments_is_the_apis_own_default(clean_env: pytest.MonkeyPatch) -> None:
    with Client() as client:
        assert client.url == "http://127.0.0.1:8780"
        assert Settings().api_port == 8780 and Settings().api_host == "127.0.0.1"
        assert "Authorization" not in client._api._client.headers


@pytest.mark.timeout(30)
def test_kiln_api_url_then_host_and_port_then_token(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KILN_API_PORT", "9123")
    clean_env.setenv("KILN_API_HOST", "0.0.0.0")  # a wildcard bind is reached on loopback
    assert Client().url == "http://127.0.0.1:9123"
    clean_env.setenv("KILN_API_HOST", "10.1.2.3")
    assert Client().url == "http://10.1.2.3:9123"
    clean_env.setenv("KILN_API_URL", "http://kiln.internal:8000/")
    clean_env.setenv("KILN_API_TOKEN", "s3cret")
    client = Client()
    assert client.url == "http://kiln.internal:8000"
    assert client._api._client.headers["Authorization"] == "Bearer s3cret"
    assert "s3cret" not in repr(client)
    assert Client("http://other:1", token="t2")._api._client.headers["Authorization"] == "Bearer t2"


@pytest.mark.timeout(30)
def test_nothing_listening_is_api_unavailable_naming_the_url_and_the_variables(clean_env: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    clean_env.setenv("KILN_API_PORT", str(port))
    with pytest.raises(ApiUnavailable) as info:
        Client().runs()
    assert info.value.code == "api_unavailable" and info.value.retryable is True
    assert f"http://127.0.0.1:{port}" in info.value.message
    assert "KILN_API_URL" in (info.value.hint or "") and "KILN_API_PORT" in (info.value.hint or "")


@pytest.mark.timeout(30)
def test_the_default_port_is_written_once_in_the_product() -> None:
    places = []
    for folder in ("kiln", "api", "activities", "workers", "workflows"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if any(isinstance(n, ast.Constant) and n.value in (8780, "8780") for n in ast.walk(tree)):
                places.append(path.relative_to(ROOT).as_posix())
    assert places == ["kiln/core/settings.py"]


def _view(state: str = "running", source: str = "query", **fields: object) -> RunView:
    return RunView.model_validate({"run_id": "r1", "state": state, "status_source": source, **fields})


@pytest.mark.timeout(30)
def test_watch_skips_placeholders_tells_once_and_ends_on_the_terminal_view() -> None:
    answers = iter([_view(source="history"), _view(phase="collection"), _view(source="history"),
                    _view(source="history"), _view(state="completed", source="result")])
    told: list[int] = []
    seen = list(watch(lambda: next(answers), poll_s=0.0, on_timed_out=lambda: told.append(1)))
    assert [(v.state, v.phase) for v in seen] == [("running", "collection"), ("completed", seen[-1].phase)]
    assert told == [1]


@pytest.mark.timeout(30)
def test_watch_ends_on_a_run_no_worker_picked_up() -> None:
    message = "no worker polls task queue kiln-gpu for this run"
    answers = iter([_view(source="history", unclaimed=message), _view(phase="never asked")])
    seen = list(watch(lambda: next(answers), poll_s=0.0))
    assert [v.unclaimed for v in seen] == [message]
