"""A dataset is checked when it is uploaded and when a training run is submitted on it (real
SeaweedFS and Temporal): the referenced object must exist with the size the reference gives, and
its first line must be a rollouts group; otherwise 400 before any run starts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.app import create_app
from kiln.core.artifacts.store import S3Store
from tests.integration.test_api_helpers import asgi_client

ROLLOUT_LINE = json.dumps({"completions": [{
    "tokens": {"pieces": [{"kind": "action", "ids": [1, 2]}]},
    "openenv": {"behavior_policy": {"base_model_sha256": "sha256:" + "0" * 64}, "episode_return": 1.0},
    "reward": 1.0}]}).encode() + b"\n"


@pytest.mark.timeout(180)
async def test_upload_refuses_bytes_that_are_no_rollouts_file(kiln_settings: Any) -> None:
    app = create_app(kiln_settings())
    async with asgi_client(app) as http:
        for body, message in ((b"GIF89a\x00\x01 not json\n", "rollouts line 1: not JSON"),
                              (b'{"groups": []}\n', "rollouts line 1: not an AgenticGroup with completions"),
                              (ROLLOUT_LINE.rstrip(b"\n"), "the rollouts file must end with a newline")):
            response = await http.put("/v1/datasets", content=body)
            assert response.status_code == 400, response.text
            assert response.json()["code"] == "training_invalid_dataset"
            assert response.json()["message"].startswith(message)
        ok = await http.put("/v1/datasets", content=ROLLOUT_LINE + b"later lines are checked at training\n")
        assert ok.status_code == 201, ok.text


@pytest.mark.timeout(180)
async def test_submit_refuses_a_missing_resized_or_unreadable_dataset(kiln_settings: Any) -> None:
    settings = kiln_settings()
    store = S3Store.from_settings(settings)
    missing = "d" * 64
    garbage = store.put_blob(b"\x00\x01 stored behind the API's back\n")  # never through PUT /v1/datasets
    app = create_app(settings)
    async with asgi_client(app) as http:
        uploaded = (await http.put("/v1/datasets", content=ROLLOUT_LINE)).json()
        cases = [
            ({"uri": f"s3://{settings.s3_bucket}/blobs/sha256/{missing}", "sha256": f"sha256:{missing}",
              "bytes": 10}, "openenv_invalid_dataset_ref", "names no stored dataset"),
            ({**uploaded, "bytes": uploaded["bytes"] + 1}, "openenv_invalid_dataset_ref",
             f"dataset.bytes is {uploaded['bytes'] + 1}, but the stored dataset holds {uploaded['bytes']} bytes"),
            (garbage.to_dict(), "training_invalid_dataset", "rollouts line 1: not JSON"),
        ]
        for dataset, code, message in cases:
            response = await http.post("/v1/train/grpo", json={"dataset": dataset, "output_adapter": "checked"})
            assert response.status_code == 400, response.text
            assert response.json()["code"] == code
            assert message in response.json()["message"]
