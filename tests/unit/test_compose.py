"""docker-compose.yml cannot run here (no Docker engine): check it statically against the code."""

from __future__ import annotations

from pathlib import Path

import yaml

from kiln.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_compose_services_and_settings() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {
        "postgres", "temporal", "temporal-ui", "seaweedfs", "api", "control-worker", "gpu-worker", "counter-env",
    }
    assert services["control-worker"]["command"] == ["python", "-m", "workers", "control"]
    assert services["gpu-worker"]["command"] == ["python", "-m", "workers", "gpu"]
    fields = set(Settings.model_fields)
    for name in ("api", "control-worker", "gpu-worker"):
        env = services[name]["environment"]
        for key in env:
            assert key.startswith("KILN_") and key.removeprefix("KILN_").lower() in fields, key
    # Beyond loopback the API needs a token: compose refuses to start without one.
    assert services["api"]["environment"]["KILN_API_HOST"] == "0.0.0.0"
    assert "KILN_API_TOKEN:?" in services["api"]["environment"]["KILN_API_TOKEN"]
    assert (ROOT / "Dockerfile").read_text().count("torch==2.13.0") == 1
