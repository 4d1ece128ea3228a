"""Cross-version, in training: the trainer of an earlier release (commit 533fb53, before the
checkpoint identity rule, taken with ``git archive``) trains until its step-2 checkpoint and is
interrupted; the current trainer finishes from that checkpoint. The training completes, uses the
checkpoint, names both trainers in its receipt (the earlier one recorded none: ``written_by``
null), and its adapter equals the current code's undisturbed training (the two releases' training
numerics are the same)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kiln.core.training_config import TrainingConfig
from kiln.core.policy.identity import ADAPTER_FILES  # noqa: E402
from kiln.core.train.trainer import train_grpo  # noqa: E402
from tests.unit.test_train_support import bandit_groups, build_tiny_qwen3  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EARLIER_RELEASE = "533fb53"

OLD_TRAINER = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from kiln.core.contracts import TrainingConfig
from kiln.core.errors import RunCancelled
from kiln.core.train.trainer import train_grpo
model, groups_file, out = sys.argv[1:4]
calls = {"n": 0}
def cancel_after_three():
    calls["n"] += 1
    return calls["n"] > 3
try:
    train_grpo(model_path=Path(model), groups=json.loads(Path(groups_file).read_text()),
               config=TrainingConfig(seed=3, checkpoint_interval=2, epochs=2), output_dir=Path(out),
               should_cancel=cancel_after_three)
except RunCancelled:
    print("interrupted after the step-2 checkpoint")
"""


def _earlier_release(target: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", EARLIER_RELEASE, "kiln"], capture_output=True,
                             timeout=60, check=False)
    if archive.returncode != 0:
        pytest.skip(f"commit {EARLIER_RELEASE} is not in this checkout (a shallow clone)")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(target, filter="data")
    return target


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_training_interrupted_on_an_earlier_release_finishes_on_this_one(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    old = _earlier_release(tmp_path / "earlier")
    model = build_tiny_qwen3(tmp_path / "model")
    groups = bandit_groups(3)
    (tmp_path / "groups.json").write_text(json.dumps(groups))
    ran = subprocess.run([sys.executable, "-c", OLD_TRAINER, str(model), str(tmp_path / "groups.json"),
                          str(tmp_path / "old-out")], cwd=old, env={"PYTHONPATH": str(old), "HF_HUB_OFFLINE": "1",
                                                                    "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=240, check=False)
    assert ran.returncode == 0 and "interrupted after the step-2 checkpoint" in ran.stdout, ran.stderr[-2000:]
    checkpoint = tmp_path / "old-out" / "checkpoints" / "step-000002"
    state = json.loads((checkpoint / "state.json").read_text())
    assert "settings_sha256" not in state and "trainer" not in state  # really the earlier format

    config = TrainingConfig(seed=3, checkpoint_interval=2, epochs=2)
    finished = train_grpo(model_path=model, groups=groups, config=config, output_dir=tmp_path / "new",
                          resume_from=checkpoint)
    whole = train_grpo(model_path=model, groups=groups, config=config, output_dir=tmp_path / "whole")
    receipt = finished.receipt
    assert receipt["checkpoint"] == {"used": True, "step": 2, "reason": None, "written_by": None}
    assert receipt["resumed_from_step"] == 2 and receipt["trainer"] == whole.receipt["trainer"]
    assert receipt["steps"] == whole.receipt["steps"]
    assert {n: (finished.adapter_dir / n).read_bytes() for n in ADAPTER_FILES} == {
        n: (whole.adapter_dir / n).read_bytes() for n in ADAPTER_FILES}
