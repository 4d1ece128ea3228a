"""The GRPO variants' pieces with exact values: Dr. GRPO advantages, overlong ramp / mask / soft
penalty, admission of settings that need the sampler's cap, and old configs decoding unchanged."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pydantic import ValidationError

from kiln.core.training_config import TrainingConfig
from kiln.core.errors import TrainingFailed
from kiln.core.policy.identity import with_inference
from kiln.core.train.advantages import group_advantages
from kiln.core.train.batches import RowShaping, group_rows
from kiln.core.train.plan import LATER_SETTINGS, plan_training
from tests.unit.test_train_support import (
    BEHAVIOR,
    END_TOKEN,
    X_TOKEN,
    Y_TOKEN,
    completion,
)

pytestmark = pytest.mark.timeout(60)


def _group(lengths: list[int], rewards: list[float], identity=BEHAVIOR) -> dict:
    comps = []
    for i, (n, r) in enumerate(zip(lengths, rewards)):
        c = completion(0, X_TOKEN if i % 2 == 0 else Y_TOKEN, reward=r, behavior=identity, turns=1)
        piece = next(p for p in c["tokens"]["pieces"] if p["kind"] == "action")
        piece["ids"] = piece["ids"][:1] + [END_TOKEN] * (n - 1)
        piece["logprobs"] = [-1.0] * n
        comps.append(c)
    return {"messages": [], "completions": comps}


def test_dr_grpo_advantages_are_only_centred():
    assert group_advantages([1.0, 0.0, 0.5, 0.5], "none") == [0.5, -0.5, 0.0, 0.0]
    std = group_advantages([1.0, 0.0, 0.5, 0.5])
    assert std[0] == pytest.approx(0.5 / (0.125 ** 0.5 + 1e-6), rel=1e-12)  # population std
    with pytest.raises(ValueError):
        group_advantages([1.0], "max")


def test_overlong_ramp_mask_and_soft_penalty():
    shaping = RowShaping(overlong="soft_penalty", max_action_tokens=8, buffer_tokens=4, penalty=0.5)
    group = _group([3, 5, 6, 8], [1.0, 1.0, 1.0, 1.0])
    assert [shaping.ramp(c) for c in group["completions"]] == [0.0, 0.25, 0.5, 1.0]
    rows = group_rows(group, group_index=0, warning_filter=True, shaping=shaping)
    assert [r.reward for r in rows] == [1.0, 0.875, 0.75, 0.5]
    assert rows[0].advantage > rows[1].advantage > rows[2].advantage > rows[3].advantage
    masked = group_rows(_group([3, 8, 3, 8], [1.0, 1.0, 0.0, 0.0]), group_index=0, warning_filter=True,
                        shaping=RowShaping(overlong="mask", max_action_tokens=8))
    assert [float(r.action.sum()) for r in masked] == [3.0, 0.0, 3.0, 0.0]  # env targets stay
    assert [r.advantage for r in masked] == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-5)
    assert all(float(r.env.sum()) == 6.0 for r in masked)
    keep = group_rows(_group([3, 8], [1.0, 0.0]), group_index=0, warning_filter=True)
    assert [float(r.action.sum()) for r in keep] == [3.0, 8.0]


def test_settings_needing_the_cap_are_refused_without_it():
    groups = [_group([3, 8], [1.0, 0.0])]  # an identity without the sampling block
    for config in (TrainingConfig(overlong="mask"), TrainingConfig(loss_normaliser="constant")):
        with pytest.raises(TrainingFailed) as err:
            plan_training(groups, config, BEHAVIOR, None)
        assert err.value.code == "invalid_training_data" and "max_action_tokens" in err.value.message
    identity = with_inference(BEHAVIOR, {"max_action_tokens": 8})
    plan = plan_training([_group([3, 8], [1.0, 0.0], identity)], TrainingConfig(loss_normaliser="constant"),
                         identity, None)
    assert plan.settings.loss_constant_tokens == 8.0 and plan.effective_config["loss_normaliser"] == "constant"


def test_gspo_refuses_another_normaliser():
    with pytest.raises(ValidationError, match="loss_normaliser"):
        TrainingConfig(is_level="sequence", loss_normaliser="sequences")


def test_old_configs_decode_and_keep_their_digest_keys():
    """A payload from before the variants decodes to the defaults, and the effective config (whose
    digest a checkpoint must match) leaves the new settings out while they are at their defaults."""
    old = TrainingConfig.model_validate({"optimizer": "adamw", "epochs": 2, "echo": {"lambda": 0.1}})
    assert (old.advantage_norm, old.loss_normaliser, old.overlong, old.entropy_coeff) == ("group_std", "tokens", "keep", 0.0)
    assert {k: TrainingConfig.model_fields[k].default for k in LATER_SETTINGS} == LATER_SETTINGS
    plan = plan_training([_group([3, 8], [1.0, 0.0])], old, BEHAVIOR, None)
    assert not set(LATER_SETTINGS) & set(plan.effective_config)
    changed = plan_training([_group([3, 8], [1.0, 0.0])], old.model_copy(update={"entropy_coeff": 0.01}), BEHAVIOR, None)
    assert changed.effective_config["entropy_coeff"] == 0.01
    assert changed.identity["settings_sha256"] != plan.identity["settings_sha256"]
