"""Run-request validation: field-level messages and the stable codes they carry."""

from __future__ import annotations

import pytest

from kiln.core.contracts import parse_run_request, reset_plan_sha256
from kiln.core.errors import InvalidRequest

BASE = {"kind": "train", "environment_urls": ["http://127.0.0.1:8990"], "output_adapter": "a"}


@pytest.mark.parametrize(
    ("change", "code", "fragment"),
    [
        ({"group_size": 1}, "openenv_invalid_request", "group_size must be >= 2"),
        ({"groups": 0}, "openenv_invalid_request", "groups:"),
        ({"environment_urls": ["http://a", "http://b"], "groups": 1}, "openenv_invalid_request", "groups (1) must be >="),
        ({"bogus": 1}, "openenv_invalid_request", "bogus: Extra inputs are not permitted"),
        ({"kind": "rollout"}, "openenv_invalid_request", "does not take output_adapter"),
        ({"idempotency_key": "has space"}, "openenv_invalid_request", "idempotency_key"),
        ({"thinking": False, "thinking_budget_tokens": 8}, "openenv_invalid_request", "requires thinking"),
        ({"thinking": "maybe"}, "openenv_invalid_request", "thinking"),
        ({"model": "../etc"}, "openenv_invalid_request", "model '../etc' is not a model name"),
        ({"reset_options": {"a": 1}, "environment_reset_options": [{}]}, "openenv_invalid_request", "mutually exclusive"),
        ({"environment_eval": {"groups": 5, "seed_start": 3}}, "openenv_invalid_environment_eval", "overlap the training seeds [0, 8)"),
        ({"environment_eval": {"groups": 10, "gate": {}}}, "openenv_invalid_environment_eval", "needs groups >= 20"),
        ({"environment_eval": {"gate": {"min_mean_improvement": -1}}}, "openenv_invalid_environment_eval", "min_mean_improvement"),
    ],
)
def test_invalid_requests_name_the_field(change: dict, code: str, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        parse_run_request({**BASE, **change})
    assert error.value.code == code
    assert fragment in error.value.message


def test_defaults_and_held_out_seeds() -> None:
    request = parse_run_request({**BASE, "seed_start": 100, "environment_eval": {"gate": {}}})
    assert (request.groups, request.group_size, request.max_steps, request.thinking) == (8, 4, 8, "auto")
    assert request.model is None
    assert request.eval_seed_start() == 108
    assert request.reset_templates() == [{}]


def test_reset_plan_digest_ignores_key_order_and_caller_seed() -> None:
    one = parse_run_request({**BASE, "reset_options": {"b": 2, "a": 1, "seed": 5}})
    two = parse_run_request({**BASE, "reset_options": {"a": 1, "b": 2}})
    assert one.reset_templates() == [{"a": 1, "b": 2}] == two.reset_templates()
    assert reset_plan_sha256(one.reset_templates()) == reset_plan_sha256(two.reset_templates())
    assert reset_plan_sha256([{"difficulty": "hard"}, {"split": "train"}]) == (
        "sha256:08f2095cfc0fc441b62020716f2cbf01ed3268692c623f171b82e80fb473eae0"
    )


def test_seed_in_reset_options_is_dropped_with_a_warning() -> None:
    from kiln.core.contracts import parse_run_request

    request = parse_run_request(
        {"kind": "rollout", "environment_urls": ["http://127.0.0.1:1"], "reset_options": {"seed": 5, "level": 2}}
    )
    assert request.reset_templates() == [{"level": 2}]
    assert request.reset_option_warnings() == [
        "reset_options.seed was dropped: every group resets with its own seed (seed_start + group index)"
    ]
    plain = parse_run_request({"kind": "rollout", "environment_urls": ["http://127.0.0.1:1"]})
    assert plain.reset_option_warnings() == []
