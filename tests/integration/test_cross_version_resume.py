"""Cross-version, in training: the trainer of an earlier release (commit 533fb53, before the
checkpoint identity rule, taken with ``git archive``) trains until its step-2 checkpoint and is
interrupted; the current trainer finishes from that checkpoint. The training completes, uses the
checkpoint, names both trainers in its receipt (the earlier one recorded none: ``written_by``
null), and its adapter equals the current code's undisturbed training (the two releases' training
numerics are the same).

And a kill: the trainer of the previous release (commit 0051d57, a clone of it so it knows its
commit) is SIGKILLed right after its step-2 checkpoint; the current trainer finishes from that
checkpoint, and the receipt names both trainers (``trainer`` and ``checkpoint.written_by``, with
that commit and a different training-code digest) and that the checkpoint was used.

And the same through Temporal (``tests.support.mixed_version``): a run started on the previous
release's workers, SIGKILLed after its step-2 checkpoint, finished by this release's workers; its
history, kept as ``tests/histories/mixed-0051d57-to-aa15cce/``, replays on HEAD."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path
from typing import Any, Callable

import pytest
from temporalio.client import WorkflowHistory

torch = pytest.importorskip("torch")

from kiln.core.training_config import TrainingConfig
from kiln.core.policy.identity import ADAPTER_FILES  # noqa: E402
from kiln.core.train.trainer import train_grpo  # noqa: E402
from tests.support.mixed_version import HEARTBEAT_TIMEOUT_S, PREVIOUS_RELEASE, run_across_releases  # noqa: E402
from tests.support.mixed_version import clone_release  # noqa: E402
from tests.support.chaos.assertions import record  # noqa: E402
from tests.support.replay import head_replayer  # noqa: E402
from tests.unit.test_train_support import bandit_groups, build_tiny_qwen3  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EARLIER_RELEASE = "533fb53"

OLD_TRAINER = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from kiln.contracts import TrainingConfig
from kiln.errors import RunCancelled
from kiln.train.trainer import train_grpo
# The earlier release's own code (an editable install would serve a missing module from HEAD).
assert Path(sys.modules[train_grpo.__module__].__file__).resolve().is_relative_to(Path.cwd().resolve())
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


KILLED_TRAINER = """
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from kiln.contracts import TrainingConfig
from kiln.train.trainer import train_grpo
assert Path(sys.modules[train_grpo.__module__].__file__).resolve().is_relative_to(Path.cwd().resolve())
model, groups_file, out = sys.argv[1:4]
def sink(step, path):
    if step == 2:
        print("checkpoint 2 written", flush=True)
        time.sleep(600)  # killed here, mid-training
train_grpo(model_path=Path(model), groups=json.loads(Path(groups_file).read_text()),
           config=TrainingConfig(seed=3, checkpoint_interval=2, epochs=2), output_dir=Path(out),
           checkpoint_sink=sink)
