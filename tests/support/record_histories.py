"""Record workflow histories for the determinism (replay) test, into a new release folder.

    python -m tests.support.record_histories [RELEASE]

writes ``tests/histories/<RELEASE>/*.json`` (RELEASE defaults to the short hash of HEAD) and
refuses to touch a folder that exists: histories are kept per release and never re-recorded, so
the replay test checks every release's runs against the code on HEAD (docs/upgrading.md).

Starts a throw-away Temporal dev server, SeaweedFS and the counter environment, runs a few
representative runs (training with a gated evaluation, a rollout, a run failing at discovery, a
training run from the rollout's saved dataset, a rollout naming a served model, a run whose first
group attempt is interrupted and retried and which is then cancelled during revalidation, and a
two-iteration online-RL run) and writes each run's history (and the queue's) as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from temporalio import activity
from temporalio.api.enums.v1 import EventType

from activities.control import ControlActivities
from activities.gpu import GpuActivities
from kiln.core.errors import CollectionFailed
from kiln.core.policy.tiny import build_tiny_model
from kiln.core.records import CollectGroupInput, CollectGroupResult, RevalidationInput, StoredObject
from kiln.core.side_records import TrainDatasetInput
from kiln.core.settings import Settings
from tests.support.kiln_workers import running_workers
from tests.support.servers import free_port, serve_example_env
from tests.support.stack import start_test_seaweedfs, start_test_temporal
from workflows.names import TRAIN_DATASET_WORKFLOW, WORKFLOW_NAME, queue_workflow_id


class _FlakyGpu(GpuActivities):
    """Group 0's first attempt fails (a retry, recorded as an interruption of the run)."""

    @activity.defn(name="collect_group")
    async def collect_group(self, inp: CollectGroupInput) -> CollectGroupResult:  # type: ignore[override]
        if inp.group_index == 0 and activity.info().attempt == 1:
            activity.heartbeat({"group_index": 0, "failed_with": "collection_failed"})
            raise CollectionFailed("injected: the first attempt of group 0 is interrupted")
        return await super().collect_group(inp)


class _SlowRevalidation(ControlActivities):
    """Revalidation waits (heartbeating, so it hears the cancel) until the run is cancelled."""

    @activity.defn(name="revalidate_environments")
    async def revalidate_environments(self, inp: RevalidationInput) -> None:  # type: ignore[override]
        for _ in range(600):
            activity.heartbeat()
            await asyncio.sleep(0.1)
from tests.support.waiting import workflow_result

RUNS = {
    "train_with_gate": {
        "kind": "train",
        "groups": 2,
        "group_size": 2,
        "max_steps": 2,
        "max_action_tokens": 32,
        "output_adapter": "history-agent",
        "training_config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3},
        "environment_eval": {"groups": 2, "group_size": 1},
    },
    "rollout": {"kind": "rollout", "groups": 2, "group_size": 2, "max_steps": 2, "max_action_tokens": 32},
    # A run naming a served model (KILN_MODELS_DIR/tiny): its gpu activities go to kiln-gpu-history.tiny.
    "model_rollout": {
        "kind": "rollout", "model": "tiny", "groups": 1, "group_size": 2, "max_steps": 2, "max_action_tokens": 32,
    },
}
# Online RL: two collect→train iterations, the second sampling with (and training from) the first's
# adapter and optimizer state.
ONLINE_RL = {
    "kind": "train",
    "iterations": 2,
    "groups": 2,
    "group_size": 2,
    "max_steps": 4,
    "max_action_tokens": 48,
    "output_adapter": "history-online-agent",
    "training_config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3},
}


async def _record(out: Path, settings: Settings, env_url: str) -> StoredObject:
    async with running_workers(settings) as client:
        for name, request in RUNS.items():
            handle = await client.start_workflow(
                WORKFLOW_NAME,
                {**request, "environment_urls": [env_url]},
                id=f"history-{name}-{uuid.uuid4()}",
                task_queue=settings.control_task_queue,
            )
            final = await workflow_result(handle)
            (out / f"{name}.json").write_text((await handle.fetch_history()).to_json())
            if name == "rollout":
                dataset = next(a for a in final["artifacts"] if a["name"] == "rollouts.jsonl")
                saved = StoredObject(uri=dataset["uri"], sha256=dataset["sha256"], bytes=dataset["bytes"])
        handle = await client.start_workflow(
            WORKFLOW_NAME,
            {**RUNS["rollout"], "environment_urls": [f"http://127.0.0.1:{free_port()}"]},
            id=f"history-unreachable-{uuid.uuid4()}",
            task_queue=settings.control_task_queue,
        )
        try:
            await workflow_result(handle)
        except Exception:
            pass
        (out / "unreachable.json").write_text((await handle.fetch_history()).to_json())
        queue = client.get_workflow_handle(queue_workflow_id(settings.control_task_queue))
        await queue.terminate("recorded")
        (out / "run_queue.json").write_text((await queue.fetch_history()).to_json())
    return saved


