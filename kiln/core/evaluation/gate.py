"""Evidence, gate decision and outcome of the paired held-out evaluation.

Statistic ``paired_return_sign_test_v1``: each seed group contributes ONE paired observation, the
sign of ``candidate_mean − baseline_mean`` (group means over its episodes). Improved and regressed
groups enter the exact two-sided sign test; tied groups (equal means) are excluded from it — they
carry no evidence of direction — but are still counted in ``paired_groups`` (and so towards the
minimum of 20) and in the overall mean returns.

Decision, first match wins:

1. no gate → ``diagnostic``
2. ``paired_groups < minimum_paired_groups`` → ``inconclusive``
3. ``regressed > improved`` and ``p < alpha`` → ``rejected``
4. ``candidate_mean_return < min_mean_return`` (when set) → ``rejected``
5. ``mean_return_improvement < min_mean_improvement`` (default 0) → ``rejected``
6. ``improved > regressed`` and ``p < alpha`` → ``passed``
7. otherwise → ``inconclusive``

Outcome: diagnostic→diagnostic, rejected→rejected, inconclusive→inconclusive,
passed→promoted (auto_load, promotion succeeded) | error (auto_load, promotion failed) | kept
(no auto_load).
"""

from __future__ import annotations

import math
from typing import Any

from kiln.core.evaluation.pairing import PairedGroup
from kiln.core.evaluation.sign_test import exact_sign_test_p_value

STATISTIC = "paired_return_sign_test_v1"
MINIMUM_PAIRED_GROUPS = 20
ALPHA = 0.05
DECISIONS = ("diagnostic", "passed", "rejected", "inconclusive")
OUTCOMES = ("diagnostic", "promoted", "kept", "rejected", "inconclusive", "error")
# decision → the outcomes a receipt may pair it with (receipt consistency)
ALLOWED_OUTCOMES: dict[str, tuple[str, ...]] = {
    "diagnostic": ("diagnostic",),
    "passed": ("promoted", "kept", "error"),
    "rejected": ("rejected",),
    "inconclusive": ("inconclusive",),
}


def _fmt(value: float) -> str:
    return f"{value:.6g}"


def gate_thresholds(gate: Any) -> tuple[float | None, float]:
    """``(min_mean_return, min_mean_improvement)`` of a ``GateConfig``, a plain dict or ``None``."""
    if gate is None:
        return None, 0.0
    if isinstance(gate, dict):
        floor, improvement = gate.get("min_mean_return"), gate.get("min_mean_improvement")
    else:
        floor = getattr(gate, "min_mean_return", None)
        improvement = getattr(gate, "min_mean_improvement", None)
    improvement = 0.0 if improvement is None else float(improvement)
    floor = None if floor is None else float(floor)
    if (floor is not None and not math.isfinite(floor)) or not math.isfinite(improvement):
        raise ValueError("gate thresholds must be finite")
    if improvement < 0:
        raise ValueError("min_mean_improvement must be >= 0")
    return floor, improvement


def decide(
    *,
    gate: Any,
    paired_groups: int,
    improved: int,
    regressed: int,
    p_value: float,
    candidate_mean_return: float,
    mean_return_improvement: float,
    minimum_paired_groups: int = MINIMUM_PAIRED_GROUPS,
    alpha: float = ALPHA,
) -> tuple[str, str]:
    """``(decision, reason)`` by the first-match order."""
    if gate is None:
        return "diagnostic", "no gate configured: the evaluation is diagnostic only"
    floor, min_improvement = gate_thresholds(gate)
    if paired_groups < minimum_paired_groups:
        return "inconclusive", (
            f"only {paired_groups} paired seed groups; the gate needs at least {minimum_paired_groups}"
        )
    counts = f"improved {improved}, regressed {regressed}"
    if regressed > improved and p_value < alpha:
        return "rejected", (
            f"candidate regressed significantly ({counts}; sign test p = {_fmt(p_value)} < {_fmt(alpha)})"
        )
    if floor is not None and candidate_mean_return < floor:
        return "rejected", (
            f"candidate mean return {_fmt(candidate_mean_return)} is below the floor min_mean_return {_fmt(floor)}"
        )
    if mean_return_improvement < min_improvement:
        return "rejected", (
            f"mean return improvement {_fmt(mean_return_improvement)} is below "
            f"min_mean_improvement {_fmt(min_improvement)}"
        )
    if improved > regressed and p_value < alpha:
        return "passed", (f"candidate improved significantly ({counts}; sign test p = {_fmt(p_value)} < {_fmt(alpha)})")
    return "inconclusive", (f"no significant difference ({counts}; sign test p = {_fmt(p_value)} >= {_fmt(alpha)})")


