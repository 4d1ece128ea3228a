"""Artifacts: the S3 store, run manifests and the retained-byte budget.

Names are re-exported lazily so ``import kiln.core.artifacts.budget`` (pure) does not import boto3.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "ObjectRef": "kiln.core.artifacts.store",
    "S3Store": "kiln.core.artifacts.store",
    "blob_key": "kiln.core.artifacts.store",
    "MANIFEST_SCHEMA": "kiln.core.artifacts.manifest",
    "manifest_key": "kiln.core.artifacts.manifest",
    "build_manifest": "kiln.core.artifacts.manifest",
    "manifest_bytes": "kiln.core.artifacts.manifest",
    "parse_manifest": "kiln.core.artifacts.manifest",
    "validate_manifest": "kiln.core.artifacts.manifest",
    "verify_manifest_against_store": "kiln.core.artifacts.manifest",
    "RetainedBudget": "kiln.core.artifacts.budget",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - the names are _EXPORTS' keys, written once


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.core.artifacts' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
