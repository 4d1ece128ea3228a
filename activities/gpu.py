"""Gpu-queue activities: behaviour-policy resolution, seed-group collection, training.

The gpu worker process holds one policy runtime (base model + adapter LRU), loaded lazily on
first use. Sampling calls are serialised by a lock: the runtime switches adapters in place.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any

from temporalio import activity

from kiln.artifacts.store import S3Store
from kiln.settings import Settings
from kiln.stages import CollectGroupInput, CollectGroupResult, PolicyInput, PolicyResult, StoredObject, TrainInput, TrainResult
from kiln.steps.adapters import materialise_adapter
from kiln.steps.collection import behavior_policy_of, collect
from activities.common import kiln_errors


class LockedPolicy:
    """Serialises every call into the shared runtime (adapter switching is not thread-safe)."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._runtime, name)
        if not callable(target):
            return target

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return target(*args, **kwargs)

        return locked


class GpuActivities:
    def __init__(self, settings: Settings, store: S3Store, model_path: Path) -> None:
        self.settings = settings
        self.store = store
        self.model_path = Path(model_path)
        self.cache_dir = settings.home / "cache" / "adapters"
        self._policy: LockedPolicy | None = None
        self._load_lock = threading.Lock()

    def policy(self) -> LockedPolicy:
        with self._load_lock:
            if self._policy is None:
                from kiln.policy.runtime import PolicyRuntime

                self._policy = LockedPolicy(PolicyRuntime.load(self.model_path))
            return self._policy

    def _adapter_dir(self, adapter: str | None) -> Path | None:
        if adapter is None:
            return None
        return materialise_adapter(self.store, adapter, self.cache_dir)

    @activity.defn(name="resolve_policy")
    @kiln_errors
    async def resolve_policy(self, inp: PolicyInput) -> PolicyResult:
        policy = await asyncio.to_thread(self.policy)
        adapter_dir = await asyncio.to_thread(self._adapter_dir, inp.adapter)
        identity = await asyncio.to_thread(behavior_policy_of, policy, inp.adapter, adapter_dir)
        return PolicyResult(behavior_policy=identity)

    @activity.defn(name="collect_group")
    @kiln_errors
    async def collect_group(self, inp: CollectGroupInput) -> CollectGroupResult:
        policy = await asyncio.to_thread(self.policy)
        adapter_dir = await asyncio.to_thread(self._adapter_dir, inp.adapter)
        info = activity.info()
        return await collect(
            inp,
            store=self.store,
            policy=policy,
            adapter_dir=adapter_dir,
            attempt=info.attempt,
            heartbeat=lambda details: activity.heartbeat(details),
            should_cancel=activity.is_cancelled,
        )

    @activity.defn(name="train_adapter")
    @kiln_errors
    def train_adapter(self, inp: TrainInput) -> TrainResult:
        from kiln.steps.training import train

        details = activity.info().heartbeat_details
        resume = None
        if details and isinstance(details[-1], dict) and details[-1].get("checkpoint"):
            resume = StoredObject.model_validate(details[-1]["checkpoint"])
        activity.heartbeat({"phase": "starting", "resumed_from_checkpoint": resume is not None})
        with tempfile.TemporaryDirectory(prefix="kiln-train-") as work:
            return train(
                inp,
                store=self.store,
                model_path=self.model_path,
                work_dir=Path(work),
                cache_dir=self.cache_dir,
                heartbeat=lambda d: activity.heartbeat(d),
                should_cancel=activity.is_cancelled,
                resume_checkpoint=resume,
            )

    def all(self) -> list[Any]:
        return [self.resolve_policy, self.collect_group, self.train_adapter]
