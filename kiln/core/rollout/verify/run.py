"""Verify a whole downloaded run offline: its manifest, every bundle, and the on-policy chain.

A run folder is what ``kiln openenv download RUN DIR`` writes: ``manifest.json`` plus every
artifact at its manifest name. Checked, failing closed on the first violation:

1. every manifest entry's file exists with the declared size and SHA-256 (no extra bundle files);
2. every bundle (the top-level one and, for an online-RL run, each ``iterations/<k>/`` one)
   verifies as ``verify_bundle`` does;
3. the on-policy chain: iteration 1 was sampled by the run's starting policy, iteration k (k > 1)
   by exactly the adapter iteration k−1's receipt names (or, for stale data, the one ``lag``
   iterations older, as its receipt's staleness block and — ``max_staleness`` > 1 — its bundle's
   ``staleness`` record declare, in agreement with the trainer's version bound), and the top-level adapter and receipt are
   the last trained iteration's;
4. every paired held-out evaluation (``environment_eval/``, top level and per iteration): both
   side bundles, and a receipt whose evidence is what pairing those sides gives
   (``kiln.core.rollout.verify.evaluation``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.artifacts.manifest import validate_manifest
from kiln.core.canonical import file_sha256
from kiln.core.rollout.verify.checks import Where, fail
from kiln.core.rollout.verify.evaluation import verify_evaluation
from kiln.core.rollout.verify.files import parse_json, read_capped
from kiln.core.rollout.verify.load import verify_bundle

RUN_VERIFICATION_SCHEMA = "kiln.openenv-run-verification.v1"


def _check_files(folder: Path, manifest: dict[str, Any]) -> None:
    for entry in manifest["artifacts"]:
        where = Where(entry["name"])
        path = folder / entry["name"]
        if not path.is_file():
            raise fail(where, "path", "is missing from the run folder (download the run again)")
        size, digest = path.stat().st_size, file_sha256(path)
        if size != entry["bytes"] or digest != entry["sha256"]:
            raise fail(
                where,
                "sha256",
                f"is {size} bytes hashing to {digest}; the manifest declares "
                f"{entry['bytes']} bytes and {entry['sha256']}",
            )


def _json(folder: Path, name: str) -> dict[str, Any] | None:
    """A JSON object file of the run folder (size-capped, strict parser), or None when absent."""
    path = folder / name
    if not path.is_file():
        return None
    value = parse_json(read_capped(path, name), Where(name))
    if not isinstance(value, dict):
        raise fail(Where(name), "json", "is not a JSON object")
    return value


def _stale_lag(prefix: str, k: int, summary: dict[str, Any], receipt: dict[str, Any] | None) -> int:
    """Iteration ``k``'s lag: its receipt's staleness block, or — with ``max_staleness`` > 1 — its
    bundle's ``staleness`` record, which the receipt and the trainer's selection must then agree
    with (the version it names is ``k−1−lag``; data past the bound was dropped, none trained)."""
    declared = int(((receipt or {}).get("staleness") or {}).get("staleness") or 0)
    record = summary.get("staleness")
    if record is None:
        return declared
    where = Where(prefix + "summary.json")
    lag, bound = record["lag"], record["max_staleness"]
    if record["behavior_version"] != k - 1 - lag:
        raise fail(where, "staleness.behavior_version", f"must be {k - 1 - lag} (iteration {k} − 1 − lag {lag})")
    if receipt is not None and declared != lag:
        raise fail(
            Where(prefix + "train_receipt.json"), "staleness.staleness", f"is {declared}; the bundle's lag is {lag}"
        )
    stale = (summary.get("training_selection") or {}).get("stale")
    if stale is not None:
        groups = summary.get("groups")
        if stale.get("lags") != {str(lag): groups} or stale.get("max_staleness") != bound:
            raise fail(where, "training_selection.stale.lags", f"must be {{'{lag}': {groups}}} under bound {bound}")
        if stale.get("dropped_groups") != (groups if lag > bound else 0):
            raise fail(where, "training_selection.stale.dropped_groups", f"disagrees with lag {lag} and bound {bound}")
    if lag > bound and receipt is not None:
        raise fail(where, "staleness.lag", f"is {lag}, past max_staleness {bound}, yet the iteration trained")
    return lag


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
        staleness = _stale_lag(prefix, k, summary, receipt)
        if k == 1:
            after.append(sampled_by)
        elif k - 1 - staleness < 0 or sampled_by != after[k - 1 - staleness]:
            expected = after[max(0, k - 1 - staleness)]
            raise fail(
                Where(prefix + "summary.json"),
                "behavior_policy.adapter_sha256",
                f"was sampled by adapter {sampled_by}, but the on-policy chain expects {expected} "
                f"(iteration {k}, staleness {staleness})",
            )
        after.append((receipt or {}).get("adapter_sha256") or after[-1])
        rows.append({"iteration": k, "sampled_by": sampled_by, "adapter_sha256": after[-1], "staleness": staleness})
    return rows


def verify_run(folder: Path) -> dict[str, Any]:
    """Verify the run downloaded into ``folder``; return the ``kiln.openenv-run-verification.v1``
    report. Raises ``VerificationFailed`` (``openenv_verification_failed``) on the first violation."""
    folder = Path(folder)
    manifest = _json(folder, "manifest.json")
    if manifest is None:
        raise fail(
            Where("manifest.json"), "path", f"is missing in {folder} (download the run with kiln openenv download)"
        )
    try:
        validate_manifest(manifest)
    except ValueError as exc:
        raise fail(Where("manifest.json"), "json", f"is not a valid Kiln manifest: {exc}") from None
    _check_files(folder, manifest)
    names = {entry["name"] for entry in manifest["artifacts"]}
    bundles = sorted(
        name.removesuffix("summary.json")
        for name in names
        if name.endswith("summary.json") and "environment_eval/" not in name
    )
    reports = {}
    for prefix in bundles:
        report = verify_bundle(
            folder / f"{prefix}summary.json",
            dataset_path=folder / f"{prefix}rollouts.jsonl",
            replay_path=folder / f"{prefix}replay.json",
        )
        reports[prefix or "."] = {"groups": report["groups"], "rollouts": report["rollouts"]}
    evaluations = {
        name.removesuffix("receipt.json"): verify_evaluation(folder, name.removesuffix("receipt.json"))
        for name in sorted(names)
        if name.endswith("environment_eval/receipt.json")
    }
    iterations = int(manifest.get("iterations") or 1)
    chain = _check_chain(folder, iterations) if iterations > 1 else []
    if chain:
        final = _json(folder, "train_receipt.json") or {}
        if final.get("adapter_sha256") != chain[-1]["adapter_sha256"]:
            raise fail(Where("train_receipt.json"), "adapter_sha256", "is not the last trained iteration's receipt")
    return {
        "schema": RUN_VERIFICATION_SCHEMA,
        "run_id": manifest.get("run_id"),
        "artifacts": len(names),
        "bundles": reports,
        "evaluations": evaluations,
        "iterations": chain,
    }
