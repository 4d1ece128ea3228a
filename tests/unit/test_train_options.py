"""Every value of every enumerated training setting changes what is trained.

The settings are discovered from the config models (every ``Literal`` and ``bool`` field of
``TrainingConfig`` and ``EchoConfig``), so a new option without a case here fails. For each one, the
same short training (tiny random Qwen3, groups with reward variation, warnings and one no-output
completion) runs once per value; the trained adapters must differ pairwise (the gradient or the
update differed), and where a value selects other tokens the receipt's token counts differ too.
``gradient_checkpointing`` and ``packing`` are the exceptions by design: they trade memory or padding
for time and must train the very same adapter (packing's fewer forwards: tests/unit/test_train_packing.py).
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file

from kiln.core.training_config import EchoConfig, TrainingConfig
from kiln.core.policy.identity import with_inference
from kiln.core.train.trainer import train_grpo
from tests.unit.test_train_support import (
    BEHAVIOR,
    END_TOKEN,
    X_TOKEN,
    Y_TOKEN,
    bandit_groups,
    build_tiny_qwen3,
    completion,
)

pytestmark = pytest.mark.timeout(600)

NO_OUT = "MODEL_ACTION_NO_OUTPUT"
BASE = {"seed": 3, "epochs": 2, "optimizer": "adamw", "learning_rate": 3e-2, "kl_coeff": 0.5,
        "echo": {"lambda": 0.5}}
# Settings that select other tokens: the receipt's token counts differ between their values
# (on_no_output: drop selects fewer; zero_reward and penalty keep the same tokens at other rewards).
SELECTING = {"on_no_output", "echo.env_mask_mode", "echo.warning_filter"}
# overlong mask selects other action tokens (the receipt's token counts are of the kept completions).
MASKING = {"overlong"}
SAME_TRAINING = {"gradient_checkpointing", "packing"}


def _choices(model: type, prefix: str = "") -> dict[str, list]:
    out: dict[str, list] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if typing.get_origin(annotation) is typing.Literal:
            out[prefix + (field.alias or name)] = list(typing.get_args(annotation))
        elif annotation is bool:
            out[prefix + (field.alias or name)] = [False, True]
    return out


# adapter (lora | full) changes what is trained altogether (LoRA factors vs every base weight):
# tests/unit/test_train_full.py compares the two paths' gradients and checks every weight moves.
OWN_TESTS = {"adapter": "tests/unit/test_train_full.py"}
OPTIONS = {k: v for k, v in {**_choices(TrainingConfig), **_choices(EchoConfig, "echo.")}.items() if k not in OWN_TESTS}


IDENTITY = with_inference(BEHAVIOR, {"max_action_tokens": 3})


def _groups() -> list[dict]:
    """Each group's first completion has an action that reached max_action_tokens (3): overlong."""
    groups = bandit_groups(2, warning=True, behavior=IDENTITY)
    groups.append({"messages": [], "completions": [
        completion(2, X_TOKEN, reward=1.0, warning=True, behavior=IDENTITY),
        completion(2, Y_TOKEN, reward=0.0, behavior=IDENTITY),
        completion(2, X_TOKEN, reward=-1.0, harness_code=NO_OUT, behavior=IDENTITY)]})
    for group in groups:
        piece = next(p for p in group["completions"][0]["tokens"]["pieces"] if p["kind"] == "action")
        piece["ids"].append(END_TOKEN)
        piece["logprobs"].append(-0.25)
    return groups


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_qwen3(tmp_path_factory.mktemp("options-model") / "model")


@pytest.fixture(scope="module")
def warm(model_path, tmp_path_factory) -> Path:
    """An adapter the runs start from: the sampling policy is then not the base, so k1's penalty on
    the behaviour policy's log-ratio to the base (zero for data the base sampled) applies too."""
    out = tmp_path_factory.mktemp("options-warm")
    return train_grpo(model_path=model_path, groups=bandit_groups(2), config=TrainingConfig(**{**BASE, "echo": None}),
                      output_dir=out, expected_behavior_policy=BEHAVIOR).adapter_dir


def _config(setting: str, value) -> TrainingConfig:
    payload = {**BASE, "echo": dict(BASE["echo"])}
    if setting.startswith("echo."):
        payload["echo"][setting.removeprefix("echo.")] = value
    else:
        payload[setting] = value
    return TrainingConfig.model_validate(payload)


def test_every_option_is_covered():
    assert set(OPTIONS) >= {"optimizer", "lr_schedule", "is_level", "kl_estimator", "behavior_policy",
                            "on_no_output", "echo.env_mask_mode", "echo.warning_filter", "gradient_checkpointing",
                            "advantage_norm", "loss_normaliser", "overlong"}


@pytest.mark.parametrize("setting", sorted(OPTIONS))
def test_each_value_trains_differently(model_path, warm, tmp_path, setting):
    results = {}
    for value in OPTIONS[setting]:
        if setting == "optimizer" and value == "muon" and not hasattr(torch.optim, "Muon"):
            continue
        results[value] = train_grpo(model_path=model_path, groups=_groups(), config=_config(setting, value),
                                    output_dir=tmp_path / str(value), base_adapter_dir=warm)
    weights = {v: load_file(str(r.adapter_dir / "adapter_model.safetensors")) for v, r in results.items()}
    values = list(results)
    assert len(values) >= 2
    for i, a in enumerate(values):
        for b in values[i + 1:]:
            gap = max(float((weights[a][k] - weights[b][k]).abs().max()) for k in weights[a])
            if setting in SAME_TRAINING:
                assert gap < 1e-5, (setting, a, b, gap)
            else:
                assert gap > 1e-4, (setting, a, b, gap)
            if setting in SELECTING and (setting != "on_no_output" or "drop" in (a, b)):  # the others reweight
                assert results[a].receipt["token_counts"] != results[b].receipt["token_counts"], (setting, a, b)
            if setting in MASKING and "mask" in (a, b):  # the masked completions' actions are not trained
                trained = {v: results[v].receipt["steps"] for v in (a, b)}
                assert sum(s["action_tokens"] for s in trained[a]) != sum(s["action_tokens"] for s in trained[b])
