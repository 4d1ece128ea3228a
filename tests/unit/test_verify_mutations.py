"""Property test: no single-byte change or raw reordering of a REAL bundle passes verification.

Plain ``random`` with a fixed seed (reproducible). Every mutation must raise
``VerificationFailed`` (JSON/format errors are wrapped into it) — the only exception is a summary
byte that changes one of the settings nothing else in the bundle records
(``UNBOUND_SUMMARY_FIELDS``, e.g. ``concurrency`` 4 → 7); the test asserts such a pass changed
nothing else, so a real gap would still fail it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kiln.core.rollout.verify import UNBOUND_SUMMARY_FIELDS, VerificationFailed, verify_bundle
from tests.unit.test_verify_support import FILES, real_bundle, write_bundle

SEED = 20240611
FLIPS = 360


@pytest.fixture(scope="module")
def bundle(tiny_model_dir: Path) -> dict[str, bytes]:
    return real_bundle(tiny_model_dir)


def _changed_summary_fields(original: bytes, mutated: bytes) -> set[str]:
    a, b = json.loads(original), json.loads(mutated)
    return {key for key in set(a) | set(b) if json.dumps(a.get(key)) != json.dumps(b.get(key))}


def _outcome(folder: Path, files: dict[str, bytes]) -> VerificationFailed | None:
    write_bundle(folder, files)
    try:
        verify_bundle(folder / "summary.json")
    except VerificationFailed as exc:
        return exc
    return None


def test_random_single_byte_flips_are_detected(bundle: dict[str, bytes], tmp_path: Path) -> None:
    rng = random.Random(SEED)
    detected = 0
    unbound_passes: list[str] = []
    per_file = {name: 0 for name in FILES}
    fields: set[str] = set()
    for _ in range(FLIPS):
        name = rng.choice(FILES)
        data = bytearray(bundle[name])
        offset = rng.randrange(len(data))
        data[offset] ^= rng.randrange(1, 256)
        files = {**bundle, name: bytes(data)}
        error = _outcome(tmp_path, files)
        if error is None:
            assert name == "summary.json", f"an altered {name} byte at {offset} passed verification"
            changed = _changed_summary_fields(bundle[name], files[name])
            assert changed and changed <= set(UNBOUND_SUMMARY_FIELDS), (
                f"summary byte {offset} changed {sorted(changed)} and passed verification"
            )
            unbound_passes.append(",".join(sorted(changed)))
            continue
        assert error.code == "openenv_verification_failed"
        assert error.details["field"] != "structure", error.message  # explicit checks, no fallback
        detected += 1
        per_file[name] += 1
        fields.add(f"{error.details['file']}:{error.details['field']}")
    assert detected >= 300, (detected, unbound_passes)
    assert all(count >= 80 for count in per_file.values()), per_file
    # The flips really exercise different checks (digests, JSON syntax, canonical form, fields).
    assert {"summary:dataset_sha256", "summary:replay_sha256", "summary:json"} <= fields, fields
    print(f"flips detected={detected} unbound_passes={unbound_passes} per_file={per_file} checks={len(fields)}")
    assert len(unbound_passes) <= FLIPS // 20, unbound_passes


def _reordered(data: bytes, rng: random.Random) -> bytes:
    lines = data.splitlines(keepends=True)
    while True:
        shuffled = lines[:]
        rng.shuffle(shuffled)
        if shuffled != lines:
            return b"".join(shuffled)


@pytest.mark.parametrize(
    "name,mutate",
    [
        ("rollouts.jsonl", lambda d, r: _reordered(d, r)),
        ("rollouts.jsonl", lambda d, r: b"".join(d.splitlines(keepends=True)[:-1])),
        ("rollouts.jsonl", lambda d, r: d + d.splitlines(keepends=True)[0]),
        ("rollouts.jsonl", lambda d, r: d + b"\n"),
        ("rollouts.jsonl", lambda d, r: d[:-1]),
        ("rollouts.jsonl", lambda d, r: b""),
        ("replay.json", lambda d, r: d.replace(b"  ", b"\t", 1)),
        ("replay.json", lambda d, r: d[: len(d) // 2]),
        ("summary.json", lambda d, r: d.replace(b"  ", b"   ", 1)),
        ("summary.json", lambda d, r: d.rstrip(b"\n")),
        ("summary.json", lambda d, r: json.dumps(json.loads(d), indent=4, sort_keys=True).encode() + b"\n"),
        ("summary.json", lambda d, r: b"[]\n"),
        ("summary.json", lambda d, r: b"\xff\xfe"),
    ],
)
def test_raw_file_mutations_are_detected(name, mutate, bundle: dict[str, bytes], tmp_path: Path) -> None:
    mutated = mutate(bundle[name], random.Random(SEED))
    assert mutated != bundle[name]
    error = _outcome(tmp_path, {**bundle, name: mutated})
    assert error is not None
    assert error.code == "openenv_verification_failed"
    assert error.details["field"] != "structure", error.message


def test_unbound_settings_are_exactly_the_documented_ones(bundle: dict[str, bytes], tmp_path: Path) -> None:
    """Changing an unbound setting within its range passes (documented gap); leaving it fails."""
    summary = json.loads(bundle["summary.json"])
    from kiln.core.canonical import pretty_json

    for key, inside, outside in (
        ("concurrency", 7, 0),
        ("temperature", 0.5, -1.0),
        ("capacity_wait_seconds", 60, 0),
        ("max_recoverable_errors", 5, 65),
        ("max_action_tokens", 64, 0),  # (a value past the recorded context fails the context rule)
    ):
        assert key in UNBOUND_SUMMARY_FIELDS
        ok = _outcome(tmp_path, {**bundle, "summary.json": pretty_json({**summary, key: inside})})
        assert ok is None, ok
        bad = _outcome(tmp_path, {**bundle, "summary.json": pretty_json({**summary, key: outside})})
        assert bad is not None and bad.details["field"] == key
