"""Named adapters: the pointer ``adapters/<name>.json`` → the published adapter files in S3.

Publication writes the pointer (promotion) only after the manifest is stored; collection resolves
a behaviour adapter by name and materialises its files into a local cache keyed by content.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.artifacts.store import ObjectRef, S3Store
from kiln.canonical import canonical_json
from kiln.errors import AdapterNotFound

POINTER_SCHEMA = "kiln.adapter-pointer.v1"


def pointer_key(name: str) -> str:
    return f"adapters/{name}.json"


def write_pointer(store: S3Store, name: str, *, run_id: str, adapter_sha256: str, files: list[dict[str, Any]], manifest_uri: str) -> dict[str, Any]:
    pointer = {
        "schema": POINTER_SCHEMA,
        "name": name,
        "run_id": run_id,
        "adapter_sha256": adapter_sha256,
        "files": files,
        "manifest_uri": manifest_uri,
    }
    store.client.put_object(Bucket=store.bucket, Key=pointer_key(name), Body=canonical_json(pointer))
    return pointer


def read_pointer(store: S3Store, name: str) -> dict[str, Any]:
    raw = store.get_key(pointer_key(name))
    if raw is None:
        raise AdapterNotFound(
            f"adapter {name!r} is not published in this Kiln store",
            hint="train it first (kiln openenv train --output-adapter NAME) or use --adapter base",
        )
    return json.loads(raw)


def materialise_adapter(store: S3Store, name: str, cache_root: Path) -> Path:
    """Download adapter ``name`` into ``cache_root/<adapter_sha256 hex>`` (verified) and return it."""
    pointer = read_pointer(store, name)
    folder = cache_root / pointer["adapter_sha256"].removeprefix("sha256:")
    for item in pointer["files"]:
        target = folder / item["name"]
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            store.get_to_file(ObjectRef.from_dict(item["object"]), target)
    return folder