def evidence_and_decision(
    paired: list[PairedGroup],
    gate: Any,
    *,
    minimum_paired_groups: int = MINIMUM_PAIRED_GROUPS,
    alpha: float = ALPHA,
    policy_version: str | None = STATISTIC,
) -> dict[str, Any]:
    """The receipt ``evidence`` object (including ``decision`` and ``reason``).

    Overall means are over all paired episodes (``math.fsum``); with no groups they are 0.0.
    ``policy_version`` names the decision policy (``paired_return_sign_test_v1``); ``None`` omits it.
    """
    improved = sum(1 for g in paired if g.sign > 0)
    regressed = sum(1 for g in paired if g.sign < 0)
    tied = len(paired) - improved - regressed
    baseline_returns: list[float] = []
    candidate_returns: list[float] = []
    for group in paired:
        b, c = group.returns()
        baseline_returns.extend(b)
        candidate_returns.extend(c)
    episodes = len(candidate_returns)
    baseline_mean = math.fsum(baseline_returns) / episodes if episodes else 0.0
    candidate_mean = math.fsum(candidate_returns) / episodes if episodes else 0.0
    improvement = candidate_mean - baseline_mean
    p_value = exact_sign_test_p_value(improved, regressed)
    decision, reason = decide(
        gate=gate,
        paired_groups=len(paired),
        improved=improved,
        regressed=regressed,
        p_value=p_value,
        candidate_mean_return=candidate_mean,
        mean_return_improvement=improvement,
        minimum_paired_groups=minimum_paired_groups,
        alpha=alpha,
    )
    evidence: dict[str, Any] = {
        "paired_groups": len(paired),
        "paired_episodes": episodes,
        "minimum_paired_groups": minimum_paired_groups,
        "baseline_mean_return": baseline_mean,
        "candidate_mean_return": candidate_mean,
        "mean_return_improvement": improvement,
        "improved_groups": improved,
        "regressed_groups": regressed,
        "tied_groups": tied,
        "exact_sign_test_p_value": p_value,
        "exact_sign_test_alpha": alpha,
        "decision": decision,
        "reason": reason,
    }
    if policy_version is not None:
        evidence["policy_version"] = policy_version
    differences = [
        {"group_index": g.group_index, "fields": list(g.reset_differences)} for g in paired if g.reset_differences
    ]
    if differences:  # only under reset_determinism: warn (kiln.core.evaluation.pairing)
        evidence["reset_differences"] = differences
    return evidence


def outcome_for(decision: str, *, auto_load: bool, promotion_ok: bool = True) -> str:
    """The evaluation outcome for a decision."""
    if decision == "diagnostic":
        return "diagnostic"
    if decision == "rejected":
        return "rejected"
    if decision == "inconclusive":
        return "inconclusive"
    if decision == "passed":
        if not auto_load:
            return "kept"
        return "promoted" if promotion_ok else "error"
    raise ValueError(f"unknown evaluation decision {decision!r}")


__all__ = [
    "ALLOWED_OUTCOMES",
    "ALPHA",
    "DECISIONS",
    "MINIMUM_PAIRED_GROUPS",
    "OUTCOMES",
    "STATISTIC",
    "decide",
    "evidence_and_decision",
    "gate_thresholds",
    "outcome_for",
]
