"""A published run as a folder on disk, as ``kiln openenv download RUN DIR`` writes it, for tests
that verify whole runs offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.artifacts.store import ObjectRef, S3Store


def artifact_bytes(store: S3Store, entry: dict[str, Any]) -> bytes:
    """One manifest entry's bytes (digest-checked by the store)."""
    return store.get_bytes(ObjectRef(uri=entry["uri"], sha256=entry["sha256"], bytes=entry["bytes"]))


def download_run(store: S3Store, run_id: str, manifest: dict[str, Any], folder: Path) -> Path:
    """manifest.json and every artifact at its manifest name under ``folder`` (created)."""
    folder.mkdir()
    (folder / "manifest.json").write_bytes(store.get_key(f"runs/{run_id}/manifest.json"))
    for entry in manifest["artifacts"]:
        path = folder / entry["name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(artifact_bytes(store, entry))
    return folder
