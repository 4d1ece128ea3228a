"""``kiln.openenv-environment-evaluation.v1`` receipt: build, byte stability, consistency."""

from __future__ import annotations

import copy
import json

import pytest

from kiln.core.canonical import pretty_json, sha256_bytes
from kiln.core.training_config import EnvironmentEvalConfig, GateConfig
from kiln.core.evaluation.gate import evidence_and_decision, outcome_for
from kiln.core.evaluation.pairing import PairedGroup
from kiln.core.evaluation.receipt import (
    RECEIPT_SCHEMA,
    EvaluationReceiptInvalid,
    build_receipt,
    policy_identity,
    receipt_bytes,
    validate_receipt,
    verdict_for,
    world_model_block,
)

BASELINE_SUMMARY = b'{"schema": "kiln.openenv-rollout-summary.v5", "side": "baseline"}\n'
CANDIDATE_SUMMARY = b'{"schema": "kiln.openenv-rollout-summary.v5", "side": "candidate"}\n'
REVISION = "sha256:" + "c" * 64


def _paired(pairs):
    return [PairedGroup(i, 1020 + i, b, c) for i, (b, c) in enumerate(pairs)]


def _receipt(pairs=None, *, gate=None, outcome=None, auto_load=True, world_model=None) -> dict:
    config = EnvironmentEvalConfig(
        gate=gate if gate is not None else GateConfig(min_mean_return=0.5, min_mean_improvement=0.1)
    )
    evidence = evidence_and_decision(_paired(pairs or [(0.1, 0.8)] * 20), config.gate)
    return build_receipt(
        "run-17",
        config,
        1020,
        policy_identity(None),
        policy_identity("run-17-lora", adapter_content_revision=REVISION),
        BASELINE_SUMMARY,
        CANDIDATE_SUMMARY,
        evidence,
        outcome or outcome_for(evidence["decision"], auto_load=auto_load),
        world_model,
    )


def test_reference_fixture_receipt() -> None:
    receipt = _receipt()
    assert receipt["schema"] == RECEIPT_SCHEMA
    assert receipt["outcome"] == "promoted"
    assert receipt["evidence"]["decision"] == "passed"
    assert receipt["evidence"]["exact_sign_test_p_value"] == 1.9073486328125e-06
    assert receipt["baseline"] == {}
    assert receipt["candidate"] == {"adapter": "run-17-lora", "adapter_content_revision": REVISION}
    assert receipt["baseline_summary_sha256"] == sha256_bytes(BASELINE_SUMMARY)
    assert receipt["candidate_summary_sha256"] == sha256_bytes(CANDIDATE_SUMMARY)
    assert receipt["config"] == {
        "groups": 20,
        "group_size": 1,
        "seed_start": None,
        "gate": {"min_mean_return": 0.5, "min_mean_improvement": 0.1},
    }
    assert receipt["verdict"].startswith("Promoted:")
    assert "world_model" not in receipt


def test_bytes_are_stable_and_round_trip() -> None:
    first, second = receipt_bytes(_receipt()), receipt_bytes(_receipt())
    assert first == second
    assert first.endswith(b"}\n")
    reloaded = json.loads(first)
    validate_receipt(reloaded)
    assert pretty_json(reloaded) == first


@pytest.mark.parametrize(
    ("pairs", "gate", "auto_load", "outcome", "verdict"),
    [
        ([(0.0, 1.0)] * 20, GateConfig(), False, "kept", "Passed the gate"),
        ([(1.0, 0.0)] * 20, GateConfig(), True, "rejected", "Rejected:"),
        ([(0.5, 0.5)] * 20, GateConfig(), True, "inconclusive", "Inconclusive"),
    ],
)
def test_outcomes_and_verdicts(pairs, gate, auto_load, outcome, verdict) -> None:
    receipt = _receipt(pairs, gate=gate, auto_load=auto_load)
    assert receipt["outcome"] == outcome
    assert receipt["verdict"].startswith(verdict)


def test_diagnostic_receipt() -> None:
    config = EnvironmentEvalConfig(groups=4)
    evidence = evidence_and_decision(_paired([(0.0, 1.0)] * 4), config.gate)
    receipt = build_receipt(
        "run-1", config, 5, {}, {"adapter": "out"}, b"a", b"b", evidence, "diagnostic"
    )
    assert receipt["evidence"]["decision"] == "diagnostic"
    assert receipt["verdict"].startswith("Diagnostic")
    for wrong in ("promoted", "kept", "rejected", "inconclusive", "error"):
        bad = copy.deepcopy(receipt)
        bad["outcome"] = wrong
        with pytest.raises(EvaluationReceiptInvalid):
            validate_receipt(bad)


