"""``kiln serve`` supervises its children: a dead one is restarted with backoff, the others keep
their PIDs, a crash loop ends in one line; the API answers 503 while its Temporal is down.

The supervisor is tested on real throw-away processes; the whole of ``kiln serve`` (Temporal,
SeaweedFS, control and gpu workers, API, the counter example env) on real processes killed with
SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kiln.devstack.common import GRPC_OFFSET
from kiln.devstack.isolation import namespaces_available
from kiln.devstack.processes import free_port_block, port_accepts, start_process
from kiln.devstack.supervisor import Supervisor, SupervisorGaveUp
from tests.integration.test_api_helpers import TINY_ROLLOUT
from tests.support.servers import example_env_argv, serve_app_process

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _sleeper(tmp_path: Path, name: str):  # noqa: ANN202 - a start callable
    return lambda: start_process(name, SLEEPER, log_path=tmp_path / f"{name}.log")


def _supervise_until(supervisor: Supervisor, done, timeout_s: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, supervisor.snapshot()
        supervisor.check()
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_dead_child_is_restarted_and_the_others_keep_their_pids(tmp_path: Path) -> None:
    events: list[str] = []
    supervisor = Supervisor(on_event=events.append, first_backoff_s=0.2, stable_after_s=0.5)
    try:
        a = supervisor.launch("a", _sleeper(tmp_path, "a"))
        b = supervisor.launch("b", _sleeper(tmp_path, "b"))
        pid_a, pid_b = a.process.pid, b.process.pid
        time.sleep(0.6)  # both ran longer than stable_after_s: a death now is not a fast failure
        os.kill(pid_a, signal.SIGKILL)
        _supervise_until(supervisor, lambda: a.restarts == 1, 20)
        assert a.process.pid != pid_a and a.process.alive()
        assert b.process.pid == pid_b and b.restarts == 0
        assert events[0] == "a exited with signal 9 (SIGKILL); restarting in 0.2s"
        assert events[1].startswith(f"a restarted: pid {pid_a} → {a.process.pid} (restart 1, down ")
        assert supervisor.snapshot() == {
            "a": {"state": "running", "pid": a.process.pid, "restarts": 1,
                  "last_exit": "exited with signal 9 (SIGKILL)"},
            "b": {"state": "running", "pid": pid_b, "restarts": 0, "last_exit": None},
        }
    finally:
        supervisor.stop()
    assert not a.process.alive() and not b.process.alive()


@pytest.mark.timeout(60)
def test_repeated_fast_failures_give_up_with_one_line_and_backoff_doubles(tmp_path: Path) -> None:
    events: list[str] = []
    log = tmp_path / "crashy.log"
    supervisor = Supervisor(on_event=events.append, first_backoff_s=0.1, stable_after_s=30, give_up_after=4)
    crashy = lambda: start_process("crashy", [sys.executable, "-c", "raise SystemExit(3)"], log_path=log)  # noqa: E731
    supervisor.launch("crashy", crashy)
    with pytest.raises(SupervisorGaveUp) as gave_up:
        _supervise_until(supervisor, lambda: False, 30)
    message = str(gave_up.value)
    assert "\n" not in message
    assert message == (f"crashy failed 4 times in a row, each within 30s of starting "
                       f"(last: exited with status 3); gave up — see {log}")
    waits = [line.rsplit(" ", 1)[1] for line in events if "restarting in" in line]
    assert waits == ["0.1s", "0.2s", "0.4s"]
    assert supervisor.snapshot()["crashy"]["state"] == "failed"
    supervisor.stop()


@pytest.mark.timeout(60)
def test_an_outage_of_failed_starts_counts_once_toward_the_crash_loop(tmp_path: Path) -> None:
    """Killed, then two failed starts (what it needs is down), then up, then killed again: three
    incidents' worth of fast failures, not four, so a supervisor that gives up at four does not."""
    events: list[str] = []
    supervisor = Supervisor(on_event=events.append, first_backoff_s=0.1, stable_after_s=30, give_up_after=4)
    refusals = {"left": 0}
    sleeper = _sleeper(tmp_path, "flaky")

    def start():  # noqa: ANN202 - a start callable
        if refusals["left"] > 0:
            refusals["left"] -= 1
            raise RuntimeError("port 1 is taken")
        return sleeper()

    try:
        child = supervisor.launch("flaky", start)
        first = child.process.pid
        refusals["left"] = 2
        os.kill(first, signal.SIGKILL)
        _supervise_until(supervisor, lambda: child.restarts == 1, 20)
        assert (child.fast_failures, child.failed_starts) == (2, 0)
        second = child.process.pid
        os.kill(second, signal.SIGKILL)  # a separate incident, soon after (a fast failure too)
        _supervise_until(supervisor, lambda: child.restarts == 2, 20)
        assert child.fast_failures == 3 and child.state == "running"
        waits = [line.rsplit(" ", 1)[1] for line in events if "restarting in" in line]
        assert waits == ["0.1s", "0.2s", "0.4s", "0.4s"]
        assert [line.split(";")[0] for line in events if "restarting in" in line] == [
            "flaky exited with signal 9 (SIGKILL)", "flaky did not start (port 1 is taken)",
            "flaky did not start (port 1 is taken)", "flaky exited with signal 9 (SIGKILL)"]
    finally:
        supervisor.stop()


