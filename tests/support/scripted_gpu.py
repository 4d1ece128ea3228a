"""A gpu worker whose policy is scripted: the real ``GpuActivities`` (collection, identity checks,
S3 storage, live figures) with a model-free ``PolicyPort`` in place of the model runtime.

Pass ``gpu_factory=scripted_gpu_factory(policy)`` to ``running_workers`` / ``build_workers``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from activities.gpu import GpuActivities, LockedPolicy
from kiln.core.artifacts.store import S3Store
from kiln.core.settings import Settings


class ScriptedGpuActivities(GpuActivities):
    """``GpuActivities`` serving ``runtime`` (any ``PolicyPort``) instead of loading a model; there
    is no base model to lend the trainer, so it never shares one (``share_base_model`` off)."""

    def __init__(self, settings: Settings, store: S3Store, model_path: Path, runtime: Any) -> None:
        super().__init__(settings.model_copy(update={"share_base_model": False}), store, model_path)
        self.runtime = runtime

    def policy(self) -> LockedPolicy:
        with self._load_lock:
            if self._policy is None:
                self._policy = LockedPolicy(self.runtime)
            return self._policy


def scripted_gpu_factory(runtime: Any) -> Callable[[Settings, S3Store, Path], GpuActivities]:
    def make(settings: Settings, store: S3Store, model_path: Path) -> GpuActivities:
        return ScriptedGpuActivities(settings, store, model_path, runtime)

    return make
