"""docker-compose.yml cannot run here (no Docker engine): check it statically against the code.

Closed by default: only the API publishes a port; internal services sit on an internal network;
every secret is required (``${VAR:?message}``); images are pinned; long-running services have
healthchecks and restart policies; start order uses ``depends_on`` conditions; the gpu worker
reserves the GPUs and is built with CUDA torch. The SeaweedFS start script is run for real (with
a stand-in ``weed``) to check the identity and security files it writes.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from kiln.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
ONE_SHOT = {"temporal-schema", "temporal-namespace", "kiln-init"}
LONG_RUNNING = set(SERVICES) - ONE_SHOT
INTERNAL = {"postgres", "temporal", "temporal-ui", "seaweedfs"}


def test_compose_services_and_settings() -> None:
    assert set(SERVICES) == {
        "postgres", "temporal-schema", "temporal", "temporal-namespace", "temporal-ui", "seaweedfs",
        "kiln-init", "api", "control-worker", "gpu-worker", "trainer-worker", "sampler-worker",
    }
    # the roles topology (1 trainer + N samplers) is a profile: a plain `up` runs gpu-worker alone
    assert SERVICES["trainer-worker"]["command"] == ["python", "-m", "workers", "trainer"]
    assert SERVICES["sampler-worker"]["command"] == ["python", "-m", "workers", "sampler"]
    assert {name for name, svc in SERVICES.items() if svc.get("profiles")} == {"trainer-worker", "sampler-worker"}
    assert all(SERVICES[name]["profiles"] == ["roles"] for name in ("trainer-worker", "sampler-worker"))
    assert SERVICES["trainer-worker"]["environment"]["KILN_TRAIN_DEVICES"] == "auto"
    assert SERVICES["control-worker"]["command"] == ["python", "-m", "workers", "control"]
    assert SERVICES["gpu-worker"]["command"] == ["python", "-m", "workers", "gpu"]
    assert SERVICES["kiln-init"]["command"] == ["python", "-m", "workers", "ensure-search-attributes"]
    fields = set(Settings.model_fields)
    for name in ("api", "control-worker", "gpu-worker", "kiln-init", "trainer-worker", "sampler-worker"):
        for key in SERVICES[name]["environment"]:
            assert key.startswith("KILN_") and key.removeprefix("KILN_").lower() in fields, key
    assert SERVICES["api"]["environment"]["KILN_API_HOST"] == "0.0.0.0"
    assert (ROOT / "Dockerfile").read_text().count("torch==2.13.0") == 1


def test_only_the_api_is_published() -> None:
    published = {name for name, svc in SERVICES.items() if svc.get("ports")}
    assert published == {"api"}
    assert [p.rsplit(":", 1)[-1] for p in SERVICES["api"]["ports"]] == ["8780"]
    assert not any("expose" in svc or svc.get("network_mode") == "host" for svc in SERVICES.values())
    assert COMPOSE["networks"]["backend"]["internal"] is True
    for name in INTERNAL:
        assert SERVICES[name]["networks"] == ["backend"], name
    # The UI override is documented, commented out (not active).
    text = (ROOT / "docker-compose.yml").read_text()
    assert "#       TEMPORAL_AUTH_ENABLED: \"true\"" in text


def test_every_secret_is_required() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for var in ("KILN_API_TOKEN", "KILN_S3_SECRET_KEY", "KILN_POSTGRES_PASSWORD"):
        uses = re.findall(r"\$\{" + var + r"([^}]*)\}", text)
        assert uses and all(use.startswith(":?") and len(use) > 10 for use in uses), (var, uses)
    assert "change-me" not in text
    # No literal password anywhere: every *PASSWORD*/*SECRET*/*TOKEN*/*PWD* value is a required variable.
    for name, svc in SERVICES.items():
        env = svc.get("environment") or {}
        for key, value in (env.items() if isinstance(env, dict) else []):
            if re.search(r"PASSWORD|SECRET|TOKEN|PWD", key):
                assert re.fullmatch(r"\$\{[A-Z0-9_]+:\?[^}]+\}", str(value)), (name, key, value)
    # SSRF into the compose network stays off unless the operator opts in.
    env = SERVICES["control-worker"]["environment"]
    assert env["KILN_ALLOW_REMOTE_ENVIRONMENTS"].endswith(":-false}")


def test_images_are_pinned_by_digest_with_the_tag_in_a_comment() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for name, svc in SERVICES.items():
        image = svc.get("image")
        assert image, name
        if "build" in svc:
            assert image in ("kiln:cpu", "kiln:cuda"), (name, image)
            continue
        repo, _, digest = image.partition("@sha256:")
        assert re.fullmatch(r"[0-9a-f]{64}", digest), (name, image)
        comment = re.search(re.escape(image) + r"  # (\S+)$", text, re.M)
        assert comment and re.fullmatch(re.escape(repo) + r":\d+\.\d+(\.\d+)?", comment.group(1)), (name, image)
    assert "auto-setup" not in text
    base = re.search(r"^FROM (\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert base and re.fullmatch(r"python:3\.11\.\d+-slim", base.group(1))


def test_the_image_installs_with_the_tested_constraints() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^COPY .*\bconstraints\.txt\b", dockerfile, re.M)
    assert 'pip install --no-cache-dir -c constraints.txt ".[train,envs]"' in dockerfile
    pins = dict(line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0" and 'TORCH_SPEC="torch==2.13.0"' in dockerfile


def test_healthchecks_restart_policies_and_start_order() -> None:
    for name in LONG_RUNNING - {"control-worker", "gpu-worker", "trainer-worker", "sampler-worker"}:
        assert SERVICES[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in LONG_RUNNING:
        assert SERVICES[name].get("restart") == "unless-stopped", name
    for name in ONE_SHOT:
        assert SERVICES[name]["restart"].startswith("on-failure"), name
    for name, svc in SERVICES.items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on must name conditions"
        for dep, cond in deps.items():
            expected = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert cond == {"condition": expected}, (name, dep, cond)
    order = {
        "temporal-schema": "postgres", "temporal": "temporal-schema", "temporal-namespace": "temporal",
        "kiln-init": "temporal-namespace", "api": "kiln-init", "control-worker": "kiln-init",
        "gpu-worker": "kiln-init", "trainer-worker": "kiln-init", "sampler-worker": "kiln-init",
    }
    for name, dep in order.items():
        assert dep in SERVICES[name]["depends_on"], (name, dep)
    for name in ("api", "control-worker", "gpu-worker"):
        assert "seaweedfs" in SERVICES[name]["depends_on"], name


def test_gpu_worker_reserves_gpus_and_uses_cuda_torch() -> None:
    gpu = SERVICES["gpu-worker"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "whl/cu" in gpu["build"]["args"]["TORCH_INDEX"] and gpu["image"] == "kiln:cuda"
    assert "ARG TORCH_INDEX" in (ROOT / "Dockerfile").read_text()


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".kiln", ".git", "**/__pycache__", ".pytest_cache", ".env"} <= ignored


@pytest.mark.timeout(30)
def test_seaweedfs_start_script_writes_private_identity_and_jwt_keys(tmp_path: Path) -> None:
    stub = tmp_path / "bin" / "weed"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "weed $*"\npwd\n')
    stub.chmod(0o755)
    conf = tmp_path / "conf"
    env = {
        "PATH": f"{stub.parent}:{os.environ['PATH']}", "SEAWEEDFS_CONF_DIR": str(conf),
        "KILN_S3_ACCESS_KEY": "ak-compose", "KILN_S3_SECRET_KEY": "sk-compose-0123456789",
    }
    out = subprocess.run(["sh", str(ROOT / "deploy" / "seaweedfs-start.sh")], env=env, capture_output=True,
                         text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    argv, cwd = out.stdout.splitlines()
    args = argv.split()
    assert cwd == str(conf) and f"-s3.config={conf}/s3.json" in args and "-s3" in args
    # Only S3 listens beyond the container's loopback.
    assert {"-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3.ip.bind=0.0.0.0"} <= set(args)
    identities = json.loads((conf / "s3.json").read_text())["identities"]
    assert identities[0]["credentials"] == [{"accessKey": "ak-compose", "secretKey": "sk-compose-0123456789"}]
    toml = (conf / "security.toml").read_text()
    keys = re.findall(r'key = "([0-9a-f]{64})"', toml)
    assert len(set(keys)) == 4 and "[jwt.filer_signing.read]" in toml
    for name in ("s3.json", "security.toml"):
        assert stat.S_IMODE((conf / name).stat().st_mode) == 0o600
    refused = subprocess.run(["sh", str(ROOT / "deploy" / "seaweedfs-start.sh")],
                             env={**env, "KILN_S3_SECRET_KEY": 'bad"quote'}, capture_output=True, text=True,
                             timeout=20)
    assert refused.returncode == 1 and "must not contain" in refused.stderr
    missing = subprocess.run(["sh", str(ROOT / "deploy" / "seaweedfs-start.sh")],
                             env={k: v for k, v in env.items() if k != "KILN_S3_SECRET_KEY"},
                             capture_output=True, text=True, timeout=20)
    assert missing.returncode != 0 and "KILN_S3_SECRET_KEY is required" in missing.stderr


def test_deploy_scripts_are_valid_shell() -> None:
    for script in sorted((ROOT / "deploy").glob("*.sh")):
        assert subprocess.run(["sh", "-n", str(script)], capture_output=True, timeout=10).returncode == 0, script
