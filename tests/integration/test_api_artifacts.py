"""Artifact serving and verified download: manifest-only names, headers, corruption detection.

One tiny rollout run on real workers (counter env, tiny model); the app is served by uvicorn so the
CLI (``kiln openenv artifact``) downloads over real HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import boto3
import httpx
import jsonschema
import pytest
import typer
from typer.testing import CliRunner

from kiln.cli.control_cmds import register
from kiln.client.downloads import download_run_outputs
from kiln.client.http import ApiClient
from kiln.core.artifacts.manifest import manifest_key
from tests.integration.test_api_helpers import TINY_ROLLOUT, serve_api, wait_for
from tests.support.kiln_workers import running_workers
from tests.support.raw_http import raw_get

pytestmark = pytest.mark.asyncio


def cli_app() -> typer.Typer:
    root = typer.Typer()
    openenv = typer.Typer()
    register(openenv)
    root.add_typer(openenv, name="openenv")
    return root


def _s3(settings: Any) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint,
        aws_access_key_id=settings.s3_access_key,
        aws_secret_access_key=settings.s3_secret_key,
        region_name="us-east-1",
    )


async def _cli(url: str, *args: str) -> Any:
    return await asyncio.to_thread(
        CliRunner().invoke, cli_app(), ["openenv", *args], env={"KILN_API_URL": url}
    )


async def test_artifacts_served_verified_and_corruption_detected(
    kiln_settings: Any, counter_env_url: str, tmp_path: Path
) -> None:
    settings = kiln_settings()
    # A seed no other test uses: the content-addressed blobs below belong to this test alone.
    request = {**TINY_ROLLOUT, "seed_start": 73017, "environment_urls": [counter_env_url]}
    s3 = _s3(settings)
    async with running_workers(settings) as _client:
        with serve_api(settings) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                created = await http.post("/v1/openenv/runs", json=request)
                assert created.status_code == 202
                run_id = created.json()["run_id"]
                status = await wait_for(http, run_id, lambda s: s["state"] in ("completed", "failed"))
                assert status["state"] == "completed", status.get("failure")

                # The manifest, byte for byte as published and recorded by the run.
                manifest_response = await http.get(f"/v1/openenv/runs/{run_id}/artifacts")
                assert manifest_response.status_code == 200
                published = s3.get_object(Bucket=settings.s3_bucket, Key=manifest_key(run_id))["Body"].read()
                assert manifest_response.content == published
                digest = "sha256:" + hashlib.sha256(published).hexdigest()
                assert digest == status["manifest"]["sha256"]
                assert manifest_response.headers["etag"] == f'"{digest}"'
                manifest = json.loads(published)
                entries = {e["name"]: e for e in manifest["artifacts"]}
                assert set(entries) == {"rollouts.jsonl", "replay.json", "summary.json", "metrics.jsonl"}

                # Each declared artifact: exact bytes and the contract headers; its body is what the
                # OpenAPI document declares for its media type.
                document = (await http.get("/openapi.json")).json()
                declared = document["paths"]["/v1/openenv/runs/{run_id}/artifacts/{name}"]["get"][
                    "responses"]["200"]["content"]
                for name, entry in entries.items():
                    response = await http.get(f"/v1/openenv/runs/{run_id}/artifacts/{name}")
                    assert response.status_code == 200
                    schema = declared[entry["media_type"]]["schema"]
                    if schema.get("format") != "binary":
                        body = json.loads(response.content) if schema["type"] == "object" else response.text
                        jsonschema.validate(body, schema)
                    assert "sha256:" + hashlib.sha256(response.content).hexdigest() == entry["sha256"]
                    assert len(response.content) == entry["bytes"]
                    assert response.headers["content-length"] == str(entry["bytes"])
                    assert response.headers["etag"] == f'"{entry["sha256"]}"'
                    assert response.headers["content-type"].split(";")[0] == entry["media_type"]
                    assert response.headers["cache-control"] == "private, no-store"
                    assert response.headers["x-content-type-options"] == "nosniff"
                    assert response.headers["content-disposition"] == (
                        f'attachment; filename="openenv-{run_id}-{name}"'
                    )

                # Names outside the manifest are not served, even if the key exists in S3. The
                # targets go out byte for byte (httpx would normalise `..` away before sending), so
                # each reaches the artifact handler and is refused there.
                base = f"/v1/openenv/runs/{run_id}/artifacts/"
                for name in ("manifest.json", "../manifest.json", "%2e%2e/manifest.json",
                             "..%2fmanifest.json", "rollouts.json", "adapter/x", "../../../etc/passwd"):
                    status_code, body = await asyncio.to_thread(raw_get, url, base + name)
                    assert status_code == 404, (name, body)
                    assert body["code"] == "openenv_artifact_not_found", (name, body)
                outside = await http.get(f"/v1/openenv/runs/{run_id}/artifacts/train_receipt.json")
                assert outside.json()["code"] == "openenv_artifact_not_found"

                # CLI download: verified, atomic, no overwrite without --force.
                target = tmp_path / "out" / "run.rollouts.jsonl"
                result = await _cli(url, "artifact", run_id, "rollouts.jsonl", "--output", str(target), "--json")
                assert result.exit_code == 0, result.output
                receipt = json.loads(result.output)
                assert receipt["sha256"] == entries["rollouts.jsonl"]["sha256"]
                assert receipt["source_url"] == f"/v1/openenv/runs/{run_id}/artifacts/rollouts.jsonl"
                assert "sha256:" + hashlib.sha256(target.read_bytes()).hexdigest() == receipt["sha256"]
                target.write_bytes(b"keep me")
                refused = await _cli(url, "artifact", run_id, "rollouts.jsonl", "--output", str(target))
                assert refused.exit_code == 2
                assert "openenv_artifact_output_exists" in refused.output
                assert target.read_bytes() == b"keep me"
                forced = await _cli(url, "artifact", run_id, "rollouts.jsonl", "--output", str(target), "--force")
                assert forced.exit_code == 0, forced.output
                assert target.stat().st_size == entries["rollouts.jsonl"]["bytes"]
                unknown = await _cli(url, "artifact", run_id, "nope.json", "--output", str(tmp_path / "n.json"))
                assert unknown.exit_code == 2 and "openenv_artifact_not_found" in unknown.output
                assert not (tmp_path / "n.json").exists()

                # The rollout local outputs (dataset, replay, summary) in one call.
                outputs = {
                    "rollouts.jsonl": tmp_path / "x.rollouts.jsonl",
                    "replay.json": tmp_path / "x.replay.json",
                    "summary.json": tmp_path / "x.rollout-summary.json",
                }
                receipts = await asyncio.to_thread(download_run_outputs, ApiClient(url), run_id, outputs)
                assert [r["kind"] for r in receipts] == list(outputs)
                for name, path in outputs.items():
                    assert "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() == entries[name]["sha256"]

                # Corrupt the replay blob in S3 (same size, one byte changed): never served.
                replay = entries["replay.json"]
                bucket, key = replay["uri"].removeprefix("s3://").split("/", 1)
                original = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
                try:
                    corrupted = bytearray(original)
                    corrupted[len(corrupted) // 2] ^= 0x01
                    s3.put_object(Bucket=bucket, Key=key, Body=bytes(corrupted))
                    response = await http.get(f"/v1/openenv/runs/{run_id}/artifacts/replay.json")
                    assert response.status_code == 409
                    assert response.json()["code"] == "openenv_artifact_integrity_failed"
                    assert "etag" not in response.headers

                    bad_target = tmp_path / "bad" / "replay.json"
                    failed = await _cli(url, "artifact", run_id, "replay.json", "--output", str(bad_target))
                    assert failed.exit_code == 2
                    assert "openenv_artifact_integrity_failed" in failed.output
                    assert not bad_target.exists()
                    assert list(bad_target.parent.iterdir()) == []  # no staged leftovers

                    # A truncated object is caught as well.
                    s3.put_object(Bucket=bucket, Key=key, Body=original[:-10])
                    response = await http.get(f"/v1/openenv/runs/{run_id}/artifacts/replay.json")
                    assert response.status_code == 409
                    assert response.json()["code"] == "openenv_artifact_integrity_failed"
                finally:
                    s3.put_object(Bucket=bucket, Key=key, Body=original)
                restored = await http.get(f"/v1/openenv/runs/{run_id}/artifacts/replay.json")
                assert restored.status_code == 200 and restored.content == original
