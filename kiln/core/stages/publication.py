"""Publication: build the bundle, store every object, verify, then write the manifest last.

Nothing is visible until every object is stored and re-verified; the manifest is written with a
conditional put, so a retried publication is idempotent and a partial one leaves no manifest. A
trained adapter's name is pointed at its files only after the manifest exists.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from kiln.core.artifacts.iterations import iteration_prefix, read_records
from kiln.core.artifacts.budget import DEFAULT_RETAINED_LIMIT_BYTES, RetainedBudget
from kiln.core.artifacts.manifest import build_manifest, manifest_key, verify_manifest_against_store
from kiln.core.artifacts.selections import full_selection
from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import pretty_json, sha256_bytes
from kiln.core.errors import RetainedBudgetExceeded, RunCancelled
from kiln.core.rollout.bundle import MAX_ARTIFACT_BYTES
from kiln.core.records import AdapterRef, PublishInput, PublishResult, PublishedArtifact, StoredObject
from kiln.core.side_records import PublishTrainingInput
from kiln.core.artifacts.adapters import adapter_ref_from_files, write_pointer
from kiln.core.stages.evaluation import make_bundle
from kiln.core.telemetry.live import metrics_jsonl

MEDIA_TYPES = {
    "rollouts.jsonl": "application/x-ndjson",
    "replay.json": "application/json",
    "summary.json": "application/json",
    "train_receipt.json": "application/json",
    "metrics.jsonl": "application/x-ndjson",
}


def adapter_media_type(name: str) -> str:
    return "application/json" if name.endswith(".json") else "application/octet-stream"


def iteration_artifacts(records: list[dict[str, Any]]) -> list[tuple[str, StoredObject, str]]:
    """Every iteration's bundle, adapter, receipts (``iterations/<k>/…``) from its stored record."""
    out: list[tuple[str, StoredObject, str]] = []
    for record in records:
        prefix = iteration_prefix(record["iteration"])
        for name, obj in sorted(record["files"].items()):
            out.append((prefix + name, StoredObject.model_validate(obj), MEDIA_TYPES[name]))
        training = record.get("training") or {}
        if training.get("trained"):
            for item in training["adapter_files"]:
                obj = StoredObject(uri=item["uri"], sha256=item["sha256"], bytes=item["bytes"])
                out.append((f"{prefix}adapter/{item['name']}", obj, adapter_media_type(item["name"])))
            if training.get("receipt"):
                out.append(
                    (
                        prefix + "train_receipt.json",
                        StoredObject.model_validate(training["receipt"]),
                        MEDIA_TYPES["train_receipt.json"],
                    )
                )
        evaluation = record.get("evaluation")
        if evaluation:
            for side, files in sorted(evaluation["sides"].items()):
                for name, obj in sorted(files.items()):
                    out.append(
                        (f"{prefix}environment_eval/{side}/{name}", StoredObject.model_validate(obj), MEDIA_TYPES[name])
                    )
            out.append(
                (
                    prefix + "environment_eval/receipt.json",
                    StoredObject.model_validate(evaluation["receipt"]),
                    "application/json",
                )
            )
    return out


def _artifact(name: str, obj: StoredObject, media_type: str) -> dict[str, Any]:
    return {"name": name, "uri": obj.uri, "sha256": obj.sha256, "bytes": obj.bytes, "media_type": media_type}


