"""Verify a whole downloaded run offline: its manifest, every bundle, and the on-policy chain.

A run folder is what ``kiln openenv download RUN DIR`` writes: ``manifest.json`` plus every
artifact at its manifest name. Checked, failing closed on the first violation:

1. every manifest entry's file exists with the declared size and SHA-256 (no extra bundle files);
2. every bundle (the top-level one and, for an online-RL run, each ``iterations/<k>/`` one)
   verifies as ``verify_bundle`` does;
3. the on-policy chain: iteration 1 was sampled by the run's starting policy, iteration k (k > 1)
   by exactly the adapter iteration k−1's receipt names (or, for a stale batch, one iteration
   older, as its receipt's staleness block declares), and the top-level adapter and receipt are
   the last trained iteration's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kiln.rollout.verify.checks import VerificationFailed
from kiln.rollout.verify.load import verify_bundle

RUN_VERIFICATION_SCHEMA = "kiln.openenv-run-verification.v1"


def _fail(file: str, reason: str) -> VerificationFailed:
    return VerificationFailed(f"{file}: {reason}", details={"file": file})


def _check_files(folder: Path, manifest: dict[str, Any]) -> None:
    for entry in manifest.get("artifacts", []):
        path = folder / entry["name"]
        if not path.is_file():
            raise _fail(entry["name"], "is missing from the run folder (download the run again)")
        data = path.read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if len(data) != entry["bytes"] or digest != entry["sha256"]:
            raise _fail(entry["name"], f"is {len(data)} bytes hashing to {digest}; the manifest declares "
                        f"{entry['bytes']} bytes and {entry['sha256']}")


def _json(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    return json.loads(path.read_bytes()) if path.is_file() else None


def _check_chain(folder: Path, iterations: int) -> list[dict[str, Any]]:
    """Iteration k's sampler against the adapters earlier iterations produced.

    ``after[j]`` is the policy after iteration j (``after[0]``: the starting policy, as iteration
    1 records it); iteration k with staleness s must have been sampled by ``after[k−1−s]``."""
    after: list[str | None] = []
    rows: list[dict[str, Any]] = []
    for k in range(1, iterations + 1):
        prefix = f"iterations/{k:06d}/"
        summary = _json(folder, prefix + "summary.json") or {}
        receipt = _json(folder, prefix + "train_receipt.json")
        sampled_by = (summary.get("behavior_policy") or {}).get("adapter_sha256")
        staleness = int(((receipt or {}).get("staleness") or {}).get("staleness") or 0)
        if k == 1:
            after.append(sampled_by)
        elif k - 1 - staleness < 0 or sampled_by != after[k - 1 - staleness]:
            expected = after[max(0, k - 1 - staleness)]
            raise _fail(prefix + "summary.json", f"was sampled by adapter {sampled_by}, but the on-policy chain "
                        f"expects {expected} (iteration {k}, staleness {staleness})")
        after.append((receipt or {}).get("adapter_sha256") or after[-1])
        rows.append({"iteration": k, "sampled_by": sampled_by, "adapter_sha256": after[-1], "staleness": staleness})
    return rows


def verify_run(folder: Path) -> dict[str, Any]:
    """Verify the run downloaded into ``folder``; return the ``kiln.openenv-run-verification.v1``
    report. Raises ``VerificationFailed`` (``openenv_verification_failed``) on the first violation."""
    folder = Path(folder)
    manifest = _json(folder, "manifest.json")
    if manifest is None:
        raise _fail("manifest.json", f"is missing in {folder} (download the run with kiln openenv download)")
    _check_files(folder, manifest)
    names = {entry["name"] for entry in manifest["artifacts"]}
    bundles = sorted(name.removesuffix("summary.json") for name in names
                     if name.endswith("summary.json") and "environment_eval/" not in name)
    reports = {}
    for prefix in bundles:
        report = verify_bundle(folder / f"{prefix}summary.json", dataset_path=folder / f"{prefix}rollouts.jsonl",
                               replay_path=folder / f"{prefix}replay.json")
        reports[prefix or "."] = {"groups": report["groups"], "rollouts": report["rollouts"]}
    iterations = int(manifest.get("iterations") or 1)
    chain = _check_chain(folder, iterations) if iterations > 1 else []
    if chain:
        final = _json(folder, "train_receipt.json") or {}
        if final.get("adapter_sha256") != chain[-1]["adapter_sha256"]:
            raise _fail("train_receipt.json", "is not the last trained iteration's receipt")
    return {
        "schema": RUN_VERIFICATION_SCHEMA,
        "run_id": manifest.get("run_id"),
        "artifacts": len(names),
        "bundles": reports,
        "iterations": chain,
    }
