"""Evidence, first-match decision and outcome of the paired evaluation."""

from __future__ import annotations

import pytest

from kiln.core.training_config import GateConfig
from kiln.core.evaluation.gate import evidence_and_decision, outcome_for
from kiln.core.evaluation.pairing import EnvironmentEvaluationFailed, PairedGroup, pair_summaries
from tests.unit.test_evaluation_support import constant, paired_bundles


def _evaluate(baseline, candidate, gate, **kwargs) -> dict:
    return evidence_and_decision(pair_summaries(*paired_bundles(baseline, candidate)), gate, **kwargs)


def _groups(pairs: list[tuple[float, float]]) -> list[PairedGroup]:
    return [PairedGroup(i, 1000 + i, b, c) for i, (b, c) in enumerate(pairs)]


def test_reference_fixture_twenty_improved_promoted() -> None:
    gate = GateConfig(min_mean_return=0.5, min_mean_improvement=0.1)
    evidence = _evaluate(constant(20, 0.1), constant(20, 0.8), gate)
    assert evidence == {
        "policy_version": "paired_return_sign_test_v1",
        "paired_groups": 20,
        "paired_episodes": 20,
        "minimum_paired_groups": 20,
        "baseline_mean_return": pytest.approx(0.1, abs=1e-15),
        "candidate_mean_return": pytest.approx(0.8, abs=1e-15),
        "mean_return_improvement": pytest.approx(0.7, abs=1e-15),
        "improved_groups": 20,
        "regressed_groups": 0,
        "tied_groups": 0,
        "exact_sign_test_p_value": 1.9073486328125e-06,
        "exact_sign_test_alpha": 0.05,
        "decision": "passed",
        "reason": evidence["reason"],
    }
    assert evidence["exact_sign_test_p_value"] == 2.0**-19
    assert "improved 20, regressed 0" in evidence["reason"]
    assert outcome_for(evidence["decision"], auto_load=True) == "promoted"
    assert outcome_for(evidence["decision"], auto_load=False) == "kept"
    assert outcome_for(evidence["decision"], auto_load=True, promotion_ok=False) == "error"


def test_baseline_zero_candidate_one_passes_with_default_gate() -> None:
    evidence = _evaluate(constant(20, 0.0), constant(20, 1.0), GateConfig())
    assert evidence["decision"] == "passed"
    assert (evidence["baseline_mean_return"], evidence["candidate_mean_return"]) == (0.0, 1.0)
    assert evidence["mean_return_improvement"] == 1.0


def test_identical_returns_inconclusive() -> None:
    evidence = _evaluate(constant(20, 0.5), constant(20, 0.5), GateConfig())
    assert evidence["decision"] == "inconclusive"
    assert evidence["tied_groups"] == 20
    assert (evidence["improved_groups"], evidence["regressed_groups"]) == (0, 0)
    assert evidence["exact_sign_test_p_value"] == 1.0
    assert outcome_for("inconclusive", auto_load=True) == "inconclusive"


def test_nineteen_groups_inconclusive() -> None:
    evidence = _evaluate(constant(19, 0.0), constant(19, 1.0), GateConfig())
    assert evidence["paired_groups"] == 19
    assert evidence["exact_sign_test_p_value"] == 2.0**-18
    assert evidence["decision"] == "inconclusive"
    assert "19 paired seed groups" in evidence["reason"]


def test_twenty_episodes_in_one_seed_group_is_one_pair_inconclusive() -> None:
    evidence = _evaluate(constant(1, 0.0, size=20), constant(1, 1.0, size=20), GateConfig())
    assert evidence["paired_groups"] == 1
    assert evidence["paired_episodes"] == 20
    assert evidence["improved_groups"] == 1
    assert evidence["exact_sign_test_p_value"] == 1.0
    assert evidence["decision"] == "inconclusive"


def test_baseline_one_candidate_zero_rejected() -> None:
    evidence = _evaluate(constant(20, 1.0), constant(20, 0.0), GateConfig())
    assert evidence["regressed_groups"] == 20
    assert evidence["decision"] == "rejected"
    assert "regressed significantly" in evidence["reason"]
    assert outcome_for("rejected", auto_load=True) == "rejected"


def test_candidate_below_floor_rejected() -> None:
    evidence = _evaluate(constant(20, 1.0), constant(20, 2.0), GateConfig(min_mean_return=3.0))
    assert evidence["improved_groups"] == 20
    assert evidence["candidate_mean_return"] == 2.0
    assert evidence["decision"] == "rejected"
    assert "below the floor" in evidence["reason"]