async def _record_dataset_training(out: Path, settings: Settings, dataset: StoredObject) -> None:
    async with running_workers(settings) as client:
        handle = await client.start_workflow(
            TRAIN_DATASET_WORKFLOW,
            TrainDatasetInput(
                dataset=dataset,
                output_adapter="history-dataset-agent",
                training_config={"epochs": 1, "lora_rank": 4, "lora_alpha": 8},
            ),
            id=f"history-train-dataset-{uuid.uuid4()}",
            task_queue=settings.control_task_queue,
        )
        await workflow_result(handle)
        (out / "train_dataset.json").write_text((await handle.fetch_history()).to_json())


async def _record_retry_then_cancel(out: Path, settings: Settings, env_url: str) -> None:
    async with running_workers(settings, control_factory=_SlowRevalidation, gpu_factory=_FlakyGpu) as client:
        handle = await client.start_workflow(
            WORKFLOW_NAME,
            {**RUNS["rollout"], "environment_urls": [env_url]},
            id=f"history-retry-cancel-{uuid.uuid4()}",
            task_queue=settings.control_task_queue,
        )
        for _ in range(600):
            status = await handle.query("status")
            if status["phase"] == "revalidation":
                break
            await asyncio.sleep(0.2)
        assert status["interruptions"], status
        await handle.cancel()
        try:
            await workflow_result(handle)
        except Exception:
            pass
        status = await handle.query("status")
        assert status["state"] == "cancelled" and status["cancelled_stage"] == "revalidation", status
        (out / "retry_interrupt_cancel.json").write_text((await handle.fetch_history()).to_json())


async def record_online_rl(out: Path, settings: Settings, env_url: str) -> Path:
    """The two-iteration run's history (``online_rl.json``): both iterations in one history."""
    async with running_workers(settings) as client:
        handle = await client.start_workflow(
            WORKFLOW_NAME,
            {**ONLINE_RL, "environment_urls": [env_url]},
            id=f"history-online-rl-{uuid.uuid4()}",
            task_queue=settings.control_task_queue,
        )
        final = await workflow_result(handle)
        assert final["state"] == "completed", final.get("failure")
        curve = final["iterations"]
        assert [i["iteration"] for i in curve] == [1, 2] and all(i["trained"] for i in curve), curve
        history = await handle.fetch_history()
        # No continue-as-new at this size: the one history holds the whole run.
        assert history.events[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED
        path = out / "online_rl.json"
        path.write_text(history.to_json())
    return path


@contextlib.contextmanager
def recording_stack() -> Iterator[tuple[Settings, str]]:
    """A throw-away Temporal dev server, SeaweedFS, tiny model (also served as model "tiny") and
    counter environment: the settings pointing at them and the environment's URL."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        temporal, address = start_test_temporal(root / "t")
        seaweed, endpoint, access, secret = start_test_seaweedfs(root / "s", bucket="kiln-test")
        try:
            model = build_tiny_model(root / "tiny")
            shutil.copytree(model, root / "models" / "tiny")
            settings = Settings(
                home=root / "home",
                temporal_address=address,
                s3_endpoint=endpoint,
                s3_access_key=access,
                s3_secret_key=secret,
                s3_bucket="kiln-test",
                model_path=model,
                models_dir=root / "models",
                control_task_queue="kiln-control-history",
                gpu_task_queue="kiln-gpu-history",
            )
            with serve_example_env("counter") as env_url:
                yield settings, env_url
        finally:
            seaweed.stop()
            temporal.stop()


HISTORIES_ROOT = Path(__file__).resolve().parents[1] / "histories"


def release_folder(release: str | None = None, root: Path = HISTORIES_ROOT) -> Path:
    """The new folder a recording goes to: ``root/<release>`` (default: HEAD's short hash).

    Raises ``FileExistsError`` when it exists: a kept history is never overwritten."""
    if release is None:
        import subprocess

        release = subprocess.run(
            ["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=True, cwd=root
        ).stdout.strip()
    if not release or "/" in release or release.startswith("."):
        raise ValueError(f"not a release folder name: {release!r}")
    out = Path(root) / release
    if out.exists():
        raise FileExistsError(f"{out} exists: kept histories are never re-recorded; name a new release")
    return out


def main(release: str | None = None) -> None:
    out = release_folder(release)
    with tempfile.TemporaryDirectory() as tmp:  # written whole, then moved into place
        staging = Path(tmp) / "histories"
        staging.mkdir()
        with recording_stack() as (settings, env_url):
            saved = asyncio.run(_record(staging, settings, env_url))
            asyncio.run(_record_dataset_training(staging, settings, saved))
            asyncio.run(_record_retry_then_cancel(staging, settings, env_url))
            asyncio.run(record_online_rl(staging, settings, env_url))
        shutil.copytree(staging, out)
    print(json.dumps({"folder": str(out), "histories": sorted(p.name for p in out.glob("*.json"))}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
