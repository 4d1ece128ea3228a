"""Several vllm engine servers behind one engine port, with sticky routing (``KILN_VLLM_ENGINES``).

A gpu worker with ``KILN_VLLM_ENGINES=N`` runs N :class:`kiln.core.policy.engine_vllm.VllmEngine`
servers, each on devices of its own (:mod:`kiln.core.policy.vllm_topology`: one GPU each, or a
slice of the CPU's cores). :class:`VllmRouter` is the engine the worker's policy runtime sees:

- **Sticky routing.** The gpu worker names the episodes each call's rows belong to
  (:data:`kiln.core.policy.engine.request_route`: one route per seed-group attempt). The first call
  of a route picks the engine with the fewest routes so far (the lowest index on a tie), and every
  later call of that route goes to the same engine, so every turn of an episode is served by one
  engine (its prefix cache holds the episode's context). A call without a route picks the same way
  and keeps nothing. The last :data:`MAX_ROUTES` routes are remembered (least recently used out).
- **Adapters by digest.** Each engine loads an adapter by path on its first request naming its
  digest (as one engine does); an unload reaches every engine.
- **One identity.** The engines share one configuration, so they serve one behaviour identity: the
  first engine's. How many engines there are is not part of it (no row is computed differently).

Each engine's server reports the requests it served per route (``/stats``'s ``routes``), which is
how the tests check the routing from the engines' side.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Sequence

from kiln.core.policy.engine import AdapterHandle, Generation, GenerationRequest, request_route
from kiln.core.policy.engine_vllm import VllmConfig, VllmEngine, default_python
from kiln.core.policy.vllm_topology import engine_envs

MAX_ROUTES = 4096  # routes remembered (far more than the seed groups a worker has in flight)


class VllmRouter:
    """The engine port over several vllm engine servers (see the module docstring)."""

    name = "vllm"
    concurrent = True

    def __init__(self, engines: Sequence[VllmEngine]) -> None:
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engines)
        self.config = self.engines[0].config  # the shared configuration (max_model_len, ...)
        self._lock = threading.Lock()
        self._routes: OrderedDict[str, int] = OrderedDict()
        self._assigned = [0] * len(self.engines)  # routes given to each engine so far

    # ------------------------------------------------------------------------------ routing
    def engine_index(self, route: str | None) -> int:
        """The engine that serves ``route`` (assigned on its first call, kept after)."""
        with self._lock:
            if route is not None and route in self._routes:
                self._routes.move_to_end(route)
                return self._routes[route]
            index = min(range(len(self.engines)), key=lambda i: (self._assigned[i], i))
            self._assigned[index] += 1
            if route is not None:
                self._routes[route] = index
                while len(self._routes) > MAX_ROUTES:
                    self._routes.popitem(last=False)
            return index

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        if not requests:
            return []
        return self.engines[self.engine_index(request_route.get())].generate(requests)

    # ---------------------------------------------------------------------------- processes
    def start(self) -> None:
        """Start every engine at once (each waits for its own health)."""
        with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
            for done in [pool.submit(engine.start) for engine in self.engines]:
                done.result()

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    @property
    def pids(self) -> list[int | None]:
        return [engine.pid for engine in self.engines]

    # ------------------------------------------------------------------------------- port
    def identity(self) -> dict[str, Any]:
        self.start()  # (a running engine returns at once)
        return self.engines[0].identity()

    @property
    def text_only(self) -> bool:
        return self.engines[0].text_only

    def stats(self) -> dict[str, Any]:
        """Each engine's figures (``engines``), and the requests in flight now per tag, over all."""
        each = [engine.stats() for engine in self.engines]
        now: dict[str, int] = {}
        for figures in each:
            for tag, count in figures.get("in_flight", {}).items():
                now[tag] = now.get(tag, 0) + count
        return {"engines": each, "in_flight": now}

    def load_adapter(self, adapter: AdapterHandle) -> None:
        for engine in self.engines:
            engine.load_adapter(adapter)

    def unload_adapter(self, sha256: str) -> None:
        for engine in self.engines:
            if engine.pid is not None:
                engine.unload_adapter(sha256)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.exclusive())
            yield


def engine_for(settings: Any, model_path: Path, *, dtype: str) -> Any:
    """The vllm engine a gpu worker with ``settings`` (:class:`kiln.core.settings.Settings`) serves
    ``model_path`` with: one :class:`kiln.core.policy.engine_vllm.VllmEngine` (its log ``<home>/logs/vllm-engine.log``), or with
    ``KILN_VLLM_ENGINES`` above 1 a :class:`VllmRouter` over that many
    (engine ``i``'s log ``vllm-engine-<i>.log`` for ``i`` > 0), each spanning
    ``KILN_VLLM_TENSOR_PARALLEL`` devices (:mod:`kiln.core.policy.vllm_topology`)."""
    logs = Path(settings.home) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    on_cuda, gpus = _visible_gpus(settings.device)
    envs = engine_envs(
        settings.vllm_tensor_parallel,
        settings.vllm_engines,
        on_cuda=on_cuda,
        gpus=gpus,
        cores=sorted(os.sched_getaffinity(0)),
    )
    engines = [
        VllmEngine(
            VllmConfig(
                model_path=Path(model_path),
                python=Path(settings.vllm_python or default_python()),
                dtype=dtype,
                log_path=logs / ("vllm-engine.log" if i == 0 else f"vllm-engine-{i}.log"),
                max_model_len=settings.vllm_max_model_len,
                gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
                cpu_kvcache_gb=settings.vllm_cpu_kvcache_gb,
                max_num_seqs=max(64, settings.vllm_max_concurrent_activities * 8),
                tensor_parallel=settings.vllm_tensor_parallel,
                extra_env=env,
            )
        )
        for i, env in enumerate(envs)
    ]
    return engines[0] if len(engines) == 1 else VllmRouter(engines)


def _visible_gpus(device: str) -> tuple[bool, list[str]]:
    """Whether the worker's device is CUDA, and its visible GPUs as ``CUDA_VISIBLE_DEVICES`` names
    them (``0 … count-1`` where it is unset)."""
    from kiln.core.policy.device import resolve_device

    if not resolve_device(device).startswith("cuda"):
        return False, []
    import torch

    count = torch.cuda.device_count()
    listed = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return True, (listed if len(listed) == count else [str(i) for i in range(count)])


__all__ = ["MAX_ROUTES", "VllmRouter", "engine_for"]
