"""Content digests of model and adapter directories (pure: no torch).

``model_content_sha256``: ``digest_json`` of the sorted list of ``[relative_posix_path,
sha256_of_file_bytes]`` over every regular file below the directory, skipping only hidden entries
(any path component starting with ``.``). Renaming, adding, removing or changing a byte of any file
changes the digest; modification times and directory order do not.

``adapter_content_sha256``: the same construction over exactly ``adapter_config.json`` and
``adapter_model.safetensors`` (the two files PEFT needs to load a LoRA adapter).
"""

from __future__ import annotations

from pathlib import Path

from kiln.canonical import DIGEST_PREFIX, digest_json

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, read in chunks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return DIGEST_PREFIX + h.hexdigest()


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def model_content_sha256(model_dir: Path) -> str:
    """Digest over the sorted relative paths and byte digests of all non-hidden files."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory not found: {root}")
    entries = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if _is_hidden(rel) or not path.is_file():
            continue
        entries.append([rel.as_posix(), file_sha256(path)])
    entries.sort()
    return digest_json({"files": entries})


def adapter_content_sha256(adapter_dir: Path) -> str:
    """Digest over ``adapter_config.json`` and ``adapter_model.safetensors`` of ``adapter_dir``."""
    root = Path(adapter_dir)
    entries = []
    for name in ADAPTER_FILES:
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"adapter file missing: {path}")
        entries.append([name, file_sha256(path)])
    return digest_json({"files": entries})


__all__ = ["adapter_content_sha256", "file_sha256", "model_content_sha256"]
