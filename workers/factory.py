"""Build the Temporal client and the control/gpu workers from settings (one implementation).

Roles: ``control`` (workflows and the control activities), ``sampler`` (collection, evaluation
and replay: ``resolve_policy``, ``collect_group``, ``post_evaluate``, ``world_model_gain`` on each
model's gpu task queue), ``trainer`` (``train_adapter`` on each model's trainers' queue,
``workflows.names.train_task_queue``) and ``gpu`` = sampler + trainer in one process (sharing
one base model). A run names only its gpu queue; where its activities run is the workers' choice.
"""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import pydantic
from temporalio.client import Client
from temporalio.worker import Worker

from activities.control import ControlActivities
from kiln.core.artifacts.store import S3Store
from kiln.core.served_models import model_task_queue, servable_split, served_models
from kiln.core.settings import Settings
from workers.sandbox import workflow_runner
from workflows.names import train_task_queue
from workflows.chunk import CollectChunkWorkflow
from workflows.openenv_run import OpenEnvRunWorkflow
from workflows.run_queue import RunQueueWorkflow
from workflows.preflight import PreflightWorkflow
from workflows.train_dataset import TrainDatasetWorkflow

ROLES = ("control", "gpu")  # `all`
GPU_ROLES = ("gpu", "sampler", "trainer")  # the roles that run a model
TRAINING_ACTIVITIES = frozenset({"train_adapter"})  # the trainers' queue; every other gpu activity samples
HEARTBEAT_THROTTLE = timedelta(seconds=1)  # gpu workers: the most a heartbeat waits to be sent


def build_workers(
    client: Client,
    settings: Settings,
    roles: Sequence[str],
    *,
    store: S3Store | None = None,
    model_path: Path | None = None,
    sticky_timeout: timedelta = timedelta(seconds=10),
    control_factory: Callable[[Settings, S3Store], ControlActivities] = ControlActivities,
    gpu_factory: Callable[[Settings, S3Store, Path], Any] | None = None,
) -> list[Worker]:
    store = store or S3Store.from_settings(settings, outage_wait=True)
    workers: list[Worker] = []
    if "control" in roles:
        control = control_factory(settings, store)
        workers.append(
            Worker(
                client,
                task_queue=settings.control_task_queue,
                workflows=[
                    OpenEnvRunWorkflow,
                    CollectChunkWorkflow,
                    RunQueueWorkflow,
                    PreflightWorkflow,
                    TrainDatasetWorkflow,
                ],
                activities=control.all(),
                workflow_failure_exception_types=[pydantic.ValidationError],
                workflow_runner=workflow_runner(),
                sticky_queue_schedule_to_start_timeout=sticky_timeout,
            )
        )
    samples = bool({"gpu", "sampler"} & set(roles))
    trains = bool({"gpu", "trainer"} & set(roles))
    if samples or trains:
        workers.extend(_gpu_workers(client, settings, store, model_path, gpu_factory, samples=samples, trains=trains))
    return workers


def _on_cpu(device: str) -> bool | None:
    """Whether ``KILN_DEVICE`` places models on the CPU (None: a device this machine lacks; the
    first task reports ``device_unavailable``)."""
    from kiln.core.errors import DeviceUnavailable
    from kiln.core.policy.device import resolve_device

    try:
        return resolve_device(device) == "cpu"
    except DeviceUnavailable:
        return None


def _gpu_workers(
    client: Client,
    settings: Settings,
    store: S3Store,
    model_path: Path | None,
    gpu_factory: Callable[[Settings, S3Store, Path], Any] | None,
    *,
    samples: bool = True,
    trains: bool = True,
) -> list[Worker]:
    """Per served model (the default model on the gpu task queue, every ``KILN_MODELS_DIR`` model
    on ``<queue>.<name>``) one activities object with its own lazily loaded runtime, polled by a
    sampler worker on the model's queue and/or a trainer worker on its trainers' queue.

    A default model whose family the engine cannot serve refuses the start (``model_unsupported``);
    a ``KILN_MODELS_DIR`` model that cannot be served gets no worker (one warning line; a run naming
    it is refused at submit and admission). A training checkpoint reaches the server within
    ``HEARTBEAT_THROTTLE`` of its heartbeat (the SDK's default holds heartbeats for 0.8 x the
    heartbeat timeout): docs/durability.md."""
    from activities.gpu import GpuActivities

    models: dict[str | None, Path] = {None: model_path or settings.default_model_path}
    models.update(served_models(settings.models_dir))
    models, refused = servable_split(models, settings.engine, cpu=_on_cpu(settings.device))
    if None in refused:
        raise refused[None]
    for name, error in refused.items():
        print(f"warning: not serving model {name}: {error}", flush=True)
    workers: list[Worker] = []
    for name, path in models.items():
        activities = (gpu_factory or GpuActivities)(settings, store, path)
        activities.samples = samples  # a trainer alone never loads a policy runtime
        methods = activities.all()
        queue = model_task_queue(settings.gpu_task_queue, name)
        sampling = [m for m in methods if m.__name__ not in TRAINING_ACTIVITIES]
        training = [m for m in methods if m.__name__ in TRAINING_ACTIVITIES]
        # Each executor has a thread for every activity its worker takes at once: an activity taken
        # with no thread free would wait unstarted, not heartbeating, until its heartbeat timeout.
        if samples and sampling:
            workers.append(
                Worker(
                    client,
                    task_queue=queue,
                    activities=sampling,
                    activity_executor=concurrent.futures.ThreadPoolExecutor(
                        max_workers=max(4, settings.gpu_concurrency)
                    ),
                    max_concurrent_activities=settings.gpu_concurrency,
                    max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
                    default_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
                )
            )
        if trains and training:
            # a training across the machine's devices takes them all
            trainings = 1 if settings.train_devices != "1" else settings.gpu_max_concurrent_activities
            workers.append(
                Worker(
                    client,
                    task_queue=train_task_queue(queue),
                    activities=training,
                    activity_executor=concurrent.futures.ThreadPoolExecutor(max_workers=trainings),
                    max_concurrent_activities=trainings,
                    max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
                    default_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
                )
            )
    return workers
