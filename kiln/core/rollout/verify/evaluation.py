"""Verify a run's paired held-out evaluation offline: its two side bundles and its receipt.

An evaluation lives under ``environment_eval/`` (``baseline/`` and ``candidate/``, each a rollout
bundle, plus ``receipt.json``); an online-RL run has one per evaluated iteration as well. Checked,
failing closed on the first violation:

1. each side verifies as a bundle (``load_bundle``, whose parsed files the pairing then uses);
2. the receipt has the ``kiln.openenv-environment-evaluation.v1`` shape and consistency rules
   (``validate_receipt``);
3. the receipt's ``baseline_summary_sha256`` / ``candidate_summary_sha256`` are those side files;
4. the receipt's ``evidence`` is exactly what pairing the two sides and applying the receipt's own
   gate gives (``pair_summaries`` and ``evidence_and_decision``, the code the run used).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.canonical import canonical_json, file_sha256
from kiln.core.evaluation.gate import evidence_and_decision
from kiln.core.errors import EnvironmentEvaluationFailed
from kiln.core.evaluation.pairing import pair_summaries
from kiln.core.evaluation.receipt import validate_receipt
from kiln.core.rollout.verify.checks import Where, fail
from kiln.core.rollout.verify.files import parse_json, read_capped
from kiln.core.rollout.verify.load import load_bundle

SIDES = ("baseline", "candidate")


def verify_evaluation(folder: Path, prefix: str) -> dict[str, Any]:
    """Verify the evaluation under ``folder / prefix`` (``prefix`` ends with ``environment_eval/``);
    return ``{decision, outcome, paired_groups}``. Raises ``VerificationFailed``."""
    receipt_name = prefix + "receipt.json"
    sides = {
        side: load_bundle(
            folder / f"{prefix}{side}/summary.json",
            dataset_path=folder / f"{prefix}{side}/rollouts.jsonl",
            replay_path=folder / f"{prefix}{side}/replay.json",
        )
        for side in SIDES
    }
    receipt = parse_json(read_capped(folder / receipt_name, receipt_name), Where(receipt_name))
    try:
        validate_receipt(receipt)
    except EnvironmentEvaluationFailed as exc:
        field = (exc.details or {}).get("field") or "receipt"
        raise fail(Where(receipt_name), str(field), exc.message) from None
    for side in SIDES:
        digest = file_sha256(sides[side].summary_path)
        if receipt[f"{side}_summary_sha256"] != digest:
            raise fail(
                Where(receipt_name),
                f"{side}_summary_sha256",
                f"names {receipt[f'{side}_summary_sha256']}, but {prefix}{side}/summary.json hashes to {digest}",
            )
    try:
        paired = pair_summaries(
            sides["baseline"].summary, sides["candidate"].summary, sides["baseline"].replay, sides["candidate"].replay
        )
    except EnvironmentEvaluationFailed as exc:
        raise fail(Where(receipt_name), "evidence", f"its two sides do not pair: {exc.message}") from None
    evidence = receipt["evidence"]
    expected = evidence_and_decision(
        paired,
        receipt["config"].get("gate"),
        minimum_paired_groups=evidence["minimum_paired_groups"],
        alpha=evidence["exact_sign_test_alpha"],
        policy_version=evidence.get("policy_version"),
    )
    if canonical_json(expected) != canonical_json(evidence):
        changed = sorted(
            k
            for k in set(expected) | set(evidence)
            if canonical_json(expected.get(k)) != canonical_json(evidence.get(k))
        )
        key = changed[0] if changed else "evidence"
        raise fail(
            Where(receipt_name),
            f"evidence.{key}",
            f"is {evidence.get(key)!r}, but pairing the two sides gives {expected.get(key)!r}",
        )
    return {"decision": evidence["decision"], "outcome": receipt["outcome"], "paired_groups": evidence["paired_groups"]}
