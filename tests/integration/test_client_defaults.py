"""``Client()`` with no arguments reaches a real ``kiln serve`` started with every default port
(Temporal 7233, its UI 8233, S3 8333, the API 8780), and ``KILN_API_URL`` points it anywhere.
The clients run in fresh interpreters with no ``KILN_*`` variable but the one under test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.core.settings import Settings
from kiln.devstack.processes import port_accepts

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PORTS = (7233, 8233, 8333, 8780)
PROBE = (
    "from kiln.client import Client\n"
    "with Client() as kiln:\n"
    "    print(kiln.url, type(kiln.runs()).__name__, 'ok')\n"
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return {**env, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **extra}


@pytest.fixture(scope="module")
def default_serve(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Path]:
    assert [p for p in DEFAULT_PORTS if port_accepts(p, timeout_s=0.2)] == [], "a default port is taken"
    home = tmp_path_factory.mktemp("serve-defaults") / "home"
    out = home.parent / "serve.out"
    env = _clean_env(KILN_HOME=str(home), KILN_MODEL_PATH=str(tiny_model_dir), KILN_DEVICE="cpu")
    proc = subprocess.Popen([sys.executable, "-c", "from kiln.cli.app import main; main()", "serve"], cwd=ROOT,
                            env=env, stdout=out.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "ready —" not in out.read_text(errors="replace"):
            assert proc.poll() is None, out.read_text(errors="replace")
            assert time.monotonic() < deadline, out.read_text(errors="replace")[-3000:]
            time.sleep(0.3)
        yield home
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _probe(**env: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=_clean_env(**env), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_client_with_no_arguments_reaches_kiln_serve_on_default_ports(default_serve: Path) -> None:
    assert Settings().api_port == 8780
    assert _probe() == ["http://127.0.0.1:8780", "RunList", "ok"]
    assert _probe(KILN_API_URL="http://localhost:8780/") == ["http://localhost:8780", "RunList", "ok"]
    closed = "http://127.0.0.1:9"  # discard port: nothing listens
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=_clean_env(KILN_API_URL=closed),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and f"api_unavailable: cannot reach the Kiln API at {closed}" in done.stderr
