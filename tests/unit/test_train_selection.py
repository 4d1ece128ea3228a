"""Group selection, advantages and token accounting: pure functions, no torch."""

from __future__ import annotations

import math

import pytest

from kiln.core.train.advantages import group_advantages
from kiln.core.train.selection import select_groups
from kiln.core.train.tokens import count_tokens, tokenize_completion
from tests.unit.test_train_support import X_TOKEN, Y_TOKEN, completion


def _group(*comps):
    return {"messages": [], "completions": list(comps)}


def test_selection_counts_and_warnings_exact():
    no_out = "MODEL_ACTION_NO_OUTPUT"
    groups = [
        _group(completion(0, X_TOKEN), completion(0, Y_TOKEN)),  # kept
        _group(
            completion(1, X_TOKEN, harness_code=no_out),
            completion(1, Y_TOKEN, harness_code=no_out),
        ),
        _group(completion(2, X_TOKEN), completion(2, X_TOKEN)),  # equal rewards
        _group(  # one no-output dropped, rest vary: kept with warning
            completion(3, X_TOKEN),
            completion(3, Y_TOKEN),
            completion(3, X_TOKEN, harness_code=no_out),
        ),
        _group(  # no-output dropped leaves equal rewards: skipped as no variation
            completion(4, X_TOKEN, harness_code=no_out, reward=5.0),
            completion(4, Y_TOKEN, reward=0.0),
            completion(4, Y_TOKEN, harness_code="INVALID_MODEL_ACTION", reward=0.0),
        ),
        _group(),  # empty group: no usable output
    ]
    kept, sel = select_groups(groups, "drop")
    assert [len(g["completions"]) for g in kept] == [2, 2]
    assert kept[1]["completions"][0]["tokens"]["pieces"][0]["ids"][1] == 4 + 3
    assert sel == {
        "groups_submitted": 6,
        "rollouts_submitted": 12,
        "no_output_rollouts_discarded": 4,
        "no_usable_output_groups_skipped": 2,
        "no_reward_gradient_groups_skipped": 2,
        "warnings": [
            "group 1 produced no final model actions; skipped",
            "group 2 has no reward variation (all rewards 1.0); zero-gradient work skipped",
            "group 3: dropped 1 of 3 completions that produced no final model action",
            "group 4 has no reward variation (all rewards 0.0); zero-gradient work skipped",
            "group 5 produced no final model actions; skipped",
        ],
    }
    # artifacts keep everything: the input is not mutated
    assert len(groups[3]["completions"]) == 3


def test_selection_is_idempotent_on_kept_groups():
    kept, _ = select_groups([_group(completion(0, X_TOKEN), completion(0, Y_TOKEN))])
    again, sel = select_groups(kept)
    assert again == kept and sel["warnings"] == [] and sel["no_output_rollouts_discarded"] == 0


def test_advantages_population_std():
    assert group_advantages([1.0, 0.0]) == [1.0 / (0.5 + 1e-6) * 0.5, -1.0 / (0.5 + 1e-6) * 0.5]
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert all(math.isclose(abs(a), 1.0, rel_tol=1e-5) for a in adv)
    assert group_advantages([2.0, 2.0, 2.0]) == [0.0, 0.0, 0.0]
    assert math.isclose(sum(group_advantages([3.0, -1.0, 0.5])), 0.0, abs_tol=1e-12)


def test_masks_disjoint_and_warning_filter():
    comp = completion(0, X_TOKEN, warning=True, turns=2)
    on = tokenize_completion(comp, warning_filter=True)
    off = tokenize_completion(comp, warning_filter=False)
    for t in (on, off):
        assert not any(a and e for a, e in zip(t.is_action, t.is_env_target))
    assert sum(on.is_action) == 4 and sum(on.is_observation) == 15
    assert sum(on.is_env_target) == 12 and sum(off.is_env_target) == 15
    counts = count_tokens([_group(comp)], warning_filter=True)
    assert counts == {
        "action_tokens": 4,
        "context_tokens": 3 + 2 + 2,
        "env_tokens_before_warning_filter": 15,
        "warning_tokens_filtered": 3,
        "env_tokens_after_warning_filter": 12,
        "env_tokens": 12,
    }
    assert count_tokens([_group(comp)], warning_filter=False)["warning_tokens_filtered"] == 0


def test_pure_modules_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; import kiln.core.train, kiln.core.train.selection, kiln.core.train.advantages, "
        "kiln.core.train.tokens; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.timeout(30)
def test_full_obs_trains_the_observation_turns_wrapping():
    """``env_mask_mode: full_obs`` adds the template wrapping after the first action (context
    pieces) to the ECHO targets and to the observation span; the prompt never is a target; warning
    pieces stay out. ``env_only`` keeps exactly the observation pieces."""
    from tests.unit.test_train_support import OBS_TOKENS, bandit_groups

    row = completion(0, X_TOKEN, warning=True)  # context(3) [a a obs(3 warn) obs(6) ctx(2)] [a a obs(6) ctx(2)]
    only = tokenize_completion(row, warning_filter=True)
    full = tokenize_completion(row, warning_filter=True, env_mask_mode="full_obs")
    ids = only.ids
    targets_only = [ids[i] for i, on in enumerate(only.is_env_target) if on]
    targets_full = [ids[i] for i, on in enumerate(full.is_env_target) if on]
    assert targets_only == OBS_TOKENS * 2
    assert targets_full == OBS_TOKENS + [11, 12] + OBS_TOKENS + [11, 12]
    assert (only.observation_tokens, full.observation_tokens) == (15, 19)
    assert not any(full.is_env_target[:3]) and full.is_action == only.is_action
    counts = count_tokens(bandit_groups(1, warning=True), warning_filter=True, env_mask_mode="full_obs")
    plain = count_tokens(bandit_groups(1, warning=True), warning_filter=True)
    assert counts["env_tokens"] - plain["env_tokens"] == plain["context_tokens"] - counts["context_tokens"] == 4 * 4
    with pytest.raises(ValueError):
        tokenize_completion(row, warning_filter=True, env_mask_mode="everything")