def test_passed_allows_promoted_kept_error_only() -> None:
    receipt = _receipt()
    for allowed in ("promoted", "kept", "error"):
        ok = copy.deepcopy(receipt)
        ok["outcome"] = allowed
        validate_receipt(ok)
    bad = copy.deepcopy(receipt)
    bad["outcome"] = "rejected"
    with pytest.raises(EvaluationReceiptInvalid) as info:
        validate_receipt(bad)
    assert info.value.code == "environment_evaluation_failed"
    assert info.value.details["field"] == "outcome"
    with pytest.raises(EvaluationReceiptInvalid):
        _receipt(outcome="rejected")  # build_receipt validates too


@pytest.mark.parametrize(
    ("pairs", "decision"), [([(1.0, 0.0)] * 20, "rejected"), ([(0.5, 0.5)] * 20, "inconclusive")]
)
def test_rejected_and_inconclusive_only_map_to_themselves(pairs, decision) -> None:
    receipt = _receipt(pairs, gate=GateConfig())
    assert receipt["outcome"] == decision
    for wrong in ("promoted", "kept", "error", "diagnostic"):
        bad = copy.deepcopy(receipt)
        bad["outcome"] = wrong
        with pytest.raises(EvaluationReceiptInvalid):
            validate_receipt(bad)


@pytest.mark.parametrize(
    "digest",
    [
        "sha256:" + "A" * 64,
        "sha256:" + "a" * 63,
        "a" * 64,
        "sha1:" + "a" * 40,
        None,
        "",
    ],
)
def test_malformed_summary_digest_rejected(digest) -> None:
    for field in ("baseline_summary_sha256", "candidate_summary_sha256"):
        bad = _receipt()
        bad[field] = digest
        with pytest.raises(EvaluationReceiptInvalid) as info:
            validate_receipt(bad)
        assert info.value.details["field"] == field


@pytest.mark.parametrize(
    "missing",
    ["schema", "run_id", "config", "seed_start", "baseline", "candidate",
     "baseline_summary_sha256", "candidate_summary_sha256", "evidence", "outcome", "verdict"],
)
def test_required_fields(missing: str) -> None:
    bad = _receipt()
    del bad[missing]
    with pytest.raises(EvaluationReceiptInvalid) as info:
        validate_receipt(bad)
    assert missing in info.value.message


def test_evidence_tampering_rejected() -> None:
    cases = {
        "exact_sign_test_p_value": 0.01,  # not the p-value of (20, 0)
        "improved_groups": 19,  # counts no longer add up
        "decision": "inconclusive",  # contradicts the evidence and gate
        "mean_return_improvement": 0.9,  # not candidate - baseline
        "paired_groups": 19,
        "baseline_mean_return": float("nan"),
    }
    for field, value in cases.items():
        bad = _receipt()
        bad["evidence"][field] = value
        with pytest.raises(EvaluationReceiptInvalid):
            validate_receipt(bad)
    bad = _receipt()
    del bad["evidence"]["reason"]
    with pytest.raises(EvaluationReceiptInvalid):
        validate_receipt(bad)


def test_gate_changed_after_the_fact_rejected() -> None:
    bad = _receipt()
    bad["config"]["gate"]["min_mean_return"] = 0.9  # candidate 0.8 would now be rejected
    with pytest.raises(EvaluationReceiptInvalid) as info:
        validate_receipt(bad)
    assert info.value.details["field"] == "evidence.decision"


def test_policy_identities_validated() -> None:
    bad = _receipt()
    bad["candidate"] = {}
    with pytest.raises(EvaluationReceiptInvalid):
        validate_receipt(bad)
    bad = _receipt()
    bad["baseline"] = {"adapter": "run-17-lora"}
    with pytest.raises(EvaluationReceiptInvalid):
        validate_receipt(bad)
    bad = _receipt()
    bad["candidate"]["adapter_content_revision"] = "deadbeef"
    with pytest.raises(EvaluationReceiptInvalid):
        validate_receipt(bad)
    bad = _receipt()
    bad["candidate"]["surprise"] = 1
    with pytest.raises(EvaluationReceiptInvalid):
        validate_receipt(bad)


