"""The paired held-out evaluation and promotion gate on real runs (counter env, tiny model).

One run trains a genuinely better adapter (the gate passes and promotes it); one trains a
deliberately worse adapter (ECHO at λ=1 with a high learning rate wrecks the tiny model's action
format) — the gate rejects it and the adapter name is not promoted. The two runs go at the same
time (``gate_runs``), the worse one's gpu worker in a child process, so both cores work.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from api.runs import RunService
from kiln.core.artifacts.adapters import pointer_key
from kiln.core.artifacts.store import S3Store
from kiln.core.contracts import parse_run_request
from kiln.core.evaluation.receipt import validate_receipt
from kiln.core.evaluation.sign_test import exact_sign_test_p_value
from tests.support.kiln_workers import child_gpu_worker, running_workers, settings_for_tests
from tests.support.waiting import workflow_result

BASE_RUN = {
    "kind": "train",
    "groups": 8,
    "group_size": 4,
    "max_steps": 6,
    "max_action_tokens": 48,
    "environment_eval": {"groups": 20, "group_size": 2, "gate": {"min_mean_improvement": 0.5}},
}


async def _run(settings: Any, request: dict[str, Any]) -> dict[str, Any]:
    async with running_workers(settings) as client:
        service = RunService(client, settings)
        status, _ = await service.submit(parse_run_request(request))
        return await workflow_result(client.get_workflow_handle(status.run_id))


BETTER_RUN = {
    **BASE_RUN,
    "output_adapter": "counter-better",
    # one pass at the defaults and 1e-3 (tests/support/counter_loop.py ONE_PASS_TRAINING), ECHO λ=0.05
    # on: on these seeds it improves the held-out return significantly
    "training_config": {"learning_rate": 1e-3, "epochs": 4},
}
WORSE_RUN = {
    **BASE_RUN,
    "output_adapter": "counter-worse",
    # measured (bench/counter_training.py): held-out return -0.65 vs base 2.5, 74 % invalid
    # actions. on_no_output drop (no longer the default): nothing pushes back on the invalid
    # completions, so this destructive setting reliably makes the adapter worse.
    "training_config": {"optimizer": "adamw", "learning_rate": 1e-2, "epochs": 4, "echo": {"lambda": 1.0},
                        "on_no_output": "drop", "is_level": "token", "kl_coeff": 0.1},
}


async def _both_runs(better: Any, worse: Any, env_url: str) -> dict[str, dict[str, Any]]:
    """Both runs submitted together: the better one on workers in this process, the worse one's
    control worker here and its gpu worker in a child process (entered by the caller)."""
    async with running_workers(better) as client, running_workers(worse, roles=("control",)):
        handles = {}
        for name, settings, request in (("better", better, BETTER_RUN), ("worse", worse, WORSE_RUN)):
            status, _ = await RunService(client, settings).submit(
                parse_run_request({**request, "environment_urls": [env_url]}))
            handles[name] = client.get_workflow_handle(status.run_id)
        results = await asyncio.gather(*(workflow_result(h, timeout_s=720) for h in handles.values()))
    return dict(zip(handles, results))


@pytest.fixture(scope="module")
def gate_runs(temporal_server: str, s3_server: dict[str, str], tiny_model_dir: Path, counter_env_url: str,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both gated runs, finished: ``{"better"|"worse": (settings, final status)}``."""
    settings = {name: settings_for_tests(temporal_server, s3_server, tiny_model_dir, tmp_path_factory.mktemp(name))
                for name in ("better", "worse")}
    with child_gpu_worker(settings["worse"], tmp_path_factory.mktemp("worse-gpu")):
        finals = asyncio.run(_both_runs(settings["better"], settings["worse"], counter_env_url))
    return {name: (settings[name], finals[name]) for name in finals}


def _receipt(settings: Any, final: dict[str, Any]) -> dict[str, Any]:
    store = S3Store.from_settings(settings)
    entry = next(a for a in final["artifacts"] if a["name"] == "environment_eval/receipt.json")
    from kiln.core.artifacts.store import ObjectRef

    return json.loads(store.get_bytes(ObjectRef(uri=entry["uri"], sha256=entry["sha256"], bytes=entry["bytes"])))


