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
from kiln.stages import (
    AdapterRef,
    CollectGroupInput,
    CollectGroupResult,
    PolicyInput,
    PolicyResult,
    StoredObject,
    TrainInput,
    TrainResult,
    WorldModelInput,
    WorldModelResult,
)
from kiln.steps.adapters import materialise, read_pointer
from kiln.steps.collection import behavior_policy_of, check_behavior_policy, collect
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

    def _adapter_dir(self, ref: AdapterRef | None) -> Path | None:
        if ref is None:
            return None
        return materialise(self.store, ref, self.cache_dir)

    def _resolve(self, inp: PolicyInput) -> PolicyResult:
        ref = inp.adapter_ref
        if ref is None and inp.adapter is not None:
            ref = read_pointer(self.store, inp.adapter)
        identity = behavior_policy_of(self.policy(), ref, self._adapter_dir(ref))
        if inp.expected is not None:
            check_behavior_policy(inp.expected, identity)
        return PolicyResult(behavior_policy=identity, adapter_ref=ref)

    @activity.defn(name="resolve_policy")
    @kiln_errors
    async def resolve_policy(self, inp: PolicyInput) -> PolicyResult:
        return await asyncio.to_thread(self._resolve, inp)

    @activity.defn(name="collect_group")
    @kiln_errors
    async def collect_group(self, inp: CollectGroupInput) -> CollectGroupResult:
        policy = await asyncio.to_thread(self.policy)
        adapter_dir = await asyncio.to_thread(self._adapter_dir, inp.adapter_ref)
        info = activity.info()
        return await collect(
            inp,
            store=self.store,
            policy=policy,
            adapter_dir=adapter_dir,
            attempt=info.attempt,
            heartbeat=lambda details: activity.heartbeat(details),
            should_cancel=activity.is_cancelled,
            credentials=self.settings.credentials,
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

    @activity.defn(name="world_model_gain")
    @kiln_errors
    def world_model_gain(self, inp: WorldModelInput) -> WorldModelResult:
        """Observation cross-entropy of the base model vs the candidate on evaluation transcripts."""
        from kiln.evaluation.receipt import world_model_block
        from kiln.steps.training import load_group_lines
        from kiln.train.world_model import world_model_comparison

        lines = load_group_lines(self.store, inp.groups)
        adapter_dir = self._adapter_dir(inp.adapter_ref)
        assert adapter_dir is not None
        base, candidate = world_model_comparison(self.model_path, lines, adapter_dir=adapter_dir)
        return WorldModelResult(block=world_model_block(base, candidate, transcripts="candidate"))

    def all(self) -> list[Any]:
        return [self.resolve_policy, self.collect_group, self.train_adapter, self.world_model_gain]
