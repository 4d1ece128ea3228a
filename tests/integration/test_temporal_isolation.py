"""The embedded Temporal under a real ``kiln serve`` is closed to other local users.

Where unprivileged user+network namespaces exist (this project's CI and development machine), the
``nobody`` user's ``temporal workflow list/show/start/terminate`` and HTTP requests to the Web UI
(its pages and its JSON API) are refused on the very ports Kiln uses, while the home's owner's CLI,
Web UI and a Kiln run through the API work. Where they do not exist, serve's one-line warning and
``/healthz``'s ``exposure`` say so instead (both cases are asserted below; CI runs the first).
"""

from __future__ import annotations

import os
import pwd
import signal
import time
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kiln.core.settings import Settings
from kiln.devstack import start_devstack, temporal_binary
from kiln.devstack.isolation import namespaces_available
from kiln.devstack.netns_relay import peer_uid
from kiln.devstack.processes import free_port_block, port_accepts
from tests.integration.test_serve_supervisor import Serve
from tests.support.servers import example_env_argv, serve_app_process

NOBODY_PYTHON = "/usr/bin/python3"  # (the venv is not readable by nobody)
CAN_ACT_AS_NOBODY = os.getuid() == 0 and shutil.which("runuser") is not None and Path(NOBODY_PYTHON).exists()
needs_nobody = pytest.mark.skipif(not CAN_ACT_AS_NOBODY, reason="acting as nobody needs root and runuser")
needs_namespaces = pytest.mark.skipif(not namespaces_available(), reason="no unprivileged user+net namespaces")
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
    return subprocess.run(["runuser", "-u", "nobody", "--", NOBODY_PYTHON, "-I", "-c", code],
                          capture_output=True, text=True, timeout=60, cwd="/")


@needs_nobody
@pytest.mark.timeout(60)
def test_peer_uid_reads_the_connecting_sockets_owner_from_the_tcp_table() -> None:
    """The gate's one decision, against the kernel's own table: the owner's socket, then nobody's."""
    table = os.open("/proc/net/tcp", os.O_RDONLY)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        local = ("127.0.0.1", listener.getsockname()[1])
        with socket.create_connection(local):
            conn, peer = listener.accept()
            assert peer_uid(table, peer, local) == os.getuid()
            conn.close()
        code = f"import socket, time; s = socket.create_connection({local!r}); time.sleep(5)"
        theirs = subprocess.Popen(["runuser", "-u", "nobody", "--", NOBODY_PYTHON, "-I", "-c", code], cwd="/")
        try:
            listener.settimeout(30)
            conn, peer = listener.accept()
            assert peer_uid(table, peer, local) == pwd.getpwnam("nobody").pw_uid
            assert peer_uid(table, ("127.0.0.1", 1), local) is None  # no such socket: no uid
            conn.close()
        finally:
            theirs.kill()
            theirs.wait(timeout=10)
    os.close(table)


@needs_nobody
@needs_namespaces
@pytest.mark.parametrize("isolation", ["auto", "off"])
@pytest.mark.timeout(120)
def test_the_isolation_setting_decides_who_reaches_the_embedded_temporal(tmp_path: Path, isolation: str) -> None:
    t_port, ui_port = free_port_block(2, grpc_offset=None)
    settings = Settings(home=tmp_path / "home", temporal_port=t_port, temporal_ui_port=ui_port,
                        s3_endpoint="http://127.0.0.1:2", temporal_isolation=isolation)
    health = [temporal_binary(), "operator", "cluster", "health", "--address", f"127.0.0.1:{t_port}"]
    stack = start_devstack(settings)
    try:
        assert stack.temporal_exposure == ("owner_only" if isolation == "auto" else "open_to_local_users")
        mine = subprocess.run(health, capture_output=True, text=True, timeout=30)
        assert mine.returncode == 0 and "SERVING" in mine.stdout
        theirs = subprocess.run(["runuser", "-u", "nobody", "--", *health], capture_output=True, text=True,
                                timeout=30, cwd="/")
        if isolation == "auto":
            assert theirs.returncode != 0 and REFUSED in theirs.stderr, theirs.stderr
        else:
            assert theirs.returncode == 0 and "SERVING" in theirs.stdout, theirs.stderr
        gate = stack.processes[0]
    finally:
        stack.stop()
    assert not any(port_accepts(port, timeout_s=0.2) for port in (t_port, ui_port))
    assert not Path(f"/proc/{gate.pid}").exists()
    left = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(settings.home.resolve() / "temporal") not in left  # neither the gate nor Temporal lingers


