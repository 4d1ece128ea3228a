"""Training preflight: a sealed contract (defaults filled, policy identity from a gpu worker) that
a run executes from; a tampered contract fails closed."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from api.app import create_app
from kiln.core.training_config import TrainingConfig
from tests.integration.test_api_helpers import TINY_ROLLOUT, asgi_client, wait_for
from tests.support.kiln_workers import running_workers

pytestmark = pytest.mark.asyncio

TRAINING = {"epochs": 1, "lora_rank": 4, "lora_alpha": 8}
TERMINAL = ("completed", "failed", "cancelled")


def _train_request(url: str, contract: dict[str, Any], output_adapter: str) -> dict[str, Any]:
    return {
        **TINY_ROLLOUT,
        "kind": "train",
        "environment_urls": [url],
        "output_adapter": output_adapter,
        "training_config": TRAINING,
        "training_contract": contract,
    }


async def test_preflight_contract_is_sealed_and_executed(kiln_settings: Any, counter_env_url: str) -> None:
    settings = kiln_settings()
    output_adapter = f"pf-{uuid.uuid4().hex[:8]}"
    async with running_workers(settings) as client:
        async with asgi_client(create_app(settings, client=client)) as http:
            response = await http.post(
                "/v1/openenv/training/preflight",
                json={"output_adapter": output_adapter, "training_config": TRAINING},
            )
            assert response.status_code == 200, response.text
            receipt = response.json()
            assert receipt["schema"] == "kiln.openenv-training-preflight.v1"
            assert receipt["capacity_reserved"] is False
            contract = receipt["contract"]
            assert contract["schema"] == "kiln.openenv-training-contract.v1"
            expected_config = TrainingConfig(**TRAINING).model_dump(mode="json", by_alias=True)
            assert contract["effective_config"] == expected_config
            # Defaults are filled in (fields the request did not give).
            assert contract["effective_config"]["learning_rate"] == TrainingConfig().learning_rate
            assert contract["effective_config"]["lora_rank"] == 4
            assert contract["output_adapter"] == output_adapter
            assert contract["base_adapter"] is None
            policy = contract["behavior_policy"]
            assert policy == receipt["behavior_policy"] and policy["adapter"] is None

            # Resolving twice gives the same identity (it is the model's, not the call's).
            again = await http.post("/v1/openenv/training/preflight", json={"output_adapter": output_adapter})
            assert again.json()["behavior_policy"] == policy
            assert again.json()["effective_config"] == TrainingConfig().model_dump(mode="json", by_alias=True)

            # A run submitted with the contract executes from it.
            created = await http.post(
                "/v1/openenv/runs", json=_train_request(counter_env_url, contract, output_adapter)
            )
            assert created.status_code == 202, created.text
            run_id = created.json()["run_id"]
            final = await wait_for(http, run_id, lambda s: s["state"] in TERMINAL, timeout_s=180)
            assert final["state"] == "completed", final.get("failure")
            # the run's identity is the contract's plus the run's sampling settings (issue 13)
            run_policy = dict(final["behavior_policy"])
            assert run_policy.pop("inference")["temperature"] == 1.0
            assert run_policy.pop("inference_config_sha256").startswith("sha256:")
            assert run_policy == policy

            # The same contract with a tampered behaviour policy fails closed, before collection.
            tampered = {**contract, "behavior_policy": {**policy, "base_model_sha256": "sha256:" + "0" * 64}}
            created = await http.post(
                "/v1/openenv/runs", json=_train_request(counter_env_url, tampered, output_adapter)
            )
            assert created.status_code == 202, created.text
            run_id = created.json()["run_id"]
            final = await wait_for(http, run_id, lambda s: s["state"] in TERMINAL, timeout_s=120)
            assert final["state"] == "failed"
            assert final["failure"]["code"] == "policy_identity_changed"
            assert "base_model_sha256" in final["failure"]["details"]["changed_fields"]
            assert final["progress"]["rollouts_completed"] == 0
            assert final["manifest"] is None


async def test_preflight_rejects_bad_bodies_and_unknown_adapters(kiln_settings: Any) -> None:
    settings = kiln_settings()
    async with asgi_client(create_app(settings)) as http:
        for body, field in (
            ({}, "output_adapter"),
            ({"output_adapter": "a", "capacity": 1}, "capacity"),
            ({"output_adapter": "bad name!"}, "output_adapter"),
            ({"output_adapter": "same", "adapter": "same"}, "differ"),
            ({"output_adapter": "a", "training_config": {"epochs": 0}}, "epochs"),
        ):
            response = await http.post("/v1/openenv/training/preflight", json=body)
            assert response.status_code == 400, body
            assert response.json()["code"] == "openenv_invalid_request"
            assert field in response.json()["message"]
    async with running_workers(settings) as client:
        async with asgi_client(create_app(settings, client=client)) as http:
            missing = await http.post(
                "/v1/openenv/training/preflight",
                json={"output_adapter": "out", "adapter": f"absent-{uuid.uuid4().hex[:6]}"},
            )
            assert missing.status_code == 404, missing.text
            assert missing.json()["code"] == "adapter_not_found"