"""


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One checkout of PREVIOUS_RELEASE for the module (a clone sharing this repository's objects,
    so the code it runs knows its commit) and its full commit hash."""
    target = tmp_path_factory.mktemp("previous") / "release"
    commit = clone_release(PREVIOUS_RELEASE, target)
    if commit is None:
        pytest.skip(f"commit {PREVIOUS_RELEASE} is not in this checkout (a shallow clone)")
    return target, commit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_training_killed_on_the_previous_release_finishes_here_naming_both_trainers(
    previous_release: tuple[Path, str], tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    old, commit = previous_release
    model = build_tiny_qwen3(tmp_path / "model")
    groups = bandit_groups(3)
    (tmp_path / "groups.json").write_text(json.dumps(groups))
    trainer = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, str(model), str(tmp_path / "groups.json"),
                                str(tmp_path / "old-out")], cwd=old, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={"PYTHONPATH": str(old), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    try:
        line = trainer.stdout.readline() if trainer.stdout else ""
        assert line.strip() == "checkpoint 2 written", trainer.stderr.read() if trainer.stderr else ""
    finally:
        trainer.kill()  # SIGKILL, after the step-2 checkpoint, before the training ends
        trainer.wait(timeout=30)
    assert trainer.returncode == -9
    checkpoint = tmp_path / "old-out" / "checkpoints" / "step-000002"
    written_by = json.loads((checkpoint / "state.json").read_text())["trainer"]
    assert written_by["commit"] == commit

    config = TrainingConfig(seed=3, checkpoint_interval=2, epochs=2)
    finished = train_grpo(model_path=model, groups=groups, config=config, output_dir=tmp_path / "new",
                          resume_from=checkpoint)
    whole = train_grpo(model_path=model, groups=groups, config=config, output_dir=tmp_path / "whole")
    receipt = finished.receipt
    assert receipt["checkpoint"] == {"used": True, "step": 2, "reason": None, "written_by": written_by}
    # Both trainers named, and they differ: the earlier one's code is not this one's.
    assert receipt["trainer"] == whole.receipt["trainer"]
    assert receipt["trainer"]["train_code_sha256"] != written_by["train_code_sha256"]
    assert receipt["resumed_from_step"] == 2 and receipt["steps"] == whole.receipt["steps"]
    assert {n: (finished.adapter_dir / n).read_bytes() for n in ADAPTER_FILES} == {
        n: (whole.adapter_dir / n).read_bytes() for n in ADAPTER_FILES}


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(480)
async def test_a_run_started_on_the_previous_release_through_temporal_finishes_on_this_one(
    previous_release: tuple[Path, str], kiln_settings: Callable[..., Any], counter_env_url: str, tmp_path: Path
) -> None:
    """Through the real Temporal dev server: the previous release's workers start a training run,
    are SIGKILLed after its step-2 checkpoint; this release's workers finish it (the control worker
    replaying the earlier workflow code's history). The receipt names both trainers and the used
    checkpoint, and the history (kept as tests/histories/mixed-0051d57-to-aa15cce/) replays here."""
    old, commit = previous_release
    run = await run_across_releases(old, kiln_settings(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S), counter_env_url,
                                    tmp_path, undisturbed=True)
    assert run.final["state"] == "completed", run.final.get("failure")
    receipt = run.receipt
    written_by = receipt["checkpoint"]["written_by"]
    assert receipt["checkpoint"] == {"used": True, "step": 2, "reason": None, "written_by": written_by}
    assert receipt["resumed_from_step"] == 2 and run.steps_before_kill in (2, 3)
    assert len(receipt["steps"]) > run.steps_before_kill  # killed before the training ended
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()
    assert written_by["commit"] == commit and receipt["trainer"]["commit"] == head != commit
    assert receipt["trainer"]["train_code_sha256"] != written_by["train_code_sha256"]
    # Recovery within the heartbeat timeout plus the chaos matrix's 20 s slack (a fresh poll).
    assert 0 < run.kill_to_retry_s < HEARTBEAT_TIMEOUT_S + 20
    # The same request run whole on this release: the same steps, the same adapter.
    assert run.undisturbed_receipt is not None
    assert receipt["steps"] == run.undisturbed_receipt["steps"]
    assert receipt["adapter_sha256"] == run.undisturbed_receipt["adapter_sha256"]

    events = json.loads(run.history_json)["events"]
    tasks = [e["workflowTaskCompletedEventAttributes"]["identity"].split("@")[0] for e in events
             if e["eventType"] == "EVENT_TYPE_WORKFLOW_TASK_COMPLETED"]
    assert tasks[0] == str(run.old_pid) and tasks[-1] == str(os.getpid()) and set(tasks) == {tasks[0], tasks[-1]}
    retried = [a for e in events if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_STARTED"
               for a in [e["activityTaskStartedEventAttributes"]] if a.get("attempt", 1) > 1]
    assert [(a["attempt"], a["identity"].split("@")[0]) for a in retried] == [(2, str(os.getpid()))]
    assert retried[0]["lastFailure"]["timeoutFailureInfo"]["timeoutType"] == "TIMEOUT_TYPE_HEARTBEAT"
    record("previous release's worker SIGKILLed after the step-2 checkpoint, finished here",
           kill_to_retry_s=run.kill_to_retry_s, resumed_from_step=receipt["resumed_from_step"],
           steps_redone=run.steps_before_kill - receipt["resumed_from_step"], adapter_identical=True)
    for name, text in (("run", run.history_json), ("queue", run.queue_history_json)):
        replayed = await head_replayer().replay_workflow(WorkflowHistory.from_json(name, text))
        assert replayed.replay_failure is None
