"""Paired held-out evaluation: store each side's bundle, pair them, decide, write the receipt."""

from __future__ import annotations

import json
from typing import Any

from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import pretty_json
from kiln.core.evaluation.gate import evidence_and_decision, outcome_for
from kiln.core.evaluation.pairing import pair_summaries
from kiln.core.evaluation.receipt import build_receipt, policy_identity
from kiln.core.rollout.bundle import build_bundle
from kiln.core.artifacts.group_sets import read_group_documents
from kiln.core.records import (
    BundleSource,
    EvaluateInput,
    EvaluationResult,
    SideBundle,
    SideBundleInput,
    StoredObject,
)
from kiln.core.stages.discovery import load_inspection


def make_bundle(
    store: S3Store, source: BundleSource, training_selection: dict[str, Any] | None = None
) -> dict[str, bytes]:
    """The three bundle files of a set of stored groups (pure function of their content)."""
    return build_bundle(
        read_group_documents(store, source.groups),
        spec=source.bundle,
        inspections=[load_inspection(store, env.inspection) for env in source.environments],
        behavior_policy=source.behavior_policy,
        reset_plan_sha256=source.reset_plan_sha256,
        training_selection=training_selection,
    )


def store_bundle(
    store: S3Store, source: BundleSource, training_selection: dict[str, Any] | None = None
) -> tuple[dict[str, StoredObject], dict[str, Any]]:
    """Build a bundle (``make_bundle``) and store its three files; returns the stored objects by
    file name and the summary's stats."""
    files = make_bundle(store, source, training_selection)
    stored = {name: StoredObject.of(store.put_blob(data)) for name, data in files.items()}
    return stored, json.loads(files["summary.json"])["stats"]


def store_side_bundle(store: S3Store, inp: SideBundleInput) -> SideBundle:
    stored, stats = store_bundle(store, inp)
    return SideBundle(side=inp.side, files=stored, stats=stats)


def evaluate(store: S3Store, inp: EvaluateInput) -> EvaluationResult:
    """Pair baseline and candidate, apply the gate, bind everything in one receipt."""
    blobs = {
        (side.side, name): store.get_bytes(obj.ref())
        for side in (inp.baseline, inp.candidate)
        for name, obj in side.files.items()
        if name in ("summary.json", "replay.json")
    }
    paired = pair_summaries(
        json.loads(blobs[("baseline", "summary.json")]),
        json.loads(blobs[("candidate", "summary.json")]),
        json.loads(blobs[("baseline", "replay.json")]),
        json.loads(blobs[("candidate", "replay.json")]),
    )
    config = inp.config.model_dump(mode="json")
    evidence = evidence_and_decision(paired, config["gate"])
    outcome = outcome_for(evidence["decision"], auto_load=inp.auto_load)
    receipt = build_receipt(
        inp.run_id,
        config,
        inp.seed_start,
        policy_identity(inp.baseline_adapter),
        policy_identity(inp.candidate_adapter, adapter_content_revision=inp.candidate_adapter_sha256),
        blobs[("baseline", "summary.json")],
        blobs[("candidate", "summary.json")],
        evidence,
        outcome,
        world_model=inp.world_model,
    )
    receipt_ref = store.put_blob(pretty_json(receipt))
    return EvaluationResult(
        decision=evidence["decision"],
        outcome=outcome,
        verdict=receipt["verdict"],
        evidence=evidence,
        receipt=StoredObject.of(receipt_ref),
        baseline=inp.baseline,
        candidate=inp.candidate,
    )