# --------------------------------------------------------------------------------- kiln serve


class Serve:
    """A real ``kiln serve`` process with a throw-away home (stopped by PID at teardown)."""

    def __init__(self, tmp: Path, model: Path) -> None:
        temporal, ui, s3, api = free_port_block(4, grpc_offset=GRPC_OFFSET)
        self.home = tmp / "home"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        self.env.update(
            PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", KILN_HOME=str(self.home), KILN_MODEL_PATH=str(model),
            KILN_TEMPORAL_PORT=str(temporal), KILN_TEMPORAL_UI_PORT=str(ui), KILN_S3_PORT=str(s3),
            KILN_API_PORT=str(api), KILN_DEVICE="cpu",
        )
        self.url = f"http://127.0.0.1:{api}"
        self.ports = [temporal, ui, s3, api]
        self.out = tmp / "serve.out"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from kiln.cli.app import main; main()", "serve"],
            cwd=ROOT, env=self.env, stdout=self.out.open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def components(self) -> dict[str, dict]:
        try:
            return json.loads((self.home / "run" / "serve.json").read_text())["components"]
        except (OSError, ValueError, KeyError):
            return {}

    def pids(self) -> dict[str, int]:
        return {name: item["pid"] for name, item in self.components().items()}

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait(self, check, timeout_s: float, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, f"kiln serve exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def run_completes(self, env_url: str, timeout_s: float) -> dict:
        body = {**TINY_ROLLOUT, "environment_urls": [env_url]}
        submitted = httpx.post(f"{self.url}/v1/openenv/runs", json=body, timeout=30)
        assert submitted.status_code == 202, submitted.text
        run_id = submitted.json()["run_id"]
        final: dict = {}

        def done() -> bool:
            final.update(httpx.get(f"{self.url}/v1/openenv/runs/{run_id}", timeout=10).json())
            return final.get("state") in ("completed", "failed", "cancelled")

        self.wait(done, timeout_s, f"run {run_id} to end")
        return final

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def counter_env() -> Iterator[str]:
    """The counter example env (a generous start bound: it shares the machine with serve's children)."""
    with serve_app_process(lambda port: example_env_argv("counter", port), startup_timeout_s=180) as url:
        yield url


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, counter_env: str) -> Iterator[Serve]:
    # (the counter env is requested first: it starts before serve's children load the machine)
    served = Serve(tmp_path_factory.mktemp("serve"), tiny_model_dir)
    try:
        served.wait(lambda: "ready —" in served.output() and len(served.pids()) == 5, 150, "kiln serve ready")
        yield served
    finally:
        code = served.stop()
        assert code == 0, served.output()
        assert not any(port_accepts(port, timeout_s=0.2) for port in served.ports)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_restarts_a_killed_temporal_and_the_api_answers_503_meanwhile(
    serve: Serve, counter_env: str
) -> None:
    before = serve.pids()
    assert set(before) == {"temporal", "seaweedfs", "control-worker", "gpu-worker", "api"}
    killed = time.monotonic()
    os.kill(before["temporal"], signal.SIGKILL)
    outage: list[httpx.Response] = []

    def answered_503() -> bool:
        # The API gives up on an unreachable Temporal after ~1 s; serve waits 1 s before restarting
        # it and the restart itself takes longer than that: a request right after the kill is 503.
        response = httpx.get(f"{serve.url}/v1/openenv/runs", timeout=15)
        if response.status_code == 503:
            outage.append(response)
        return bool(outage) or serve.pids().get("temporal") not in (None, before["temporal"])

    serve.wait(answered_503, 60, "a 503 during the Temporal outage")
    assert outage, "no request was answered 503 while Temporal was down"
    assert outage[0].json()["code"] == "temporal_unavailable" and outage[0].json()["retryable"] is True
    assert outage[0].headers["Retry-After"] == "5"
    serve.wait(lambda: serve.pids().get("temporal") not in (None, before["temporal"]), 90, "temporal restarted")
    serve.wait(lambda: httpx.get(f"{serve.url}/v1/openenv/runs", timeout=15).status_code == 200, 30,
               "the API answering again")
    back_s = time.monotonic() - killed
    after = serve.pids()
    assert {k: v for k, v in after.items() if k != "temporal"} == {
        k: v for k, v in before.items() if k != "temporal"}
    out = serve.output()
    assert "temporal exited with signal 9 (SIGKILL); restarting in 1s" in out
    assert f"temporal restarted: pid {before['temporal']} → {after['temporal']} (restart 1" in out
    health = httpx.get(f"{serve.url}/healthz", timeout=10).json()
    assert health["status"] == "ok", health
    # (where user+network namespaces exist, as on this project's CI, the embedded Temporal is closed)
    closed = namespaces_available()
    assert {k: health["components"]["temporal"][k] for k in ("state", "restarts", "connection", "exposure")} == {
        "state": "running", "restarts": 1, "connection": "reachable",
        "exposure": "owner_only" if closed else "open_to_local_users"}
    assert health["components"]["s3"] == {"connection": "reachable"}
    assert out.count("warning: the embedded Temporal and its Web UI answer every local user") == (0 if closed else 1)
    assert "pid" not in health["components"]["temporal"]
    final = serve.run_completes(counter_env, 120)
    assert final["state"] == "completed", final
    assert final["progress"]["rollouts_completed"] == 2
    print(f"temporal kill → API 200 again: {back_s:.1f}s; 503s seen: {len(outage)}")
    print("\n".join(line for line in serve.output().splitlines() if "temporal" in line and "restart" in line))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_restarts_a_killed_gpu_worker_and_leaves_the_others_alone(
    serve: Serve, counter_env: str
) -> None:
    before = serve.pids()
    killed = time.monotonic()
    os.kill(before["gpu-worker"], signal.SIGKILL)
    serve.wait(lambda: serve.pids().get("gpu-worker") not in (None, before["gpu-worker"]), 60,
               "gpu-worker restarted")
    restart_s = time.monotonic() - killed
    final = serve.run_completes(counter_env, 150)
    assert final["state"] == "completed", final
    assert final["progress"]["rollouts_completed"] == 2
    after = serve.pids()
    assert {k: v for k, v in after.items() if k != "gpu-worker"} == {
        k: v for k, v in before.items() if k != "gpu-worker"}
    assert f"gpu-worker restarted: pid {before['gpu-worker']} → {after['gpu-worker']}" in serve.output()
    components = httpx.get(f"{serve.url}/healthz", timeout=10).json()["components"]
    assert components["gpu-worker"]["restarts"] == 1 and components["control-worker"]["restarts"] == 0
    print(f"gpu-worker kill → restarted: {restart_s:.1f}s")
    print("\n".join(line for line in serve.output().splitlines() if "gpu-worker" in line and "restart" in line))