def publish(
    store: S3Store,
    inp: PublishInput,
    *,
    budget_bytes: int = DEFAULT_RETAINED_LIMIT_BYTES,
    may_commit: Callable[[], bool] | None = None,
) -> PublishResult:
    training = inp.training
    evaluation = inp.evaluation
    bundle = make_bundle(
        store,
        spec=inp.bundle,
        environments=inp.environments,
        groups=inp.groups,
        behavior_policy=inp.behavior_policy,
        reset_plan_sha256=inp.reset_plan_sha256,
        training_selection=full_selection(store, training),
    )
    bundle = {**bundle, "metrics.jsonl": metrics_jsonl(store, inp.run_id)}  # live figures, wall-clock
    stored: list[tuple[str, StoredObject, str]] = []
    if training is not None and training.trained:
        for item in training.adapter_files:
            stored.append((f"adapter/{item.name}", item.object, adapter_media_type(item.name)))
        if training.receipt is not None:
            stored.append(("train_receipt.json", training.receipt, "application/json"))
    if evaluation is not None:
        for side in (evaluation.baseline, evaluation.candidate):
            for name, obj in sorted(side.files.items()):
                stored.append((f"environment_eval/{side.side}/{name}", obj, MEDIA_TYPES[name]))
        stored.append(("environment_eval/receipt.json", evaluation.receipt, "application/json"))
    if inp.post_eval is not None:
        stored.append(("post_eval/report.json", inp.post_eval.report, "application/json"))
    stored.extend(iteration_artifacts(read_records(store, inp.run_id, inp.iterations, inp.iteration_chain)))

    # Charge everything the run retains BEFORE writing anything: over budget, nothing is written.
    budget = RetainedBudget(budget_bytes)
    for name, data in bundle.items():
        if len(data) > MAX_ARTIFACT_BYTES:
            raise RetainedBudgetExceeded(
                f"{name} is {len(data)} bytes; one artifact may hold at most {MAX_ARTIFACT_BYTES}",
                hint="collect fewer or shorter episodes per run",
            )
        budget.charge(len(data), name)
    for name, obj, _media in stored:
        budget.charge(obj.bytes, name)

    artifacts: list[dict[str, Any]] = []
    for name, data in bundle.items():
        ref = store.put_blob(data)
        artifacts.append(
            {"name": name, "uri": ref.uri, "sha256": ref.sha256, "bytes": ref.bytes, "media_type": MEDIA_TYPES[name]}
        )
    artifacts.extend(_artifact(name, obj, media) for name, obj, media in stored)
    summary = json.loads(bundle["summary.json"])
    manifest = build_manifest(
        inp.run_id,
        artifacts,
        {
            "kind": inp.kind,
            "output_adapter": inp.output_adapter,
            "adapter_sha256": training.adapter_sha256 if training and training.trained else None,
            "behavior_policy": inp.behavior_policy,
            "reset_plan_sha256": inp.reset_plan_sha256,
            "stats": summary["stats"],
            "environment_eval": (
                {"decision": evaluation.decision, "outcome": evaluation.outcome, "verdict": evaluation.verdict}
                if evaluation is not None
                else None
            ),
            "promoted": bool(inp.promote and training is not None and training.trained),
            **({"iterations": inp.iterations} if inp.iterations > 1 else {}),
        },
    )
    promoted = None
    if inp.promote and training is not None and training.trained and inp.output_adapter:
        promoted = adapter_ref_from_files(inp.output_adapter, training.adapter_sha256 or "", training.adapter_files)
    return finish_publication(
        store, inp.run_id, manifest, artifacts, promoted, stats=summary["stats"], may_commit=may_commit
    )


def finish_publication(
    store: S3Store,
    run_id: str,
    manifest: dict[str, Any],
    artifacts: list[dict[str, Any]],
    promoted: AdapterRef | None,
    *,
    stats: dict[str, Any],
    may_commit: Callable[[], bool] | None = None,
) -> PublishResult:
    """Re-verify every object, write the manifest last (conditional put), then promote.

    ``may_commit`` is asked once, at the commit point: when it says no (the run was cancelled),
    nothing becomes visible.
    """
    verify_manifest_against_store(manifest, store)
    manifest_bytes = pretty_json(manifest)
    key = manifest_key(run_id)
    if may_commit is not None and not may_commit():
        raise RunCancelled("publication cancelled before the manifest was written", stage="publication")
    store.put_if_absent(key, manifest_bytes)
    manifest_uri = store.uri_for(key)
    if promoted is not None:
        write_pointer(store, promoted, run_id=run_id, manifest_uri=manifest_uri)
    return PublishResult(
        manifest_uri=manifest_uri,
        manifest_sha256=sha256_bytes(manifest_bytes),
        # The run's own artifacts; each iteration's (``iterations/…``) are listed by the manifest
        # only, so the result stays small whatever the number of iterations.
        artifacts=[
            PublishedArtifact(name=a["name"], uri=a["uri"], sha256=a["sha256"], bytes=a["bytes"])
            for a in artifacts
            if not a["name"].startswith("iterations/")
        ],
        stats=stats,
    )


def publish_training(store: S3Store, inp: PublishTrainingInput) -> PublishResult:
    """Manifest of a dataset-training run: the dataset, the adapter files and the receipt."""
    training = inp.training
    entries: list[tuple[str, StoredObject, str]] = [("rollouts.jsonl", inp.dataset, MEDIA_TYPES["rollouts.jsonl"])]
    if training.trained:
        for item in training.adapter_files:
            entries.append((f"adapter/{item.name}", item.object, adapter_media_type(item.name)))
        if training.receipt is not None:
            entries.append(("train_receipt.json", training.receipt, "application/json"))
    metrics = StoredObject.of(store.put_blob(metrics_jsonl(store, inp.run_id)))
    entries.append(("metrics.jsonl", metrics, MEDIA_TYPES["metrics.jsonl"]))
    artifacts = [_artifact(name, obj, media) for name, obj, media in entries]
    manifest = build_manifest(
        inp.run_id,
        artifacts,
        {
            "kind": "train_dataset",
            "output_adapter": inp.output_adapter,
            "adapter_sha256": training.adapter_sha256 if training.trained else None,
            "promoted": bool(inp.promote and training.trained),
        },
    )
    promoted = (
        adapter_ref_from_files(inp.output_adapter, training.adapter_sha256 or "", training.adapter_files)
        if inp.promote and training.trained
        else None
    )
    return finish_publication(store, inp.run_id, manifest, artifacts, promoted, stats={})