@pytest.mark.timeout(120)
def test_without_namespaces_auto_falls_back_to_the_open_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``unshare`` on PATH (a machine without the mechanism): auto starts Temporal as before."""
    from kiln.devstack import isolation

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    isolation.namespaces_available.cache_clear()
    try:
        assert isolation.choose_exposure("auto") == "open_to_local_users"
        t_port, ui_port = free_port_block(2, grpc_offset=None)
        settings = Settings(home=tmp_path / "home", temporal_port=t_port, temporal_ui_port=ui_port,
                            s3_endpoint="http://127.0.0.1:2")
        with start_devstack(settings) as stack:
            assert stack.temporal_exposure == "open_to_local_users"
            assert "unshare" not in " ".join(stack.processes[0].argv)
            assert port_accepts(t_port) and port_accepts(ui_port)
    finally:
        isolation.namespaces_available.cache_clear()


@needs_namespaces
@pytest.mark.timeout(120)
def test_a_probe_that_times_out_is_run_again_before_the_mechanism_counts_as_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe slower than its first bound (a loaded machine) is not a missing mechanism: it runs
    once more with the longer bound, so serve does not open Temporal to local users for being slow."""
    from kiln.devstack import isolation

    monkeypatch.setattr(isolation, "PROBE_TIMEOUT_S", 0.0001)  # no process starts this fast
    isolation.namespaces_available.cache_clear()
    try:
        assert isolation.namespaces_available() is True  # the second, 30 s, attempt
        isolation.namespaces_available.cache_clear()
        monkeypatch.setattr(isolation, "PROBE_RETRY_TIMEOUT_S", 0.0001)
        assert isolation.namespaces_available() is False  # both bounds missed: open, with serve's warning
    finally:
        isolation.namespaces_available.cache_clear()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


@needs_namespaces
@pytest.mark.timeout(120)
def test_a_kill_9_of_the_gate_alone_takes_its_temporal_with_it(tmp_path: Path) -> None:
    """Only the gate's pid is killed (as serve's supervisor sees a crash): Temporal, its child, dies
    too (parent-death signal), so the restart never finds a second server on the same history."""
    t_port, ui_port = free_port_block(2, grpc_offset=None)
    settings = Settings(home=tmp_path / "home", temporal_port=t_port, temporal_ui_port=ui_port,
                        s3_endpoint="http://127.0.0.1:2")
    stack = start_devstack(settings)
    try:
        gate = stack.processes[0]
        children = Path(f"/proc/{gate.pid}/task/{gate.pid}/children").read_text().split()
        assert len(children) == 1
        temporal = int(children[0])
        assert "start-dev" in Path(f"/proc/{temporal}/cmdline").read_text()
        os.kill(gate.pid, signal.SIGKILL)
        gate.wait(timeout_s=10)
        deadline = time.monotonic() + 10
        while _alive(temporal) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(temporal)
        assert not port_accepts(t_port, timeout_s=0.2)
        restarted = stack.restart("temporal")  # the same history, a fresh namespace
        assert restarted.alive() and restarted.pid != gate.pid
    finally:
        stack.stop()
    assert not any(port_accepts(port, timeout_s=0.2) for port in (t_port, ui_port))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_another_local_user_is_refused_and_the_owner_is_not(serve: Serve, counter_env: str) -> None:
    health = httpx.get(f"{serve.url}/healthz", timeout=10).json()
    if not namespaces_available():  # the machine has no mechanism: serve says so, /healthz too
        assert serve.output().count(WARNING) == 1
        assert health["components"]["temporal"]["exposure"] == "open_to_local_users"
        pytest.skip("no unprivileged user+network namespaces here: the embedded Temporal stays open")
    if os.getuid() != 0 or shutil.which("runuser") is None or not Path(NOBODY_PYTHON).exists():
        pytest.skip("acting as another local user needs root, runuser and a system python3")
    assert health["components"]["temporal"]["exposure"] == "owner_only"
    assert WARNING not in serve.output()

    final = serve.run_completes(counter_env, 300)  # Kiln's API and workers reach Temporal
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

    refusals = [line for line in (serve.home / "logs" / "temporal.log").read_text().splitlines()
                if line.startswith("[kiln gate] refused")]
    nobody = pwd.getpwnam("nobody").pw_uid
    assert len(refusals) >= 7  # five CLI commands and two HTTP requests, each one connection at least
    assert {line.split(" uid ")[1].split()[0] for line in refusals} == {str(nobody)}  # never the owner
    after = _temporal(serve, "describe", "--workflow-id", "held", "--output", "json")
    assert after.returncode == 0 and "WORKFLOW_EXECUTION_STATUS_RUNNING" in after.stdout, after.stdout[-500:]
    listed = _temporal(serve, "list", "--output", "json")
    assert '"evil"' not in listed.stdout
    ended = _temporal(serve, "terminate", "--workflow-id", "held", "--reason", "test done")
    assert ended.returncode == 0, ended.stderr
