"""Named adapters: the pointer ``adapters/<name>.json`` → the published adapter files in S3.

A run resolves a behaviour adapter's name ONCE (``resolve_policy``) into an ``AdapterRef`` pinned by
content, so a later promotion of the same name cannot change a running run's policy. Publication
writes the pointer (promotion) only after the manifest is stored and only when the gate allows it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import canonical_json
from kiln.core.errors import AdapterNotFound
from kiln.core.records import AdapterFile, AdapterRef

POINTER_SCHEMA = "kiln.adapter-pointer.v1"


def pointer_key(name: str) -> str:
    return f"adapters/{name}.json"


def write_pointer(store: S3Store, ref: AdapterRef, *, run_id: str, manifest_uri: str) -> dict[str, Any]:
    """Point ``ref.name`` at ``ref`` (promotion). Plain overwrite: the newest promotion wins."""
    pointer = {
        "schema": POINTER_SCHEMA,
        "run_id": run_id,
        "manifest_uri": manifest_uri,
        "adapter": ref.model_dump(),
    }
    store.put_key(pointer_key(ref.name), canonical_json(pointer), action="promote adapter")
    return pointer


def read_pointer(store: S3Store, name: str) -> AdapterRef:
    raw = store.get_key(pointer_key(name))
    if raw is None:
        raise AdapterNotFound(
            f"adapter {name!r} is not published in this Kiln store",
            hint="train it first (kiln openenv train --output-adapter NAME) or use --adapter base",
        )
    return AdapterRef.model_validate(json.loads(raw)["adapter"])


def materialise(store: S3Store, ref: AdapterRef, cache_root: Path) -> Path:
    """Download ``ref``'s files into ``cache_root/<sha256 hex>`` (verified, atomic) and return it."""
    folder = cache_root / ref.adapter_sha256.removeprefix("sha256:")
    for item in ref.files:
        target = folder / item.name
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            obj = item.object
            store.get_to_file(obj.ref(), target)
    return folder


def adapter_ref_from_files(name: str, adapter_sha256: str, files: list[AdapterFile]) -> AdapterRef:
    return AdapterRef(name=name, adapter_sha256=adapter_sha256, files=list(files))
