"""``kiln example-env`` says when it is ready: one line naming its URL, printed once the
environment answers there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_example_env_prints_its_url_when_it_answers() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kiln.cli.app import main; main()", "example-env", "counter", "--port", str(port)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the line (or the process ends: then "")
        url = f"http://127.0.0.1:{port}"
        assert line == f"counter environment ready at {url}\n", (line, proc.poll())
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
