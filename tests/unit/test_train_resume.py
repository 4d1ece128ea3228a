"""The checkpoint identity rule and what a retried training does with a checkpoint it cannot use
(kiln.core.train.resume): a setting added at its default keeps every checkpoint usable, any changed
value changes the identity, and an unusable checkpoint restarts the training (never fails it)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pydantic import Field  # noqa: E402

import kiln.core.train  # noqa: E402
from kiln.core.canonical import digest_json  # noqa: E402
from kiln.core.training_config import EchoConfig, TrainingConfig
from kiln.core.errors import RunCancelled  # noqa: E402
from kiln.core.policy.identity import ADAPTER_FILES  # noqa: E402
from kiln.core.train.plan import LATER_SETTINGS  # noqa: E402
from kiln.core.train.resume import code_digest, resume_refusal, settings_digest, trainer_version  # noqa: E402
from kiln.core.train.trainer import train_grpo  # noqa: E402
from tests.unit.test_train_support import bandit_groups, build_tiny_qwen3  # noqa: E402


class NextReleaseConfig(TrainingConfig):
    """TrainingConfig as a later release might ship it: one more setting, whose default keeps the
    old behaviour (the trainer of this release ignores it)."""

    future_knob: float = Field(default=1.0, description="a setting added by a later release")


def test_a_setting_at_its_default_leaves_the_digest_unchanged():
    plain = digest_json({})
    assert settings_digest(TrainingConfig()) == plain
    assert settings_digest(NextReleaseConfig()) == plain
    assert settings_digest(NextReleaseConfig(seed=4)) == settings_digest(TrainingConfig(seed=4)) == digest_json({"seed": 4})
    # An explicitly given default is the default: the config as decoded from history digests alike.
    decoded = TrainingConfig.model_validate_json(TrainingConfig(seed=4).model_dump_json())
    assert settings_digest(decoded) == digest_json({"seed": 4})


def test_every_changed_value_changes_the_digest():
    changes = [{"seed": 1}, {"learning_rate": 1e-3}, {"epochs": 2}, {"optimizer": "muon"},
               {"echo": None}, {"echo": EchoConfig(**{"lambda": 0.5})}, {"target_kl": 0.1}]
    digests = {settings_digest(TrainingConfig(**change)) for change in changes}
    assert len(digests) == len(changes) and digest_json({}) not in digests
    assert settings_digest(NextReleaseConfig(future_knob=2.0)) == digest_json({"future_knob": 2.0})
    assert settings_digest(TrainingConfig(echo=EchoConfig(**{"lambda": 0.5}))) == digest_json({"echo": {"lambda": 0.5}})
    # A knob that does not act on this training is left out when the caller says so.
    assert settings_digest(TrainingConfig(stale_is_max_weight=3.0), ["stale_is_max_weight"]) == digest_json({})


def test_resume_refusal_names_the_differing_key_and_reads_earlier_checkpoints():
    identity = {"training_data_sha256": "sha256:" + "a" * 64, "settings_sha256": digest_json({}),
                "base_adapter_sha256": None, "total_steps": 9}
    assert resume_refusal(dict(identity, step=5), identity, {}) is None
    assert resume_refusal(dict(identity, total_steps=8), identity, {}) == (
        "the checkpoint's total_steps differs from this training's")
    assert resume_refusal(dict(identity, staleness=1), identity, {}) == (
        "the checkpoint's staleness differs from this training's")
    # A checkpoint of a release before settings_sha256: its config_sha256 is the whole dump's.
    dump = TrainingConfig().model_dump(mode="json", by_alias=True)
    legacy = {k: v for k, v in identity.items() if k != "settings_sha256"}
    assert resume_refusal({**legacy, "config_sha256": digest_json(dump)}, identity, dump) is None
    refused = resume_refusal({**legacy, "config_sha256": digest_json({**dump, "seed": 2})}, identity, dump)
    assert refused is not None and "config_sha256" in refused


def test_trainer_version_digests_the_training_sources(tmp_path):
    root = Path(kiln.core.train.__file__).parent
    version = trainer_version()
    assert version["kiln"] == kiln.__version__
    expected = hashlib.sha256()
    for path in sorted(root.glob("*.py"), key=lambda p: p.name):  # kiln/core/train has no sub-packages
        expected.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    assert version["train_code_sha256"] == "sha256:" + expected.hexdigest()
    assert version["commit"] is None or len(version["commit"]) == 40
    copy = shutil.copytree(root, tmp_path / "train", ignore=shutil.ignore_patterns("__pycache__"))
    assert code_digest(copy) == version["train_code_sha256"]
    (copy / "notes.txt").write_text("not code")
    assert code_digest(copy) == version["train_code_sha256"]
    step = copy / "step.py"
    step.write_bytes(step.read_bytes() + b"\n")
    assert code_digest(copy) != version["train_code_sha256"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_qwen3(tmp_path_factory.mktemp("resume-model") / "model")


def _bytes(adapter_dir: Path) -> dict[str, bytes]:
    return {name: (adapter_dir / name).read_bytes() for name in ADAPTER_FILES}


def _interrupted(model_path: Path, groups: list[dict], config: TrainingConfig, out: Path) -> Path:
    """Train until the step-2 checkpoint is written and the step after it starts, then cancel."""
    calls = {"n": 0}

    def cancel_after_three() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    with pytest.raises(RunCancelled):
        train_grpo(model_path=model_path, groups=groups, config=config, output_dir=out,
                   should_cancel=cancel_after_three)
    return out / "checkpoints" / "step-000002"


@pytest.mark.timeout(240)
def test_a_checkpoint_survives_a_release_that_adds_a_defaulted_setting(model_path, tmp_path):
    groups = bandit_groups(3)
    config = TrainingConfig(seed=3, checkpoint_interval=2, epochs=2)  # 6 steps
    whole = train_grpo(model_path=model_path, groups=groups, config=config, output_dir=tmp_path / "whole")
    checkpoint = _interrupted(model_path, groups, config, tmp_path / "old")
    upgraded = NextReleaseConfig(**config.model_dump())
    resumed = train_grpo(model_path=model_path, groups=groups, config=upgraded, output_dir=tmp_path / "new",
                         resume_from=checkpoint)
    assert resumed.receipt["checkpoint"]["used"] is True and resumed.receipt["resumed_from_step"] == 2
    assert _bytes(resumed.adapter_dir) == _bytes(whole.adapter_dir)
    assert resumed.receipt["steps"] == whole.receipt["steps"]

    # The same checkpoint as an earlier release wrote it (whole-dump config_sha256, no
    # settings_sha256, no trainer) resumes too; the receipt then has no writer's version to name.
    legacy = shutil.copytree(checkpoint, tmp_path / "legacy")
    state = json.loads((legacy / "state.json").read_text())
    state.pop("settings_sha256")
    state.pop("trainer")
    # What that release digested: it had none of the later settings (kiln.core.train.plan.LATER_SETTINGS).
    state_dump = {k: v for k, v in config.model_dump(mode="json", by_alias=True).items()
                  if k not in ("stale_is_max_weight", "engine_is_max_weight", *LATER_SETTINGS)}
    # This release writes that digest too (so a rollback to such a release can still resume).
    assert state["config_sha256"] == digest_json(state_dump)
    (legacy / "state.json").write_text(json.dumps(state))
    from_legacy = train_grpo(model_path=model_path, groups=groups, config=config, output_dir=tmp_path / "l",
                             resume_from=legacy)
    assert from_legacy.receipt["checkpoint"] == {"used": True, "step": 2, "reason": None, "written_by": None}
    assert _bytes(from_legacy.adapter_dir) == _bytes(whole.adapter_dir)


@pytest.mark.timeout(240)
def test_a_damaged_checkpoint_restarts_the_training_from_its_start(model_path, tmp_path):
    groups = bandit_groups(3)
    config = TrainingConfig(seed=3, checkpoint_interval=2, epochs=2)
    whole = train_grpo(model_path=model_path, groups=groups, config=config, output_dir=tmp_path / "whole")
    checkpoint = _interrupted(model_path, groups, config, tmp_path / "killed")
    # The optimizer file is unreadable: restore fails after the weights were already copied in, so
    # the trainer must put the starting weights back before it restarts.
    (checkpoint / "optimizer.pt").write_bytes(b"not a torch file")
    restarted = train_grpo(model_path=model_path, groups=groups, config=config, output_dir=tmp_path / "again",
                           resume_from=checkpoint)
    assert restarted.receipt["checkpoint"] == {
        "used": False, "step": 2, "reason": "the checkpoint's tensors could not be loaded",
        "written_by": whole.receipt["trainer"]}
    assert restarted.receipt["resumed_from_step"] is None
    assert _bytes(restarted.adapter_dir) == _bytes(whole.adapter_dir)
    # A folder that is no checkpoint at all: restarts too, saying why.
    empty = tmp_path / "empty"
    empty.mkdir()
    from_nothing = train_grpo(model_path=model_path, groups=groups, config=config, output_dir=tmp_path / "n",
                              resume_from=empty)
    assert from_nothing.receipt["checkpoint"]["used"] is False
    assert from_nothing.receipt["checkpoint"]["reason"].startswith("unreadable checkpoint")
    assert _bytes(from_nothing.adapter_dir) == _bytes(whole.adapter_dir)
