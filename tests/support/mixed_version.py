"""A run through Temporal across two releases: started on an earlier release's workers, finished
on this one's. Used by ``tests/integration/test_cross_version_resume.py`` and, once per release
pair, to record the run's history into a kept folder:

    python -m tests.support.mixed_version [OLD_COMMIT]

writes ``tests/histories/mixed-<old>-to-<head>/`` (the run's history and the run queue's), which
``tests/integration/test_workflow_replay.py`` then replays on HEAD for ever.

The earlier release runs from a clone of its commit (the clone first on ``PYTHONPATH``, the shared
venv's interpreter) as one worker process holding both roles, with its own chaos hooks holding
each training step; it is SIGKILLed (by PID) after its step-2 checkpoint is heartbeated. This
release's control and gpu workers then take the run over: the control worker replays the history
the earlier workflow code wrote, the gpu worker resumes the training from the earlier trainer's
checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tests.support.chaos.faults import HOOKS_ENV, TRAIN_STEP_DELAY, FaultHooks

ROOT = Path(__file__).resolve().parents[2]
# The release just before the kiln/core layout: it records its trainer in every checkpoint.
PREVIOUS_RELEASE = "0051d57"
STEP_DELAY_S = 3.0  # each of the earlier trainer's steps is held this long after its heartbeat
KILL_AFTER_CHECKPOINT_S = 2.0  # > the gpu worker's 1 s heartbeat throttle, < one held step
HEARTBEAT_TIMEOUT_S = 3.0  # the killed training attempt times out this soon
# The chaos suite's tiny train request: 6 training steps, a checkpoint every 2.
TRAIN_REQUEST: dict[str, Any] = {
    "kind": "train",
    "groups": 4,
    "group_size": 2,
    "max_steps": 3,
    "max_action_tokens": 32,
    "thinking": False,
    "output_adapter": "mixed-agent",
    "training_config": {"epochs": 2, "lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3, "checkpoint_interval": 2},
}
SETTINGS_ENV = (
    "temporal_address",
    "s3_endpoint",
    "s3_access_key",
    "s3_secret_key",
    "s3_bucket",
    "model_path",
    "models_dir",
    "control_task_queue",
    "gpu_task_queue",
    "heartbeat_timeout_s",
)


def clone_release(commit: str, target: Path) -> str | None:
    """A checkout of ``commit`` at ``target`` (a clone sharing this repository's objects, so the
    code it runs knows its commit); its full hash, or None when this checkout lacks it."""
    full = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout.strip()
    if not full:
        return None
    for argv in (
        ["git", "clone", "--quiet", "--shared", "--no-checkout", str(ROOT), str(target)],
        ["git", "-C", str(target), "checkout", "--quiet", "--detach", full],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr}")
    return full


@dataclass
class MixedRun:
    """What the run left: its final status, its receipt, both histories and the old worker's pid."""

    final: dict[str, Any]
    receipt: dict[str, Any]
    history_json: str
    queue_history_json: str
    old_pid: int
    steps_before_kill: int
    kill_to_retry_s: float  # from the SIGKILL to the training's next attempt starting (Temporal's clock)
    undisturbed_receipt: dict[str, Any] | None  # the same request run whole on this release's workers


