"""The ``kiln.openenv-environment-evaluation.v1`` receipt.

Written to ``environment-evaluation/receipt.json`` with ``pretty_json`` (sorted keys, two-space
indent, trailing newline), so equal inputs give byte-identical files::

    {schema, run_id, config, seed_start, baseline, candidate,
     baseline_summary_sha256, candidate_summary_sha256,   # sha256 of the summary.json FILE bytes
     evidence{...}, outcome, verdict, world_model?}

``baseline`` / ``candidate`` are policy identities ``{adapter? (absent = base model),
adapter_content_revision?, execution_provenance_sha256?}`` (see :func:`policy_identity`).

``world_model`` ("beyond the reference", optional): base vs candidate observation cross-entropy on
the evaluation transcripts (:func:`world_model_block`); ``world_model_gain = base − candidate``
(positive: the trained adapter predicts the environment's observations better).

:func:`validate_receipt` enforces the shape and the consistency rules: decision diagnostic ⇒
outcome diagnostic; passed ⇒ promoted | kept | error; rejected ⇒ rejected; inconclusive ⇒
inconclusive; the p-value, counts, means and decision must be the ones the evidence implies.
"""

from __future__ import annotations

import math
from typing import Any

from kiln.core.canonical import is_digest, pretty_json, sha256_bytes
from kiln.core.evaluation.gate import (
    ALLOWED_OUTCOMES,
    DECISIONS,
    OUTCOMES,
    STATISTIC,
    decide,
    gate_thresholds,
)
from kiln.core.errors import EvaluationReceiptInvalid
from kiln.core.evaluation.sign_test import exact_sign_test_p_value

RECEIPT_SCHEMA = "kiln.openenv-environment-evaluation.v1"
WORLD_MODEL_METRIC = "observation_cross_entropy_v1"
POLICY_FIELDS = ("adapter", "adapter_content_revision", "execution_provenance_sha256")
REQUIRED_FIELDS = (
    "schema",
    "run_id",
    "config",
    "seed_start",
    "baseline",
    "candidate",
    "baseline_summary_sha256",
    "candidate_summary_sha256",
    "evidence",
    "outcome",
    "verdict",
)
OPTIONAL_FIELDS = ("world_model",)
EVIDENCE_INTS = (
    "paired_groups",
    "paired_episodes",
    "minimum_paired_groups",
    "improved_groups",
    "regressed_groups",
    "tied_groups",
)
EVIDENCE_FLOATS = (
    "baseline_mean_return",
    "candidate_mean_return",
    "mean_return_improvement",
    "exact_sign_test_p_value",
    "exact_sign_test_alpha",
)


def _invalid(message: str, field: str) -> EvaluationReceiptInvalid:
    return EvaluationReceiptInvalid(f"invalid {RECEIPT_SCHEMA} receipt: {message}", details={"field": field})


# ---------------------------------------------------------------------------------------- build
def policy_identity(
    adapter: str | None = None,
    *,
    adapter_content_revision: str | None = None,
    execution_provenance_sha256: str | None = None,
) -> dict[str, str]:
    """A policy identity with absent fields omitted (``adapter`` None or ``"base"`` = base model)."""
    out: dict[str, str] = {}
    if adapter is not None and adapter != "base":
        out["adapter"] = adapter
    if adapter_content_revision is not None:
        out["adapter_content_revision"] = adapter_content_revision
    if execution_provenance_sha256 is not None:
        out["execution_provenance_sha256"] = execution_provenance_sha256
    return out


