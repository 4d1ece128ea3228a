"""Publication: build the bundle, store every object, verify, then write the manifest last.

Nothing is visible until every object is stored and re-verified; the manifest is written with a
conditional put, so a retried publication is idempotent and a partial one leaves no manifest. A
trained adapter's name is pointed at its files only after the manifest exists.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.artifacts.budget import RetainedBudget
from kiln.artifacts.manifest import build_manifest, manifest_key, verify_manifest_against_store
from kiln.artifacts.store import ObjectRef, S3Store
from kiln.canonical import pretty_json, sha256_bytes
from kiln.rollout.bundle import build_bundle
from kiln.stages import PublishedArtifact, PublishInput, PublishResult, StoredObject
from kiln.steps.adapters import write_pointer
from kiln.steps.discovery import load_inspection

MEDIA_TYPES = {
    "rollouts.jsonl": "application/x-ndjson",
    "replay.json": "application/json",
    "summary.json": "application/json",
    "train_receipt.json": "application/json",
}


def _ref(obj: StoredObject) -> ObjectRef:
    return ObjectRef(uri=obj.uri, sha256=obj.sha256, bytes=obj.bytes)


def publish(store: S3Store, inp: PublishInput) -> PublishResult:
    budget = RetainedBudget()
    documents = []
    for obj in inp.groups:
        budget.charge(obj.bytes, f"group object {obj.uri}")
        documents.append(json.loads(store.get_bytes(_ref(obj))))
    inspections = [load_inspection(store, env.inspection) for env in inp.environments]
    training = inp.training
    bundle = build_bundle(
        documents,
        request=inp.request,
        inspections=inspections,
        behavior_policy=inp.behavior_policy,
        reset_plan_sha256=inp.reset_plan_sha256,
        training_selection=training.selection if training else None,
    )
    artifacts: list[dict[str, Any]] = []
    for name, data in bundle.items():
        budget.charge(len(data), name)
        ref = store.put_blob(data)
        artifacts.append(
            {"name": name, "uri": ref.uri, "sha256": ref.sha256, "bytes": ref.bytes, "media_type": MEDIA_TYPES[name]}
        )
    if training is not None and training.trained:
        for item in training.adapter_files:
            budget.charge(item.object.bytes, f"adapter/{item.name}")
            artifacts.append(
                {
                    "name": f"adapter/{item.name}",
                    "uri": item.object.uri,
                    "sha256": item.object.sha256,
                    "bytes": item.object.bytes,
                    "media_type": "application/json" if item.name.endswith(".json") else "application/octet-stream",
                }
            )
        if training.receipt is not None:
            budget.charge(training.receipt.bytes, "train_receipt.json")
            artifacts.append(
                {
                    "name": "train_receipt.json",
                    "uri": training.receipt.uri,
                    "sha256": training.receipt.sha256,
                    "bytes": training.receipt.bytes,
                    "media_type": "application/json",
                }
            )
    summary = json.loads(bundle["summary.json"])
    manifest = build_manifest(
        inp.run_id,
        artifacts,
        {
            "kind": inp.request["kind"],
            "output_adapter": inp.request.get("output_adapter"),
            "adapter_sha256": training.adapter_sha256 if training and training.trained else None,
            "behavior_policy": inp.behavior_policy,
            "reset_plan_sha256": inp.reset_plan_sha256,
            "stats": summary["stats"],
        },
    )
    verify_manifest_against_store(manifest, store)
    manifest_bytes = pretty_json(manifest)
    key = manifest_key(inp.run_id)
    store.put_if_absent(key, manifest_bytes)
    manifest_uri = store.uri_for(key)
    if training is not None and training.trained and inp.request.get("output_adapter"):
        write_pointer(
            store,
            inp.request["output_adapter"],
            run_id=inp.run_id,
            adapter_sha256=training.adapter_sha256 or "",
            files=[{"name": f.name, "object": f.object.model_dump()} for f in training.adapter_files],
            manifest_uri=manifest_uri,
        )
    return PublishResult(
        manifest_uri=manifest_uri,
        manifest_sha256=sha256_bytes(manifest_bytes),
        artifacts=[
            PublishedArtifact(name=a["name"], uri=a["uri"], sha256=a["sha256"], bytes=a["bytes"])
            for a in artifacts
        ],
        stats=summary["stats"],
    )