def test_unknown_top_level_field_and_schema() -> None:
    bad = _receipt()
    bad["extra"] = True
    with pytest.raises(EvaluationReceiptInvalid):
        validate_receipt(bad)
    bad = _receipt()
    bad["schema"] = "kiln.openenv-environment-evaluation.v2"
    with pytest.raises(EvaluationReceiptInvalid):
        validate_receipt(bad)


def test_world_model_block() -> None:
    base = {"mean_env_ce": 2.5, "env_tokens": 40, "sequences": 20}
    cand = {"mean_env_ce": 2.0, "env_tokens": 40, "sequences": 20}
    block = world_model_block(base, cand)
    assert block == {
        "metric": "observation_cross_entropy_v1",
        "transcripts": "candidate",
        "env_tokens": 40,
        "sequences": 20,
        "base_mean_env_ce": 2.5,
        "candidate_mean_env_ce": 2.0,
        "world_model_gain": 0.5,
    }
    receipt = _receipt(world_model=block)
    assert receipt["world_model"]["world_model_gain"] == 0.5
    assert json.loads(receipt_bytes(receipt))["world_model"] == block
    empty = world_model_block(
        {"mean_env_ce": None, "env_tokens": 0, "sequences": 2},
        {"mean_env_ce": None, "env_tokens": 0, "sequences": 2},
    )
    assert empty["world_model_gain"] is None
    with pytest.raises(ValueError):
        world_model_block(base, {**cand, "env_tokens": 39})
    bad = _receipt(world_model=block)
    bad["world_model"]["world_model_gain"] = float("inf")
    with pytest.raises(EvaluationReceiptInvalid):
        validate_receipt(bad)


def test_reset_differences_are_evidence_and_validated() -> None:
    config = EnvironmentEvalConfig(gate=GateConfig(min_mean_return=0.5, min_mean_improvement=0.1))
    paired = [PairedGroup(i, 1020 + i, 0.1, 0.8, reset_differences=("reset_observation.side",) if i == 3 else ())
              for i in range(20)]
    evidence = evidence_and_decision(paired, config.gate)
    assert evidence["reset_differences"] == [{"group_index": 3, "fields": ["reset_observation.side"]}]
    assert "reset_differences" not in evidence_and_decision(_paired([(0.1, 0.8)] * 20), config.gate)
    receipt = build_receipt("run-17", config, 1020, policy_identity(None),
                            policy_identity("run-17-lora", adapter_content_revision=REVISION),
                            BASELINE_SUMMARY, CANDIDATE_SUMMARY, evidence, outcome_for(evidence["decision"], auto_load=True))
    validate_receipt(json.loads(receipt_bytes(receipt)))
    for bad in ([], [{"group_index": 3}], [{"group_index": "3", "fields": ["a"]}], [{"group_index": 3, "fields": []}]):
        broken = copy.deepcopy(receipt)
        broken["evidence"]["reset_differences"] = bad
        with pytest.raises(EvaluationReceiptInvalid) as info:
            validate_receipt(broken)
        assert info.value.details["field"] == "evidence.reset_differences"


_VERDICT_EVIDENCE = {"paired_groups": 20, "baseline_mean_return": 0.25, "candidate_mean_return": 0.5, "reason": "R"}
_MEANS = "mean return 0.25 -> 0.5 over 20 paired seed groups"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("outcome", "sentence"),
    [
        ("diagnostic", f"Diagnostic evaluation (no gate): {_MEANS}."),
        ("promoted", f"Promoted: the trained adapter passed the gate and is now served; R; {_MEANS}."),
        ("kept", f"Passed the gate; auto_load is off, so the trained adapter is kept but not served; R; {_MEANS}."),
        ("rejected", f"Rejected: R; {_MEANS}."),
        ("inconclusive", f"Inconclusive, the trained adapter stays unserved: R; {_MEANS}."),
        ("error", f"Error: the trained adapter passed the gate but could not be promoted; {_MEANS}."),
    ],
)
def test_verdict_sentence_of_each_outcome(outcome: str, sentence: str) -> None:
    assert verdict_for(_VERDICT_EVIDENCE, outcome) == sentence


@pytest.mark.timeout(10)
def test_verdict_of_an_unknown_outcome_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown evaluation outcome 'approved'"):
        verdict_for(_VERDICT_EVIDENCE, "approved")
