"""Gpu-queue activities: behaviour-policy resolution, seed-group collection, training.

The gpu worker process holds one policy runtime (base model + adapter LRU), loaded lazily on
first use. Sampling calls are serialised by a lock: the runtime switches adapters in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from temporalio import activity

from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import pretty_json
from kiln.core.errors import KilnError
from kiln.core.settings import Settings
from kiln.core.records import (
    AdapterRef,
    CollectGroupInput,
    CollectGroupResult,
    PolicyInput,
    PolicyResult,
    PostEvalInput,
    PostEvalResult,
    StoredObject,
    TrainInput,
    TrainResult,
    WorldModelInput,
    WorldModelResult,
)
from kiln.core.artifacts.adapters import materialise, read_pointer
from kiln.core.policy.engine import decode_tile_of, request_route, request_tag
from kiln.core.policy.identity import with_inference
from kiln.core.stages.collection import behavior_policy_of, collect, require_same_policy
from activities.common import activity_methods, heartbeating, kiln_errors
from activities.live_metrics import open_train_stream, publish_group_figures


@contextlib.contextmanager
def heartbeat_ticker(details: Callable[[], dict[str, Any]]) -> Iterator[None]:
    """Heartbeat ``details()`` every third of the heartbeat timeout from a helper thread, so slow
    set-up and wrap-up phases (model load, evaluation passes, uploads) never look like a crash."""
    timeout = activity.info().heartbeat_timeout
    interval = max(0.2, timeout.total_seconds() / 3) if timeout else 5.0
    context = contextvars.copy_context()
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(interval):
            context.run(activity.heartbeat, details())

    thread = threading.Thread(target=tick, name="kiln-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=interval + 1)


async def _beat_while_waiting(latest: dict[str, Any], timeout: Any) -> None:
    """Re-send the latest heartbeat every third of the heartbeat timeout (from the event loop)."""
    interval = max(0.2, timeout.total_seconds() / 3) if timeout else 5.0
    while True:
        await asyncio.sleep(interval)
        activity.heartbeat(dict(latest))


def _resolved_sampling(sampling: dict[str, Any] | None, thinking: bool | None) -> dict[str, Any] | None:
    """The run's sampling settings with ``thinking`` as resolved for the model (without thinking
    the reasoning budget does not apply), as ``RunRequest.episode_settings`` resolves them."""
    if sampling is None or thinking is None:
        return sampling
    resolved = {**sampling, "thinking": thinking}
    if not thinking:
        resolved["thinking_budget_tokens"] = None
    return resolved


class LockedPolicy:
    """Serialises every call into the shared runtime (adapter switching is not thread-safe), except
    sampling on a concurrent engine, which batches the rows of every caller itself (vllm; hf joins
    concurrent calls with the same adapter into one decode loop)."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._runtime, name)
        if not callable(target):
            return target
        if name == "sample" and getattr(getattr(self._runtime, "engine", None), "concurrent", False):
            return target  # a batching engine takes every row in flight at once

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return target(*args, **kwargs)

        return locked


def _size_default_executor(activities: int) -> None:
    """Give the event loop's default executor a thread per concurrent collection activity: each
    group waits for its rows in ``asyncio.to_thread``, and with the batching engine many wait at once."""
    loop = asyncio.get_running_loop()
    if getattr(loop, "_kiln_executor_size", 0) >= activities:
        return
    import concurrent.futures

    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=activities + 4))
    loop._kiln_executor_size = activities  # type: ignore[attr-defined]  # Kiln's mark on the loop it sized


