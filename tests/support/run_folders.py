"""A published run as a folder on disk, as ``kiln openenv download RUN DIR`` writes it, for tests
that verify whole runs offline."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

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


def rewrite_artifact(folder: Path, name: str, change: Callable[[Any], Any]) -> None:
    """Change one downloaded JSON file of a run folder and fix its manifest entry's digest and size
    (a tampering a verifier must catch by what the file says, not by its digest)."""
    data = (json.dumps(change(json.loads((folder / name).read_bytes())), indent=2, sort_keys=True) + "\n").encode()
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_bytes())
    for entry in manifest["artifacts"]:
        if entry["name"] == name:
            entry.update(bytes=len(data), sha256="sha256:" + hashlib.sha256(data).hexdigest())
    (folder / "manifest.json").write_bytes(json.dumps(manifest).encode())
