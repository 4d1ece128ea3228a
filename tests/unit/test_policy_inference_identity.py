"""The behaviour identity binds the sampling settings: collection refuses a group whose settings
differ from the ones the run's identity names (real PolicyRuntime on the tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import PolicyIdentityChanged
from kiln.core.policy.identity import inference_config_sha256, sampling_of
from kiln.core.stages.collection import behavior_policy_of, require_same_policy

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)


def test_collection_check_covers_sampling_settings(tiny_model_dir: Path) -> None:
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(tiny_model_dir)
    settings = {"group_size": 4, "max_steps": 6, "max_action_tokens": 48, "temperature": 0.7, "thinking": True}
    expected = behavior_policy_of(runtime, None, None, settings)
    assert expected["inference_config_sha256"] == inference_config_sha256(expected["inference"])
    assert sampling_of(expected)["temperature"] == 0.7
    require_same_policy(expected, behavior_policy_of(runtime, None, None, {**settings, "group_size": 2}))
    with pytest.raises(PolicyIdentityChanged) as err:
        require_same_policy(expected, behavior_policy_of(runtime, None, None, {**settings, "temperature": 1.0}))
    assert err.value.details["changed_fields"] == ["inference", "inference_config_sha256"]
    # an identity admitted before the field existed is compared on the model part only
    legacy = behavior_policy_of(runtime, None, None)
    assert "inference" not in legacy and legacy["base_model_sha256"] == expected["base_model_sha256"]