def test_mismatched_seed_is_error_outcome() -> None:
    bs, cs, br, cr = paired_bundles(constant(20, 0.0), constant(20, 1.0))
    cr["groups"][4]["seed"] = 1
    try:
        pair_summaries(bs, cs, br, cr)
        outcome = "unreachable"
    except EnvironmentEvaluationFailed as exc:
        assert exc.code == "environment_evaluation_failed"
        outcome = "error"
    assert outcome == "error"


def test_no_gate_is_diagnostic_even_with_few_groups() -> None:
    evidence = _evaluate(constant(3, 0.0), constant(3, 1.0), None)
    assert evidence["decision"] == "diagnostic"
    assert evidence["paired_groups"] == 3
    assert outcome_for("diagnostic", auto_load=True) == "diagnostic"
    assert outcome_for("diagnostic", auto_load=False) == "diagnostic"


def test_fifteen_five_passes_fourteen_six_inconclusive() -> None:
    fifteen = _groups([(0.0, 1.0)] * 15 + [(1.0, 0.5)] * 5)
    evidence = evidence_and_decision(fifteen, GateConfig())
    assert evidence["exact_sign_test_p_value"] == 0.04138946533203125
    assert evidence["decision"] == "passed"
    fourteen = _groups([(0.0, 1.0)] * 14 + [(1.0, 0.5)] * 6)
    evidence = evidence_and_decision(fourteen, GateConfig())
    assert evidence["exact_sign_test_p_value"] == 0.11531829833984375
    assert evidence["mean_return_improvement"] > 0
    assert evidence["decision"] == "inconclusive"


def test_ties_are_excluded_from_the_sign_test_but_counted_as_groups() -> None:
    paired = _groups([(0.0, 1.0)] * 6 + [(0.5, 0.5)] * 14)
    evidence = evidence_and_decision(paired, GateConfig())
    assert (evidence["improved_groups"], evidence["regressed_groups"], evidence["tied_groups"]) == (6, 0, 14)
    assert evidence["paired_groups"] == 20
    assert evidence["exact_sign_test_p_value"] == 0.03125  # (6, 0): ties dropped
    assert evidence["decision"] == "passed"
    paired = _groups([(0.0, 1.0)] * 5 + [(0.5, 0.5)] * 15)
    evidence = evidence_and_decision(paired, GateConfig())
    assert evidence["exact_sign_test_p_value"] == 0.0625
    assert evidence["decision"] == "inconclusive"


def test_means_are_over_all_paired_episodes() -> None:
    # group sizes 2 and uneven returns: overall mean is over the 40 episodes
    baseline = [[0.0, 1.0]] * 20
    candidate = [[1.0, 1.0]] * 10 + [[0.0, 2.0]] * 10
    evidence = _evaluate(baseline, candidate, GateConfig())
    assert evidence["paired_episodes"] == 40
    assert evidence["baseline_mean_return"] == 0.5
    assert evidence["candidate_mean_return"] == 1.0
    assert (evidence["improved_groups"], evidence["regressed_groups"], evidence["tied_groups"]) == (20, 0, 0)


def test_decision_order_regression_before_floor() -> None:
    evidence = evidence_and_decision(_groups([(1.0, 0.0)] * 20), GateConfig(min_mean_return=5.0))
    assert evidence["decision"] == "rejected"
    assert "regressed significantly" in evidence["reason"]


def test_significant_gain_below_min_improvement_rejected() -> None:
    evidence = evidence_and_decision(
        _groups([(0.0, 0.05)] * 20), GateConfig(min_mean_improvement=0.1)
    )
    assert evidence["exact_sign_test_p_value"] < 0.05
    assert evidence["decision"] == "rejected"
    assert "min_mean_improvement" in evidence["reason"]


def test_insignificant_mean_drop_rejected_by_default_min_improvement() -> None:
    # 11 regressed vs 9 improved is not significant, but the mean drops below +0 improvement
    paired = _groups([(0.0, 0.1)] * 9 + [(1.0, 0.0)] * 11)
    evidence = evidence_and_decision(paired, GateConfig())
    assert evidence["exact_sign_test_p_value"] > 0.05
    assert evidence["mean_return_improvement"] < 0
    assert evidence["decision"] == "rejected"


def test_dict_gate_and_custom_minimum() -> None:
    evidence = evidence_and_decision(
        _groups([(0.0, 1.0)] * 6), {"min_mean_improvement": 0.0}, minimum_paired_groups=5
    )
    assert evidence["minimum_paired_groups"] == 5
    assert evidence["decision"] == "passed"


def test_policy_version_can_be_omitted() -> None:
    evidence = evidence_and_decision(_groups([(0.0, 1.0)]), None, policy_version=None)
    assert "policy_version" not in evidence


def test_outcome_rejects_unknown_decision() -> None:
    with pytest.raises(ValueError):
        outcome_for("maybe", auto_load=True)
