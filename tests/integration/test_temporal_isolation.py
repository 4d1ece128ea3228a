"""The embedded Temporal under a real ``kiln serve`` is closed to other local users.

Where unprivileged user+network namespaces exist (this project's CI and development machine), the
``nobody`` user's ``temporal workflow list/show/start/terminate`` and HTTP requests to the Web UI
(its pages and its JSON API) are refused on the very ports Kiln uses, while the home's owner's CLI,
Web UI and a Kiln run through the API work. Where they do not exist, serve's one-line warning and
``/healthz``'s ``exposure`` say so instead (both cases are asserted below; CI runs the first).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kiln.devstack import temporal_binary
from kiln.devstack.isolation import namespaces_available
from tests.integration.test_serve_supervisor import Serve
from tests.support.servers import example_env_argv, serve_app_process

WARNING = "warning: the embedded Temporal and its Web UI answer every local user"
REFUSED = "connection reset by peer"


@pytest.fixture(scope="module")
def counter_env() -> Iterator[str]:
    with serve_app_process(lambda port: example_env_argv("counter", port), startup_timeout_s=180) as url:
        yield url


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, counter_env: str) -> Iterator[Serve]:
    served = Serve(tmp_path_factory.mktemp("isolated"), tiny_model_dir)
    try:
        served.wait(lambda: "ready —" in served.output() and len(served.pids()) == 5, 150, "kiln serve ready")
        yield served
    finally:
        assert served.stop() == 0, served.output()


def _temporal(serve: Serve, *args: str, as_nobody: bool = False) -> subprocess.CompletedProcess[str]:
    argv = [temporal_binary(), "workflow", *args, "--address", f"127.0.0.1:{serve.ports[0]}"]
    if as_nobody:
        argv = ["runuser", "-u", "nobody", "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, cwd="/")


def _http_as_nobody(url: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys, urllib.request\n"
        "try:\n"
        f"    body = urllib.request.urlopen({url!r}, timeout=10).read()\n"
        "    print('ANSWERED', len(body))\n"
        "except OSError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    return subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-I", "-c", code],
                          capture_output=True, text=True, timeout=60, cwd="/")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_another_local_user_is_refused_and_the_owner_is_not(serve: Serve, counter_env: str) -> None:
    health = httpx.get(f"{serve.url}/healthz", timeout=10).json()
    if not namespaces_available():  # the machine has no mechanism: serve says so, /healthz too
        assert serve.output().count(WARNING) == 1
        assert health["components"]["temporal"]["exposure"] == "open_to_local_users"
        pytest.skip("no unprivileged user+network namespaces here: the embedded Temporal stays open")
    if os.getuid() != 0 or shutil.which("runuser") is None or not Path("/usr/bin/python3").exists():
        pytest.skip("acting as another local user needs root, runuser and /usr/bin/python3")
    assert health["components"]["temporal"]["exposure"] == "owner_only"
    assert WARNING not in serve.output()

    final = serve.run_completes(counter_env, 150)  # Kiln's API and workers reach Temporal
    assert final["state"] == "completed", final
    run_id = final["run_id"]
    # The owner's CLI: a workflow no worker polls stays running, so terminate below means something.
    held = _temporal(serve, "start", "--type", "Held", "--task-queue", "nobody-polls-this", "--workflow-id", "held")
    assert held.returncode == 0, held.stderr
    listed = _temporal(serve, "list", "--output", "json")
    assert listed.returncode == 0 and run_id in listed.stdout and '"held"' in listed.stdout, listed.stderr

    for args in (["list"], ["show", "--workflow-id", run_id], ["describe", "--workflow-id", "held"],
                 ["start", "--type", "Evil", "--task-queue", "kiln-control", "--workflow-id", "evil"],
                 ["terminate", "--workflow-id", "held", "--reason", "evil"]):
        refused = _temporal(serve, *args, as_nobody=True)
        assert refused.returncode != 0 and REFUSED in refused.stderr, (args, refused.stdout, refused.stderr)
        assert run_id not in refused.stdout

    ui = f"http://127.0.0.1:{serve.ports[1]}"
    for url in (f"{ui}/", f"{ui}/api/v1/namespaces/default/workflows"):
        answer = _http_as_nobody(url)
        assert answer.stdout.startswith("REFUSED"), (url, answer.stdout, answer.stderr)
    owner_json = httpx.get(f"{ui}/api/v1/namespaces/default/workflows", timeout=15)
    assert owner_json.status_code == 200 and run_id in owner_json.text
    assert httpx.get(f"{ui}/", timeout=15).status_code == 200

    after = _temporal(serve, "describe", "--workflow-id", "held", "--output", "json")
    assert after.returncode == 0 and "WORKFLOW_EXECUTION_STATUS_RUNNING" in after.stdout, after.stdout[-500:]
    listed = _temporal(serve, "list", "--output", "json")
    assert '"evil"' not in listed.stdout
    ended = _temporal(serve, "terminate", "--workflow-id", "held", "--reason", "test done")
    assert ended.returncode == 0, ended.stderr