@contextlib.contextmanager
def old_worker(release: Path, settings: Any, hooks: FaultHooks, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The earlier release's workers (``python -m tests.support.chaos worker all`` of ``release``,
    its own chaos hooks installed), in their own process group; killed by PID on exit."""
    env = {
        "PYTHONPATH": str(release),
        "PATH": "/usr/bin:/bin",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "KILN_HOME": str(log.parent / "old-home"),
        HOOKS_ENV: str(hooks.directory),
    }
    for name in SETTINGS_ENV:
        value = getattr(settings, name)
        if value is not None:
            env[f"KILN_{name.upper()}"] = str(value)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.chaos", "worker", "all"],
            cwd=release,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _wait_event(
    hooks: FaultHooks, proc: subprocess.Popen[bytes], log: Path, timeout_s: float, **match: object
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = hooks.events("train_checkpoint", **match)
        if found:
            return found[0]
        if proc.poll() is not None:
            raise AssertionError(
                f"the earlier release's worker exited ({proc.returncode}): {log.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.1)
    raise AssertionError(f"no train_checkpoint {match} within {timeout_s}s: {log.read_text(errors='replace')[-3000:]}")


def _retry_started_at(history_json: str) -> float:
    """When (epoch seconds) the first retried activity attempt started, from the history."""
    from datetime import datetime

    for event in json.loads(history_json)["events"]:
        started = event.get("activityTaskStartedEventAttributes")
        if started and started.get("attempt", 1) > 1:
            stamp = event["eventTime"].rstrip("Z")
            whole, _, fraction = stamp.partition(".")
            return datetime.fromisoformat(f"{whole}.{fraction[:6].ljust(6, '0')}+00:00").timestamp()
    raise AssertionError("no activity attempt was retried")


async def run_across_releases(
    release: Path, settings: Any, env_url: str, work: Path, *, undisturbed: bool = False
) -> MixedRun:
    """Start a training run on ``release``'s workers, SIGKILL them after the step-2 checkpoint,
    finish the run on this release's workers; what it left. With ``undisturbed``, the same request
    then runs whole on this release's workers, for its receipt."""
    from kiln.core.artifacts.store import S3Store
    from tests.support.chaos.assertions import read_uri
    from tests.support.kiln_workers import running_workers
    from tests.support.waiting import workflow_result
    from workers.client import connect_client
    from workflows.names import WORKFLOW_NAME, queue_workflow_id

    hooks = FaultHooks(work / "hooks")
    hooks.set(TRAIN_STEP_DELAY, STEP_DELAY_S)
    run_id = f"mixed-{uuid.uuid4().hex[:12]}"
    client = await connect_client(settings)
    log = work / "old-worker.log"
    with old_worker(release, settings, hooks, log) as proc:
        handle = await client.start_workflow(
            WORKFLOW_NAME,
            {**TRAIN_REQUEST, "environment_urls": [env_url]},
            id=run_id,
            task_queue=settings.control_task_queue,
        )
        await asyncio.to_thread(_wait_event, hooks, proc, log, 240, run_id=run_id, attempt=1, step=2)
        await asyncio.sleep(KILL_AFTER_CHECKPOINT_S)
        os.killpg(proc.pid, signal.SIGKILL)  # mid-training, its checkpoint heartbeated
        killed_at = time.time()
        proc.wait(timeout=30)
        old_pid = proc.pid
    hooks.clear(TRAIN_STEP_DELAY)
    steps_before_kill = max(e["step"] for e in hooks.events("train_step", run_id=run_id))
    store = S3Store.from_settings(settings)

    def receipt_of(status: dict[str, Any]) -> dict[str, Any]:
        entry = next(a for a in status["artifacts"] if a["name"] == "train_receipt.json")
        return dict(json.loads(read_uri(store, entry["uri"])))

    whole = None
    async with running_workers(settings):
        final = await workflow_result(handle, 240)
        queue = client.get_workflow_handle(queue_workflow_id(settings.control_task_queue))
        if undisturbed:
            again = await client.start_workflow(
                WORKFLOW_NAME,
                {**TRAIN_REQUEST, "environment_urls": [env_url]},
                id=f"{run_id}-undisturbed",
                task_queue=settings.control_task_queue,
            )
            whole = receipt_of(await workflow_result(again, 240))
        await queue.terminate("recorded")
    history = (await handle.fetch_history()).to_json()
    queue_history = (await queue.fetch_history()).to_json()
    retry_s = _retry_started_at(history) - killed_at
    return MixedRun(final, receipt_of(final), history, queue_history, old_pid, steps_before_kill, retry_s, whole)


def main(commit: str = PREVIOUS_RELEASE) -> None:
    """Record the mixed run's histories into ``tests/histories/mixed-<commit>-to-<head>/``."""
    import shutil

    from tests.support.record_histories import recording_stack, release_folder

    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    out = release_folder(f"mixed-{commit}-to-{head}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if clone_release(commit, work / "release") is None:
            raise SystemExit(f"commit {commit} is not in this checkout")
        with recording_stack() as (settings, env_url):
            settings = settings.model_copy(update={"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S})
            run = asyncio.run(run_across_releases(work / "release", settings, env_url, work))
        assert run.final["state"] == "completed" and run.receipt["checkpoint"]["used"], run.receipt
        staging = work / "histories"
        staging.mkdir()
        (staging / "train_killed_mid_training.json").write_text(run.history_json)
        (staging / "run_queue.json").write_text(run.queue_history_json)
        shutil.copytree(staging, out)
    print(
        json.dumps(
            {
                "folder": str(out),
                "histories": sorted(p.name for p in out.glob("*.json")),
                "checkpoint": run.receipt["checkpoint"],
                "kill_to_retry_s": round(run.kill_to_retry_s, 1),
                "trainer": run.receipt["trainer"],
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:2])