@pytest.mark.slow
@pytest.mark.timeout(900)  # includes the gate_runs fixture (both runs)
def test_gate_passes_and_promotes_a_better_adapter(gate_runs: dict[str, Any]) -> None:
    settings, final = gate_runs["better"]
    assert final["state"] == "completed"
    evaluation = final["environment_evaluation"]
    evidence = evaluation["evidence"]
    assert evaluation["decision"] == "passed" and evaluation["outcome"] == "promoted"
    assert evidence["paired_groups"] == 20 and evidence["paired_episodes"] == 40
    assert evidence["improved_groups"] + evidence["regressed_groups"] + evidence["tied_groups"] == 20
    # The trained adapter beats the base on held-out seeds by a clear margin.
    assert evidence["mean_return_improvement"] > 1.0
    assert evidence["exact_sign_test_p_value"] == exact_sign_test_p_value(
        evidence["improved_groups"], evidence["regressed_groups"]
    )
    assert evidence["exact_sign_test_p_value"] < 0.05
    receipt = _receipt(settings, final)
    validate_receipt(receipt)
    assert receipt["outcome"] == "promoted" and receipt["candidate"]["adapter"] == "counter-better"
    assert receipt["evidence"] == evidence
    summaries = {a["name"]: a["sha256"] for a in final["artifacts"]}
    assert receipt["baseline_summary_sha256"] == summaries["environment_eval/baseline/summary.json"]
    assert receipt["candidate_summary_sha256"] == summaries["environment_eval/candidate/summary.json"]
    assert receipt["world_model"]["env_tokens"] > 0
    # Held-out seeds follow the training seeds, with no overlap.
    assert receipt["seed_start"] == 8
    pointer = json.loads(S3Store.from_settings(settings).get_key(pointer_key("counter-better")))
    assert pointer["adapter"]["adapter_sha256"] == final["training"]["adapter_sha256"]
    assert final["promoted"] is True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gate_rejects_a_worse_adapter_and_does_not_promote(gate_runs: dict[str, Any]) -> None:
    settings, final = gate_runs["worse"]
    assert final["state"] == "completed"
    evaluation = final["environment_evaluation"]
    assert evaluation["decision"] == "rejected" and evaluation["outcome"] == "rejected"
    assert evaluation["evidence"]["regressed_groups"] > evaluation["evidence"]["improved_groups"]
    assert final["promoted"] is False
    assert S3Store.from_settings(settings).get_key(pointer_key("counter-worse")) is None
    receipt = _receipt(settings, final)
    validate_receipt(receipt)
    assert receipt["outcome"] == "rejected"
    # ECHO was on: the trainer's receipt shows the observation cross-entropy falling.
    store = S3Store.from_settings(settings)
    from kiln.core.artifacts.store import ObjectRef

    entry = next(a for a in final["artifacts"] if a["name"] == "train_receipt.json")
    train_receipt = json.loads(store.get_bytes(ObjectRef(uri=entry["uri"], sha256=entry["sha256"], bytes=entry["bytes"])))
    echo = train_receipt["echo"]
    assert echo["enabled"] is True and echo["final_env_ce"] < echo["initial_env_ce"]


async def test_post_eval_static_suite_owns_promotion(kiln_settings: Any, counter_env_url: str) -> None:
    """post_eval with min_accuracy gates promotion; the report is published and bound by digest.

    The threshold 0.0 makes the outcome known in advance (any accuracy meets it), so the test
    states it instead of recomputing it with the gate's own rule, and checks that the adapter
    pointer really moved to the trained adapter.
    """
    settings = kiln_settings()
    final = await _run(
        settings,
        {
            "kind": "train",
            "groups": 2,
            "group_size": 4,
            "max_steps": 3,
            "max_action_tokens": 48,
            "environment_urls": [counter_env_url],
            "output_adapter": "counter-post-eval",
            "training_config": {"learning_rate": 1e-3, "epochs": 1, "echo": None, "lora_rank": 4, "lora_alpha": 8},
            "post_eval": {"suite": "counter-format", "min_accuracy": 0.0},
        },
    )
    assert final["state"] == "completed"
    post = final["post_evaluation"]
    assert post["suite"] == "counter-format"
    assert 0.0 <= post["candidate_accuracy"] <= 1.0 and 0.0 <= post["baseline_accuracy"] <= 1.0
    assert post["gate_outcome"] == "promoted"
    assert final["promoted"] is True
    report_entry = next(a for a in final["artifacts"] if a["name"] == "post_eval/report.json")
    from kiln.core.artifacts.store import ObjectRef

    store = S3Store.from_settings(settings)
    report = json.loads(store.get_bytes(ObjectRef(uri=report_entry["uri"], sha256=report_entry["sha256"], bytes=report_entry["bytes"])))
    assert report["candidate"]["cases"] == 24 and report["gate_outcome"] == "promoted"
    # The name now points at exactly the adapter this run trained.
    pointer = json.loads(store.get_key(pointer_key("counter-post-eval")))
    assert pointer["adapter"]["adapter_sha256"] == final["training"]["adapter_sha256"]
    assert final["training"]["adapter_sha256"].startswith("sha256:") or len(final["training"]["adapter_sha256"]) >= 64


def test_post_eval_and_environment_gate_cannot_both_own_promotion() -> None:
    from kiln.core.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="only one may own it"):
        parse_run_request(
            {
                **BASE_RUN,
                "environment_urls": ["http://127.0.0.1:8990"],
                "output_adapter": "x",
                "post_eval": {"suite": "counter-format", "min_accuracy": 0.5},
            }
        )