def world_model_block(
    base: dict[str, Any], candidate: dict[str, Any], *, transcripts: str = "candidate"
) -> dict[str, Any]:
    """Combine two ``kiln.core.train.world_model.observation_cross_entropy`` results (same transcripts).

    ``transcripts`` names whose evaluation rollouts were scored (``baseline`` | ``candidate`` |
    ``both``). ``world_model_gain`` is ``None`` when there were no observation tokens to score.
    """
    if base.get("env_tokens") != candidate.get("env_tokens") or base.get("sequences") != candidate.get("sequences"):
        raise ValueError("base and candidate cross-entropy were not computed on the same tokens")
    base_ce, cand_ce = base.get("mean_env_ce"), candidate.get("mean_env_ce")
    gain = None if base_ce is None or cand_ce is None else float(base_ce) - float(cand_ce)
    return {
        "metric": WORLD_MODEL_METRIC,
        "transcripts": transcripts,
        "env_tokens": int(base["env_tokens"]),
        "sequences": int(base["sequences"]),
        "base_mean_env_ce": base_ce,
        "candidate_mean_env_ce": cand_ce,
        "world_model_gain": gain,
    }


def _config_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json", by_alias=True)
    if isinstance(config, dict):
        return dict(config)
    raise TypeError("config must be an EnvironmentEvalConfig or a dict")


# The verdict sentence of each evaluation outcome; ``{reason}`` is the gate's, ``{means}`` the returns.
_VERDICTS = {
    "diagnostic": "Diagnostic evaluation (no gate): {means}.",
    "promoted": "Promoted: the trained adapter passed the gate and is now served; {reason}; {means}.",
    "kept": "Passed the gate; auto_load is off, so the trained adapter is kept but not served; {reason}; {means}.",
    "rejected": "Rejected: {reason}; {means}.",
    "inconclusive": "Inconclusive, the trained adapter stays unserved: {reason}; {means}.",
    "error": "Error: the trained adapter passed the gate but could not be promoted; {means}.",
}


def verdict_for(evidence: dict[str, Any], outcome: str) -> str:
    """One human sentence for the status page and the CLI."""
    template = _VERDICTS.get(outcome)
    if template is None:
        raise ValueError(f"unknown evaluation outcome {outcome!r}")
    means = (
        f"mean return {evidence['baseline_mean_return']:.6g} -> "
        f"{evidence['candidate_mean_return']:.6g} over {evidence['paired_groups']} paired seed groups"
    )
    return template.format(reason=evidence["reason"], means=means)