class GpuActivities:
    def __init__(self, settings: Settings, store: S3Store, model_path: Path) -> None:
        self.settings = settings
        self.store = store
        self.model_path = Path(model_path)
        self.cache_dir = settings.home / "cache" / "adapters"
        self._policy: LockedPolicy | None = None
        self._load_lock = threading.Lock()
        # False on a `trainer` worker: no sampling here, so training loads its own model (or ranks)
        # and never a policy runtime (workers.factory sets it from the role)
        self.samples = True

    def policy(self) -> LockedPolicy:
        with self._load_lock:
            if self._policy is None:
                from kiln.core.policy.runtime import PolicyRuntime

                runtime = PolicyRuntime.load(
                    self.model_path,
                    device=self.settings.device,
                    dtype=self.settings.dtype,
                    decode_tile=self.settings.hf_decode_tile,
                )
                if self.settings.engine == "vllm":
                    from kiln.core.policy.vllm_router import engine_for

                    runtime.use_engine(engine_for(self.settings, self.model_path, dtype=runtime.dtype))
                self._policy = LockedPolicy(runtime)
            return self._policy

    def _adapter_dir(self, ref: AdapterRef | None) -> Path | None:
        if ref is None:
            return None
        return materialise(self.store, ref, self.cache_dir)

    def _resolve(self, inp: PolicyInput) -> PolicyResult:
        ref = inp.adapter_ref
        if ref is None and inp.adapter is not None:
            ref = read_pointer(self.store, inp.adapter)
        policy = self.policy()
        thinking = None if inp.thinking is None else policy.resolve_thinking(inp.thinking)
        # a contract recorded at another decode tile (or before the tile) is checked at its own tile
        identity = behavior_policy_of(policy, ref, self._adapter_dir(ref), decode_tile=decode_tile_of(inp.expected))
        full = with_inference(identity, _resolved_sampling(inp.inference, thinking))
        if inp.expected is not None:
            # a preflight contract names the model identity; a full identity also the sampling
            require_same_policy(inp.expected, full if "inference_config_sha256" in inp.expected else identity)
        return PolicyResult(behavior_policy=full, adapter_ref=ref, thinking=thinking)

    @activity.defn(name="resolve_policy")
    @kiln_errors
    async def resolve_policy(self, inp: PolicyInput) -> PolicyResult:
        return await heartbeating(asyncio.to_thread(self._resolve, inp))  # a fresh worker loads the model

    @activity.defn(name="collect_group")
    @kiln_errors
    async def collect_group(self, inp: CollectGroupInput) -> CollectGroupResult:
        info = activity.info()
        previous = info.heartbeat_details[-1] if info.heartbeat_details else None
        latest: dict[str, Any] = {"group_index": inp.group_index, "phase": "starting"}

        def beat(details: dict[str, Any]) -> None:
            latest.clear()
            latest.update(details)
            activity.heartbeat(details)

        # Heartbeat from the event loop while an environment request is outstanding, so a silent
        # environment ends with the session's own request timeout (environment_unavailable), not
        # the activity's shorter heartbeat timeout. A stuck event loop still stops heartbeating.
        # It starts before the model and adapter load: a fresh worker's first attempt (loading for
        # longer than the heartbeat timeout) must not be timed out and re-collected.
        ticker = asyncio.ensure_future(_beat_while_waiting(latest, info.heartbeat_timeout))
        try:
            policy = await asyncio.to_thread(self.policy)
            request_tag.set(inp.run_id)  # the engine's batching figures name the runs batched together
            # every turn of this attempt's episodes goes to one engine (KILN_VLLM_ENGINES)
            request_route.set(f"{inp.run_id}/{inp.group_index}/{info.activity_id}/{info.attempt}")
            if self.settings.engine == "vllm":
                _size_default_executor(self.settings.gpu_concurrency)
            adapter_dir = await asyncio.to_thread(self._adapter_dir, inp.adapter_ref)
            started = time.monotonic()
            result = await collect(
                inp,
                store=self.store,
                policy=policy,
                adapter_dir=adapter_dir,
                attempt=info.attempt,
                heartbeat=beat,
                should_cancel=activity.is_cancelled,
                credentials=self.settings.credentials,
            )
        except KilnError as err:
            # Leave the cause for the next attempt's interruption record.
            activity.heartbeat({"group_index": inp.group_index, "failed_with": err.code})
            raise
        finally:
            ticker.cancel()
        if info.attempt > 1 and isinstance(previous, dict) and previous.get("failed_with"):
            result.interruption_code = str(previous["failed_with"])
        result.worker = activity.client().identity
        await asyncio.to_thread(publish_group_figures, self.store, inp, result, time.monotonic() - started)
        return result

    @activity.defn(name="train_adapter")
    @kiln_errors
    def train_adapter(self, inp: TrainInput) -> TrainResult:
        from kiln.core.stages.training import train

        details = activity.info().heartbeat_details
        previous = details[-1] if details and isinstance(details[-1], dict) else {}
        resume = StoredObject.model_validate(previous["checkpoint"]) if previous.get("checkpoint") else None
        resume_step = previous.get("checkpoint_step") if resume is not None else None
        latest: dict[str, Any] = {"phase": "starting", "resumed_from_checkpoint": resume is not None}
        if resume is not None:
            latest.update(checkpoint=resume.model_dump(), checkpoint_step=resume_step)

        stream = open_train_stream(self.store, inp, home=self.settings.home)

        def beat(update: dict[str, Any]) -> None:
            latest.update(update)
            latest["phase"] = "training"
            activity.heartbeat(dict(latest))
            if "loss" in update:
                stream.step(update)

        activity.heartbeat(dict(latest))
        launch, placement = self._train_launch()
        if placement is not None:  # its own model (or ranks): no policy runtime, no shared base model
            device, dtype, lease = placement.device, placement.dtype, contextlib.nullcontext(None)
        else:
            with heartbeat_ticker(lambda: dict(latest)):  # a fresh worker's model load outlasts the timeout
                runtime = self.policy()
            device, dtype = runtime.device, runtime.dtype
            lease = runtime.training_lease() if self.settings.share_base_model else contextlib.nullcontext(None)
        with stream, heartbeat_ticker(lambda: dict(latest)), lease as shared_base:
            with tempfile.TemporaryDirectory(prefix="kiln-train-") as work:
                return train(
                    inp,
                    store=self.store,
                    model_path=self.model_path,
                    work_dir=Path(work),
                    cache_dir=self.cache_dir,
                    heartbeat=beat,
                    should_cancel=activity.is_cancelled,
                    resume_checkpoint=resume,
                    resume_step=resume_step,
                    device=device,
                    dtype=dtype,
                    shared_base=shared_base,
                    launch=launch,
                )

    def _train_launch(self) -> tuple[Any, Any]:
        """``(launch, placement)`` of this worker's training: the ranks of ``KILN_TRAIN_DEVICES``
        (None: one, in this process) and the device of a training that does not borrow the policy
        runtime's model (None: it does — one rank on a worker that also samples)."""
        if self.settings.train_devices == "1" and self.samples:
            return None, None
        from kiln.core.policy.device import resolve_placement
        from kiln.core.train.launch import launch_for

        placement = resolve_placement(self.settings.device, self.settings.dtype)
        launch = launch_for(
            self.settings.train_devices, placement.device, collective_timeout_s=self.settings.train_collective_timeout_s
        )
        return launch, placement if launch is not None or not self.samples else None

    @activity.defn(name="post_evaluate")
    @kiln_errors
    def post_evaluate(self, inp: PostEvalInput) -> PostEvalResult:
        """The installed static suite on the candidate (and the baseline), greedy, exact match.
        Heartbeats throughout (model load and every pass), so a killed worker is noticed in seconds."""
        with heartbeat_ticker(lambda: {"phase": "post_evaluation"}):
            return self._post_evaluate(inp)

    def _post_evaluate(self, inp: PostEvalInput) -> PostEvalResult:
        from kiln.core.evaluation.static_suite import evaluate_suite, load_suite, post_eval_outcome

        cases = load_suite(inp.suite)
        policy = self.policy()
        candidate = evaluate_suite(
            policy, cases, adapter_dir=self._adapter_dir(inp.candidate), thinking=inp.thinking, suite=inp.suite
        )
        baseline = None
        if inp.include_baseline:
            baseline = evaluate_suite(
                policy, cases, adapter_dir=self._adapter_dir(inp.baseline), thinking=inp.thinking, suite=inp.suite
            )
        outcome = post_eval_outcome(
            candidate, baseline, min_accuracy=inp.min_accuracy, owns_promotion=inp.owns_promotion
        )
        report = {
            "schema": "kiln.post-evaluation.v1",
            "suite": inp.suite,
            "min_accuracy": inp.min_accuracy,
            "owns_promotion": inp.owns_promotion,
            "candidate": candidate,
            "baseline": baseline,
            **outcome,
        }
        ref = self.store.put_blob(pretty_json(report))
        return PostEvalResult(
            gate_outcome=outcome["gate_outcome"],
            reason=outcome["reason"],
            candidate_accuracy=candidate["accuracy"],
            baseline_accuracy=baseline["accuracy"] if baseline else None,
            suite_sha256=candidate["suite_sha256"],
            report=StoredObject.of(ref),
        )

    @activity.defn(name="world_model_gain")
    @kiln_errors
    def world_model_gain(self, inp: WorldModelInput) -> WorldModelResult:
        """Observation cross-entropy of the base model vs the candidate on evaluation transcripts.
        Heartbeats throughout (both forward passes), so a killed worker is noticed in seconds."""
        with heartbeat_ticker(lambda: {"phase": "world_model_gain"}):
            return self._world_model_gain(inp)

    def _world_model_gain(self, inp: WorldModelInput) -> WorldModelResult:
        from kiln.core.evaluation.receipt import world_model_block
        from kiln.core.stages.training import load_group_lines
        from kiln.core.train.world_model import world_model_comparison

        lines = load_group_lines(self.store, inp.groups)
        adapter_dir = self._adapter_dir(inp.adapter_ref)
        assert adapter_dir is not None
        base, candidate = world_model_comparison(self.model_path, lines, adapter_dir=adapter_dir)
        return WorldModelResult(block=world_model_block(base, candidate, transcripts="candidate"))

    def all(self) -> list[Any]:
        return activity_methods(self)
