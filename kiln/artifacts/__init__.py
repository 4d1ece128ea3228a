"""Artifacts: the S3 store, run manifests and the retained-byte budget.

Names are re-exported lazily so ``import kiln.artifacts.budget`` (pure) does not import boto3.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "ObjectRef": "kiln.artifacts.store",
    "S3Store": "kiln.artifacts.store",
    "blob_key": "kiln.artifacts.store",
    "MANIFEST_SCHEMA": "kiln.artifacts.manifest",
    "manifest_key": "kiln.artifacts.manifest",
    "build_manifest": "kiln.artifacts.manifest",
    "manifest_bytes": "kiln.artifacts.manifest",
    "parse_manifest": "kiln.artifacts.manifest",
    "validate_manifest": "kiln.artifacts.manifest",
    "verify_manifest_against_store": "kiln.artifacts.manifest",
    "RetainedBudget": "kiln.artifacts.budget",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - the names are _EXPORTS' keys, written once


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.artifacts' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
