"""OpenEnv 0.10's production mode (issue 41): the counter example served with
``OPENENV_MODE=production`` (``ServerMode.PRODUCTION``: no HTTP ``/reset``, ``/step``, ``/state``)
inspects, collects, verifies and replays; Kiln only ever drives episodes over ``/ws``."""

from __future__ import annotations

import asyncio
import http.client
import json
from pathlib import Path
from urllib.parse import urlparse

import pytest

from kiln.core.openenv.discovery import inspect_environment
from kiln.core.rollout.group import EpisodeSettings
from kiln.core.rollout.replay_live import replay_bundle
from kiln.core.rollout.verify import verify_bundle
from tests.support.servers import example_env_argv, serve_app_process
from tests.unit.test_verify_support import _collect, write_bundle


def _status(url: str, method: str, path: str) -> int:
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, body=b"{}" if method == "POST" else None,
                     headers={"Content-Type": "application/json"})
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_production_mode_server_inspects_collects_verifies_and_replays(tiny_model_dir: Path, tmp_path: Path) -> None:
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(tiny_model_dir)
    argv = lambda port: example_env_argv("counter", port, max_concurrent_envs=4)  # noqa: E731
    with serve_app_process(argv, env={"OPENENV_MODE": "production"}) as url:
        # the simulation control routes are gone; discovery routes and /ws remain
        assert [_status(url, "POST", "/reset"), _status(url, "POST", "/step"), _status(url, "GET", "/state")] == [404] * 3
        assert [_status(url, "GET", p) for p in ("/health", "/metadata", "/schema")] == [200] * 3
        inspection = asyncio.run(inspect_environment(url))
        assert inspection["identity"]["metadata"]["name"] == "counter"
        settings = EpisodeSettings(group_size=2, max_steps=3, max_action_tokens=48)
        files = asyncio.run(_collect(url, runtime, groups=2, seed_start=10, settings=settings, template={}))
        summary = write_bundle(tmp_path, files)
        report = verify_bundle(summary)
        assert report["rollouts"] == 4 and report["environment_exchanges"] >= 2
        replayed = asyncio.run(replay_bundle(summary, concurrency=2))
    assert replayed["rollouts"] == 4 and replayed["environment_exchanges"] == report["environment_exchanges"]
    assert json.loads(files["summary.json"])["stats"]["rollouts"] == 4
