"""Pairing checks between the baseline and candidate evaluation bundles."""

from __future__ import annotations

import math

import pytest

from kiln.core.evaluation.pairing import EnvironmentEvaluationFailed, PairedGroup, pair_summaries
from tests.unit.test_evaluation_support import constant, paired_bundles


def _drift(docs, field: str) -> EnvironmentEvaluationFailed:
    with pytest.raises(EnvironmentEvaluationFailed) as info:
        pair_summaries(*docs)
    err = info.value
    assert err.code == "environment_evaluation_failed"
    assert err.details["field"] == field
    assert field in err.message
    return err


def test_pairs_groups_with_means() -> None:
    docs = paired_bundles([[0.0, 1.0], [2.0, 2.0]], [[1.0, 1.0], [1.0, 2.0]])
    paired = pair_summaries(*docs)
    assert paired == [
        PairedGroup(0, 1000, 0.5, 1.0, (0.0, 1.0), (1.0, 1.0)),
        PairedGroup(1, 1001, 2.0, 1.5, (2.0, 2.0), (1.0, 2.0)),
    ]
    assert [g.sign for g in paired] == [1, -1]
    assert [g.episodes for g in paired] == [2, 2]


def test_one_seed_group_with_twenty_episodes_is_one_pair() -> None:
    paired = pair_summaries(*paired_bundles(constant(1, 0.0, size=20), constant(1, 1.0, size=20)))
    assert len(paired) == 1
    assert paired[0].episodes == 20
    assert (paired[0].baseline_mean, paired[0].candidate_mean) == (0.0, 1.0)


def test_mismatched_seed_is_an_error_naming_group_and_field() -> None:
    bs, cs, br, cr = paired_bundles(constant(3, 0.0), constant(3, 1.0))
    cr["groups"][2]["seed"] = 4242
    for record in cs["rollouts"]:
        if record["group_index"] == 2:
            record["seed"] = 4242
    err = _drift((bs, cs, br, cr), "seed")
    assert err.details["group_index"] == 2
    assert "group 2" in err.message and "4242" in err.message
    assert err.retryable is False


def test_mismatched_episode_seed_only_in_summary() -> None:
    bs, cs, br, cr = paired_bundles(constant(3, 0.0), constant(3, 1.0))
    cs["rollouts"][1]["seed"] = 7
    err = _drift((bs, cs, br, cr), "seed")
    assert err.details["group_index"] == 1


def test_mismatched_reset_payload() -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0), constant(2, 1.0))
    cr["groups"][1]["reset_payload"] = {"seed": 1001, "difficulty": "hard"}
    err = _drift((bs, cs, br, cr), "reset_payload")
    assert err.details["group_index"] == 1


def test_mismatched_reset_observation() -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0), constant(2, 1.0))
    cr["groups"][0]["reset_observation"] = {"observation": {"total": 1}, "reward": None, "done": False}
    _drift((bs, cs, br, cr), "reset_observation")


def test_different_candidate_counts() -> None:
    docs = paired_bundles([[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0]])
    err = _drift(docs, "candidate_count")
    assert err.details["group_index"] == 1


def test_different_candidate_indices() -> None:
    bs, cs, br, cr = paired_bundles(constant(1, 0.0, size=2), constant(1, 1.0, size=2))
    cr["groups"][0]["candidates"][1]["candidate_index"] = 5
    _drift((bs, cs, br, cr), "candidate_index")


def test_different_environment_index() -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0), constant(2, 1.0))
    cr["groups"][1]["environment_index"] = 1
    _drift((bs, cs, br, cr), "environment_index")


def test_different_replay_environments() -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0), constant(2, 1.0))
    cr["environments"][0]["identity"]["schema_sha256"] = "sha256:" + "b" * 64
    _drift((bs, cs, br, cr), "environments")


@pytest.mark.parametrize(
    ("field", "value"),
    [("environment_name", "other"), ("environment_url", "http://127.0.0.1:9000"), ("candidate_index", 3)],
)
def test_episode_field_drift(field: str, value) -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0), constant(2, 1.0))
    cs["rollouts"][1][field] = value
    err = _drift((bs, cs, br, cr), field)
    assert err.details["episode"] == 1


def test_different_group_counts() -> None:
    _drift(paired_bundles(constant(3, 0.0), constant(2, 1.0)), "groups")


def test_summary_setting_drift() -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0), constant(2, 1.0))
    cs["temperature"] = 0.7
    _drift((bs, cs, br, cr), "temperature")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "1.0", True])
def test_returns_must_be_finite_numbers(bad) -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0), constant(2, 1.0))
    cs["rollouts"][0]["episode_return"] = bad
    _drift((bs, cs, br, cr), "episode_return")


def test_summary_episode_missing_from_its_replay_group() -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0, size=2), constant(2, 1.0, size=2))
    for summary in (bs, cs):
        del summary["rollouts"][3]
    _drift((bs, cs, br, cr), "candidate_index")


def test_empty_bundles_fail() -> None:
    _drift(paired_bundles([], []), "groups")


def test_reset_observation_drift_hint_names_reset_determinism() -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0), constant(2, 1.0))
    cr["groups"][1]["reset_observation"] = {"observation": {"total": 0, "side": "b"}, "reward": None, "done": False}
    err = _drift((bs, cs, br, cr), "reset_observation")
    assert err.details["group_index"] == 1
    assert 'reset_determinism: "warn"' in err.hint


def test_warn_mode_pairs_differing_resets_and_lists_the_fields() -> None:
    """Both sides collected with reset_determinism: warn (the environment ignores the seed for part
    of its reset): the groups pair by seed and reset payload; the differing fields are listed."""
    bs, cs, br, cr = paired_bundles(constant(3, 0.0), constant(3, 1.0))
    bs["reset_determinism"] = cs["reset_determinism"] = "warn"
    br["groups"][0]["reset_observation"]["observation"]["side"] = "white-1"
    cr["groups"][0]["reset_observation"]["observation"]["side"] = "white-2"
    cr["groups"][2]["reset_observation"]["observation"]["side"] = "black-9"
    paired = pair_summaries(bs, cs, br, cr)
    assert [g.reset_differences for g in paired] == [
        ("reset_observation.observation.side",), (), ("reset_observation.observation.side",)
    ]
    assert [(g.baseline_mean, g.candidate_mean) for g in paired] == [(0.0, 1.0)] * 3
    # Other group fields stay strict in warn mode.
    cr["groups"][1]["reset_payload"] = {"seed": 1001, "difficulty": "hard"}
    assert _drift((bs, cs, br, cr), "reset_payload").details["group_index"] == 1


def test_warn_on_one_side_only_is_a_settings_drift() -> None:
    bs, cs, br, cr = paired_bundles(constant(2, 0.0), constant(2, 1.0))
    cs["reset_determinism"] = "warn"
    cr["groups"][0]["reset_observation"]["observation"]["side"] = "x"
    _drift((bs, cs, br, cr), "reset_determinism")