def build_receipt(
    run_id: str,
    config: Any,
    seed_start: int,
    baseline_policy: dict[str, Any],
    candidate_policy: dict[str, Any],
    baseline_summary_bytes: bytes,
    candidate_summary_bytes: bytes,
    evidence: dict[str, Any],
    outcome: str,
    world_model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble and validate the receipt; the summary digests are over the summary file bytes."""
    receipt: dict[str, Any] = {
        "schema": RECEIPT_SCHEMA,
        "run_id": run_id,
        "config": _config_dict(config),
        "seed_start": seed_start,
        "baseline": dict(baseline_policy),
        "candidate": dict(candidate_policy),
        "baseline_summary_sha256": sha256_bytes(bytes(baseline_summary_bytes)),
        "candidate_summary_sha256": sha256_bytes(bytes(candidate_summary_bytes)),
        "evidence": dict(evidence),
        "outcome": outcome,
        "verdict": verdict_for(evidence, outcome),
    }
    if world_model is not None:
        receipt["world_model"] = dict(world_model)
    validate_receipt(receipt)
    return receipt


def receipt_bytes(receipt: dict[str, Any]) -> bytes:
    """Validate, then serialise byte-stably (``pretty_json``)."""
    validate_receipt(receipt)
    return pretty_json(receipt)


# ------------------------------------------------------------------------------------- validate
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_policy(policy: Any, field: str) -> None:
    if not isinstance(policy, dict):
        raise _invalid(f"{field} must be an object", field)
    unknown = sorted(set(policy) - set(POLICY_FIELDS))
    if unknown:
        raise _invalid(f"{field} has unknown fields {unknown}", field)
    adapter = policy.get("adapter")
    if "adapter" in policy and (not isinstance(adapter, str) or not adapter or adapter == "base"):
        raise _invalid(f"{field}.adapter must be a non-empty adapter name (omit it for base)", field)
    for name in ("adapter_content_revision", "execution_provenance_sha256"):
        if name in policy and not is_digest(policy[name]):
            raise _invalid(f"{field}.{name} must be sha256:<64 hex>", f"{field}.{name}")


def _check_reset_differences(value: Any) -> None:
    """``[{group_index, fields: [dotted path, ...]}, ...]``: the held-out groups whose two sides saw
    different resets (``reset_determinism: warn``); present only when some did."""
    where = "evidence.reset_differences"
    if not isinstance(value, list) or not value:
        raise _invalid(f"{where} must be a non-empty list when present", where)
    for item in value:
        if (
            not isinstance(item, dict)
            or set(item) != {"group_index", "fields"}
            or not _is_int(item["group_index"])
            or not isinstance(item["fields"], list)
            or not item["fields"]
            or not all(isinstance(f, str) and f for f in item["fields"])
        ):
            raise _invalid(f"{where} entries must be {{group_index: int, fields: [non-empty strings]}}", where)


def _check_evidence(evidence: Any, config: dict[str, Any]) -> None:
    if not isinstance(evidence, dict):
        raise _invalid("evidence must be an object", "evidence")
    known = set(EVIDENCE_INTS) | set(EVIDENCE_FLOATS) | {"decision", "reason", "policy_version", "reset_differences"}
    for name in (*EVIDENCE_INTS, *EVIDENCE_FLOATS, "decision", "reason"):
        if name not in evidence:
            raise _invalid(f"evidence.{name} is missing", f"evidence.{name}")
    unknown = sorted(set(evidence) - known)
    if unknown:
        raise _invalid(f"evidence has unknown fields {unknown}", "evidence")
    if "policy_version" in evidence and evidence["policy_version"] != STATISTIC:
        raise _invalid(f"evidence.policy_version must be {STATISTIC}", "evidence.policy_version")
    if "reset_differences" in evidence:
        _check_reset_differences(evidence["reset_differences"])
    for name in EVIDENCE_INTS:
        if not _is_int(evidence[name]) or evidence[name] < 0:
            raise _invalid(f"evidence.{name} must be a non-negative integer", f"evidence.{name}")
    for name in EVIDENCE_FLOATS:
        if not _is_number(evidence[name]):
            raise _invalid(f"evidence.{name} must be a finite number", f"evidence.{name}")
    if evidence["decision"] not in DECISIONS:
        raise _invalid(f"evidence.decision must be one of {list(DECISIONS)}", "evidence.decision")
    if not isinstance(evidence["reason"], str) or not evidence["reason"]:
        raise _invalid("evidence.reason must be a non-empty string", "evidence.reason")

    groups = evidence["paired_groups"]
    improved, regressed = evidence["improved_groups"], evidence["regressed_groups"]
    if improved + regressed + evidence["tied_groups"] != groups:
        raise _invalid("improved + regressed + tied groups must equal paired_groups", "evidence")
    if evidence["paired_episodes"] < groups:
        raise _invalid("paired_episodes cannot be fewer than paired_groups", "evidence")
    p_value = exact_sign_test_p_value(improved, regressed)
    if evidence["exact_sign_test_p_value"] != p_value:
        raise _invalid(
            f"exact_sign_test_p_value must be {p_value!r} for ({improved}, {regressed})",
            "evidence.exact_sign_test_p_value",
        )
    alpha = evidence["exact_sign_test_alpha"]
    if not 0 < alpha < 1:
        raise _invalid("exact_sign_test_alpha must lie in (0, 1)", "evidence.exact_sign_test_alpha")
    improvement = evidence["candidate_mean_return"] - evidence["baseline_mean_return"]
    if not math.isclose(evidence["mean_return_improvement"], improvement, rel_tol=1e-12, abs_tol=1e-12):
        raise _invalid(
            "mean_return_improvement must be candidate_mean_return - baseline_mean_return",
            "evidence.mean_return_improvement",
        )
    gate = config.get("gate")
    try:
        gate_thresholds(gate)
    except (ValueError, TypeError) as exc:
        raise _invalid(f"config.gate: {exc}", "config.gate") from exc
    expected, _reason = decide(
        gate=gate,
        paired_groups=groups,
        improved=improved,
        regressed=regressed,
        p_value=p_value,
        candidate_mean_return=evidence["candidate_mean_return"],
        mean_return_improvement=evidence["mean_return_improvement"],
        minimum_paired_groups=evidence["minimum_paired_groups"],
        alpha=alpha,
    )
    if evidence["decision"] != expected:
        raise _invalid(
            f"evidence.decision {evidence['decision']!r} contradicts the evidence and gate (expected {expected!r})",
            "evidence.decision",
        )


def _check_world_model(block: Any) -> None:
    if not isinstance(block, dict):
        raise _invalid("world_model must be an object", "world_model")
    for name, value in block.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise _invalid(f"world_model.{name} must be finite", f"world_model.{name}")
    for name in ("env_tokens", "sequences"):
        if name in block and (not _is_int(block[name]) or block[name] < 0):
            raise _invalid(f"world_model.{name} must be a non-negative integer", f"world_model.{name}")


def validate_receipt(receipt: Any) -> None:
    """Raise ``EvaluationReceiptInvalid`` unless ``receipt`` is a well-formed, consistent v1 receipt."""
    if not isinstance(receipt, dict):
        raise _invalid("receipt must be an object", "receipt")
    for name in REQUIRED_FIELDS:
        if name not in receipt:
            raise _invalid(f"{name} is missing", name)
    unknown = sorted(set(receipt) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise _invalid(f"unknown fields {unknown}", "receipt")
    if receipt["schema"] != RECEIPT_SCHEMA:
        raise _invalid(f"schema must be {RECEIPT_SCHEMA}", "schema")
    if not isinstance(receipt["run_id"], str) or not receipt["run_id"]:
        raise _invalid("run_id must be a non-empty string", "run_id")
    config = receipt["config"]
    if not isinstance(config, dict):
        raise _invalid("config must be an object", "config")
    if not _is_int(receipt["seed_start"]) or receipt["seed_start"] < 0:
        raise _invalid("seed_start must be a non-negative integer", "seed_start")
    _check_policy(receipt["baseline"], "baseline")
    _check_policy(receipt["candidate"], "candidate")
    if "adapter" not in receipt["candidate"]:
        raise _invalid("candidate must name the trained (output) adapter", "candidate.adapter")
    if receipt["baseline"].get("adapter") == receipt["candidate"]["adapter"]:
        raise _invalid("baseline and candidate adapters must differ", "candidate.adapter")
    for name in ("baseline_summary_sha256", "candidate_summary_sha256"):
        if not is_digest(receipt[name]):
            raise _invalid(f"{name} must be sha256:<64 lowercase hex>", name)
    _check_evidence(receipt["evidence"], config)
    outcome = receipt["outcome"]
    if outcome not in OUTCOMES:
        raise _invalid(f"outcome must be one of {list(OUTCOMES)}", "outcome")
    decision = receipt["evidence"]["decision"]
    if outcome not in ALLOWED_OUTCOMES[decision]:
        raise _invalid(
            f"outcome {outcome!r} is inconsistent with decision {decision!r} "
            f"(allowed: {list(ALLOWED_OUTCOMES[decision])})",
            "outcome",
        )
    if not isinstance(receipt["verdict"], str) or not receipt["verdict"].strip():
        raise _invalid("verdict must be a non-empty sentence", "verdict")
    if "world_model" in receipt:
        _check_world_model(receipt["world_model"])


__all__ = [
    "EvaluationReceiptInvalid",
    "RECEIPT_SCHEMA",
    "WORLD_MODEL_METRIC",
    "build_receipt",
    "policy_identity",
    "receipt_bytes",
    "validate_receipt",
    "verdict_for",
    "world_model_block",
]
