"""``on_no_output``: what training does with completions that produced no final action."""

from __future__ import annotations

import pytest

from kiln.core.training_config import TrainingConfig
from kiln.core.train.selection import select_groups
from tests.unit.test_train_support import X_TOKEN, Y_TOKEN, completion

NO_OUT = "MODEL_ACTION_NO_OUTPUT"


def _groups():
    return [
        {"messages": [], "completions": [
            completion(0, X_TOKEN, reward=1.0),
            completion(0, Y_TOKEN, reward=1.0),
            completion(0, X_TOKEN, harness_code=NO_OUT, reward=-1.0),
        ]},
    ]


def test_penalty_is_the_default_and_drop_loses_the_only_variation() -> None:
    assert TrainingConfig().on_no_output == "penalty"
    kept, _ = select_groups(_groups(), TrainingConfig().on_no_output)
    assert [c["reward"] for c in kept[0]["completions"]] == [1.0, 1.0, -1.0]
    kept, sel = select_groups(_groups(), "drop")
    assert kept == [] and sel["no_output_rollouts_discarded"] == 1
    assert sel["no_reward_gradient_groups_skipped"] == 1


@pytest.mark.parametrize("policy, rewards", [("penalty", [1.0, 1.0, -1.0]), ("zero_reward", [1.0, 1.0, 0.0])])
def test_kept_policies_train_on_the_no_output_completion(policy: str, rewards: list[float]) -> None:
    groups = _groups()
    kept, sel = select_groups(groups, policy)
    assert [c["reward"] for c in kept[0]["completions"]] == rewards
    assert sel["no_output_rollouts_discarded"] == 0 and sel["warnings"] == []
    assert groups[0]["completions"][2]["reward"] == -1.0  # artifacts are never rewritten


def test_the_policy_is_part_of_the_effective_config_in_the_receipt() -> None:
    dumped = TrainingConfig(on_no_output="penalty").model_dump(mode="json", by_alias=True)
    assert dumped["on_no_output"] == "penalty"
    with pytest.raises(ValueError):
        TrainingConfig(on_no_output="ignore")
