"""Content digests of model and adapter directories (pure, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.canonical import is_digest
from kiln.core.errors import KilnError
from kiln.core.policy.identity import adapter_content_sha256, model_content_sha256


def _make_model_dir(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_bytes(b'{"a": 1}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 10)
    (root / "sub" / "extra.txt").write_bytes(b"x")
    return root


def test_model_digest_stable_and_well_formed(tmp_path: Path) -> None:
    a = _make_model_dir(tmp_path / "a")
    b = _make_model_dir(tmp_path / "b")
    assert is_digest(model_content_sha256(a))
    assert model_content_sha256(a) == model_content_sha256(a) == model_content_sha256(b)


def test_model_digest_changes_with_one_byte(tmp_path: Path) -> None:
    a = _make_model_dir(tmp_path / "a")
    before = model_content_sha256(a)
    raw = bytearray((a / "model.safetensors").read_bytes())
    raw[100] ^= 1
    (a / "model.safetensors").write_bytes(bytes(raw))
    assert model_content_sha256(a) != before


def test_model_digest_sees_paths_ignores_hidden(tmp_path: Path) -> None:
    a = _make_model_dir(tmp_path / "a")
    before = model_content_sha256(a)
    (a / ".cache").mkdir()
    (a / ".cache" / "lock").write_bytes(b"1")
    (a / ".DS_Store").write_bytes(b"1")
    assert model_content_sha256(a) == before
    (a / "sub" / "extra.txt").rename(a / "sub" / "renamed.txt")
    assert model_content_sha256(a) != before


def test_model_digest_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(KilnError) as missing:
        model_content_sha256(tmp_path / "nope")
    assert missing.value.code == "model_not_found"


def test_adapter_digest(tmp_path: Path) -> None:
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_bytes(b"{}")
    (d / "adapter_model.safetensors").write_bytes(b"weights")
    first = adapter_content_sha256(d)
    assert is_digest(first)
    (d / "README.md").write_bytes(b"ignored")
    assert adapter_content_sha256(d) == first
    (d / "adapter_model.safetensors").write_bytes(b"weightz")
    assert adapter_content_sha256(d) != first
    (d / "adapter_config.json").unlink()
    with pytest.raises(KilnError) as missing:
        adapter_content_sha256(d)
    assert missing.value.code == "adapter_not_found"


def test_identity_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kiln.core.policy, kiln.core.policy.identity; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
