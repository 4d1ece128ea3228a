"""A training's group selection (``kiln.core.train.selection``) by reference: whole in S3, brief in payloads.

The selection has one warning per skipped group, so with thousands of groups it outgrows a
workflow payload. The trainer stores it whole (``store_selection``); ``TrainResult.selection``
keeps its counts and the first ``MAX_BRIEF_WARNINGS`` warnings (for status), and the bundles that
record it (``summary.json``'s ``training_selection``) read it back whole (``full_selection``).
"""

from __future__ import annotations

import json
from typing import Any

from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import pretty_json
from kiln.core.records import StoredObject, TrainResult

MAX_BRIEF_WARNINGS = 20


def brief_selection(selection: dict[str, Any]) -> dict[str, Any]:
    """``selection`` with at most ``MAX_BRIEF_WARNINGS`` warnings (the counts say how many groups)."""
    warnings = selection.get("warnings", [])
    if len(warnings) <= MAX_BRIEF_WARNINGS:
        return selection
    return {**selection, "warnings": warnings[:MAX_BRIEF_WARNINGS]}


def store_selection(store: S3Store, selection: dict[str, Any]) -> StoredObject:
    return StoredObject.of(store.put_blob(pretty_json(selection)))


def full_selection(store: S3Store, training: TrainResult | None) -> dict[str, Any] | None:
    """The whole selection ``training`` was made from (its brief when it names no stored one)."""
    if training is None:
        return None
    if training.selection_ref is None:
        return training.selection
    return json.loads(store.get_bytes(training.selection_ref.ref()))
