"""``kiln serve`` checks its whole configuration before starting anything, refuses in one line
without a traceback, and a start that fails later leaves no process behind (issue 14 §6, §7).

Real ``kiln serve`` processes (``python -c 'from kiln.cli.app import main; main()' serve``) with
a throw-away home; ports are real sockets held by the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.devstack.common import GRPC_OFFSET
from kiln.devstack.processes import free_port_block, port_accepts

ROOT = Path(__file__).resolve().parents[2]
KILN = [sys.executable, "-c", "from kiln.cli.app import main; main()", "serve"]


def _env(tmp_path: Path, model: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    temporal, ui, s3, api = free_port_block(4, grpc_offset=GRPC_OFFSET)
    env.update(
        PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", KILN_HOME=str(tmp_path / "home"),
        KILN_MODEL_PATH=str(model), KILN_TEMPORAL_PORT=str(temporal),
        KILN_TEMPORAL_UI_PORT=str(ui), KILN_S3_PORT=str(s3), KILN_API_PORT=str(api),
    )
    env.update(extra)
    return env


def _serve(env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(KILN, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def _hold(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    return sock


def _nothing_started(env: dict[str, str]) -> None:
    for name in ("KILN_TEMPORAL_PORT", "KILN_TEMPORAL_UI_PORT", "KILN_API_PORT"):
        assert not port_accepts(int(env[name]), timeout_s=0.2), f"{name} is listening"
    assert not (Path(env["KILN_HOME"]) / "run" / "temporal.pid").exists()
    assert not (Path(env["KILN_HOME"]) / "run" / "seaweedfs.pid").exists()


def _one_line_refusal(result: subprocess.CompletedProcess, code: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    # One error line (plus at most the fix as a hint line).
    assert lines[0].startswith(f"error {code}: "), result.stderr
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), result.stderr
    return lines[0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("offset, what", [(0, "SeaweedFS S3"), (GRPC_OFFSET, "SeaweedFS S3 gRPC")])
def test_a_taken_s3_port_or_its_grpc_twin_starts_nothing(tmp_path: Path, tiny_model_dir: Path, offset: int, what: str) -> None:
    env = _env(tmp_path, tiny_model_dir)
    port = int(env["KILN_S3_PORT"]) + offset
    holder = _hold(port)
    try:
        result = _serve(env)
    finally:
        holder.close()
    line = _one_line_refusal(result, "serve_configuration_invalid")
    assert f"port {port} ({what}" in line and "KILN_S3_PORT" in line
    _nothing_started(env)


@pytest.mark.timeout(180)
def test_clashing_and_out_of_range_ports_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    env = _env(tmp_path, tiny_model_dir)
    env["KILN_API_PORT"] = env["KILN_TEMPORAL_UI_PORT"]
    line = _one_line_refusal(_serve(env), "serve_configuration_invalid")
    assert "KILN_API_PORT" in line and "distinct" in line
    env = _env(tmp_path, tiny_model_dir)
    env["KILN_S3_PORT"] = "60000"  # its gRPC twin would be 70000
    line = _one_line_refusal(_serve(env), "serve_configuration_invalid")
    assert "port 70000" in line and "outside 1-65535" in line
    _nothing_started(env)


@pytest.mark.timeout(180)
def test_a_remote_bind_without_token_starts_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    env = _env(tmp_path, tiny_model_dir, KILN_API_HOST="0.0.0.0")
    line = _one_line_refusal(_serve(env), "api_configuration_invalid")
    assert "0.0.0.0" in line
    _nothing_started(env)


@pytest.mark.timeout(300)
def test_a_start_that_fails_later_stops_everything_it_started(tmp_path: Path, tiny_model_dir: Path) -> None:
    # The API can not bind a documentation-only address (RFC 5737): Temporal, SeaweedFS and the
    # workers are already running when it fails; serve must stop them all.
    env = _env(tmp_path, tiny_model_dir, KILN_API_HOST="192.0.2.1", KILN_API_TOKEN="t0ken-for-test")
    result = _serve(env, timeout_s=280)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "error serve_start_failed: " in result.stderr
    for name in ("KILN_TEMPORAL_PORT", "KILN_TEMPORAL_UI_PORT", "KILN_S3_PORT"):
        assert not port_accepts(int(env[name]), timeout_s=0.2), f"{name} still listening"
    assert not port_accepts(int(env["KILN_S3_PORT"]) + GRPC_OFFSET, timeout_s=0.2)
    # No process of this home is left: none mentions the home in its command line.
    home = env["KILN_HOME"]
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if home in cmdline:
                left.append(cmdline)
    assert left == []


@pytest.mark.timeout(180)
def test_a_model_of_an_unknown_architecture_starts_nothing(tmp_path: Path) -> None:
    model = tmp_path / "made-up"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "kiln_made_up", "architectures": ["MadeUpForCausalLM"]}')
    env = _env(tmp_path, model)
    line = _one_line_refusal(_serve(env), "model_unsupported")
    assert "MadeUpForCausalLM" in line and str(model) in line and "supported families: gemma3, gpt_oss" in line
    _nothing_started(env)
