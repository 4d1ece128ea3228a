"""Fault injection: the hook folder the test process writes and the worker processes read.

:class:`FaultHooks` slows (never alters) work so a fault can land at a chosen point — a delay per
sampling step, a delay per training step, a hold before publication — plus one-shot failures, and
logs, as JSON lines, every collection attempt, training step/checkpoint/attempt and publication
attempt with the worker's pid, so a test can count exactly what was re-done.
:func:`install_hooks` wraps a worker's activity bodies with those hook points; with no hook file
present the workers behave exactly like ``python -m workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

HOOKS_ENV = "KILN_CHAOS_DIR"

# Hook file names (values are decimal seconds unless noted).
SAMPLE_DELAY = "sample_delay_s"  # sleep before every policy.sample call (collection steps)
TRAIN_STEP_DELAY = "train_step_delay_s"  # sleep after every training step's progress heartbeat
PUBLISH_HOLD = "publish_hold"  # while this file exists, publish_run waits before doing anything
PUBLISH_HOLD_AFTER = "publish_hold_after"  # ... waits after its commit point (manifest written)
REVALIDATE_HOLD = "revalidate_hold"  # while this file exists, revalidation waits (heartbeating)
# One-shot faults (the worker deletes the file when it fires):
TRAIN_FAIL_NOW = "train_fail_now"  # the next training step's heartbeat raises a transient error
TRAIN_FAIL_RESUMED = "train_fail_resumed"  # a resumed training attempt fails right after starting
TRAIN_SETUP_DELAY = "train_setup_delay_s"  # the next training attempt sleeps this long before setup
POLICY_LOAD_DELAY = "policy_load_delay_s"  # the next collect_group's policy load sleeps this long
TRAIN_LOAD_DELAY = "train_load_delay_s"  # the next train_adapter's policy (model) load sleeps this long
# Holds the first attempt of the activity type the file names, at its start, heartbeating, while
# the file still names it (the chaos matrix kills the worker there):
PARK_ACTIVITY = "park_activity"
# Per-run holds, one ``KIND RUN_ID`` a line: KIND is an activity type (its first attempt of that run
# is held at its start, as ``park_activity`` does) or ``train_step`` (that run's training waits after
# its first step's heartbeat); each holds, heartbeating, while its line is in the file.
HOLDS = "holds"
TRAIN_STEP_HOLD = "train_step"
EVENTS = "events.jsonl"

PUBLISH_HOLD_MAX_S = 120.0
HOLD_MAX_S = 600.0


class FaultHooks:
    """The hook folder shared by the test process and the worker processes."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- knobs (test side)
    def set(self, name: str, value: object = "") -> None:
        tmp = self.directory / f".{name}.tmp"
        tmp.write_text(str(value))
        tmp.replace(self.directory / name)

    def clear(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / name).unlink()

    def clear_all(self) -> None:
        for name in (SAMPLE_DELAY, TRAIN_STEP_DELAY, PUBLISH_HOLD, PUBLISH_HOLD_AFTER, REVALIDATE_HOLD, TRAIN_FAIL_NOW, TRAIN_FAIL_RESUMED,
                     TRAIN_SETUP_DELAY, POLICY_LOAD_DELAY, TRAIN_LOAD_DELAY, PARK_ACTIVITY, HOLDS):
            self.clear(name)

    def hold(self, holds: list[tuple[str, str]]) -> None:
        """Set the per-run holds (``(KIND, RUN_ID)`` pairs); an empty list releases every one."""
        self.set(HOLDS, "".join(f"{kind} {run_id}\n" for kind, run_id in holds))

    def held(self, kind: str, run_id: str) -> bool:
        """Whether ``run_id``'s ``kind`` is held now (worker side)."""
        return f"{kind} {run_id}" in (self.text(HOLDS) or "").splitlines()

    @contextlib.contextmanager
    def knob(self, name: str, value: object = "") -> Iterator[None]:
        self.set(name, value)
        try:
            yield
        finally:
            self.clear(name)

    # ---------------------------------------------------------------- knobs (worker side)
    def present(self, name: str) -> bool:
        return (self.directory / name).exists()

    def fire(self, name: str) -> str | None:
        """Consume a one-shot hook: its content when it was set (and is now removed), else None."""
        path = self.directory / name
        try:
            value = path.read_text()
            path.unlink()
        except FileNotFoundError:
            return None
        return value

    def text(self, name: str) -> str | None:
        try:
            return (self.directory / name).read_text().strip()
        except OSError:
            return None

    def number(self, name: str) -> float:
        try:
            return float((self.directory / name).read_text().strip() or 0.0)
        except (OSError, ValueError):
            return 0.0

    # ---------------------------------------------------------------- events
    def log(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": event, **fields}) + "\n"
        fd = os.open(self.directory / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Logged events (optionally of one kind and matching ``field=value`` pairs), in order."""
        try:
            lines = (self.directory / EVENTS).read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                item = json.loads(line)
            except ValueError:  # a line being written right now
                continue
            if event is not None and item.get("event") != event:
                continue
            if all(item.get(k) == v for k, v in match.items()):
                out.append(item)
        return out


def _activity_attempt() -> int | None:
    try:
        from temporalio import activity

        return activity.info().attempt
    except Exception:  # noqa: BLE001 - outside an activity
        return None


def _activity_type() -> str | None:
    try:
        from temporalio import activity

        return activity.info().activity_type
    except Exception:  # noqa: BLE001 - outside an activity
        return None


class _SlowSampling:
    """Delegates to the worker's policy; sleeps ``sample_delay_s`` before each ``sample``."""

    def __init__(self, inner: Any, hooks: FaultHooks) -> None:
        self._inner = inner
        self._hooks = hooks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        delay = self._hooks.number(SAMPLE_DELAY)
        if delay > 0:
            time.sleep(delay)
        return self._inner.sample(*args, **kwargs)


def install_hooks(role: str, hooks: FaultHooks) -> None:
    """Wrap the worker's activity bodies with the hook points (see the module docstring)."""
    _hook_activity_starts(hooks)
    if role in ("gpu", "all"):
        import kiln.core.policy.runtime  # noqa: F401 - import torch before polling: "ready" means ready

        _hook_collection(hooks)
        _hook_training(hooks)
    if role in ("control", "all"):
        _hook_publication(hooks)
        _hook_revalidation(hooks)


def _hook_activity_starts(hooks: FaultHooks) -> None:
    """Log every activity attempt's start (``activity_start``: type, attempt, run); hold the first
    attempt of the type ``park_activity`` names (``activity_parked``) until the file names another
    type or is gone, heartbeating meanwhile so only a dead worker ends the hold. Installed as a
    worker interceptor on every worker the process builds."""
    from temporalio import activity
    from temporalio.worker import ActivityInboundInterceptor, Interceptor

    import workers.factory as factory

    class Inbound(ActivityInboundInterceptor):
        async def execute_activity(self, input: Any) -> Any:
            info = activity.info()
            kind, run_id = info.activity_type, info.workflow_id
            hooks.log("activity_start", run_id=run_id, type=kind, attempt=info.attempt)
            if info.attempt == 1 and hooks.text(PARK_ACTIVITY) == kind:
                hooks.log("activity_parked", run_id=run_id, type=kind, attempt=info.attempt)
                deadline = time.monotonic() + PUBLISH_HOLD_MAX_S
                while hooks.text(PARK_ACTIVITY) == kind and time.monotonic() < deadline:
                    activity.heartbeat({"parked": kind})
                    await asyncio.sleep(0.1)
            if info.attempt == 1 and hooks.held(kind, run_id):
                hooks.log("activity_parked", run_id=run_id, type=kind, attempt=info.attempt)
                deadline = time.monotonic() + HOLD_MAX_S
                while hooks.held(kind, run_id) and time.monotonic() < deadline:
                    activity.heartbeat({"parked": kind})
                    await asyncio.sleep(0.1)
                hooks.log("activity_released", run_id=run_id, type=kind, attempt=info.attempt)
            return await super().execute_activity(input)

    class Parking(Interceptor):
        def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
            return Inbound(next)

    original = factory.Worker

    def worker(*args: Any, **kwargs: Any) -> Any:
        kwargs["interceptors"] = [*kwargs.get("interceptors", ()), Parking()]
        return original(*args, **kwargs)

    factory.Worker = worker  # type: ignore[misc]


def _hook_collection(hooks: FaultHooks) -> None:
    """Log every collection attempt; slow each policy ``sample`` by ``sample_delay_s``, and the
    next policy load of a collect_group (``policy_load_delay_s``) or of a train_adapter
    (``train_load_delay_s``)."""
    import activities.gpu as gpu_mod

    original_collect = gpu_mod.collect

    async def collect(inp: Any, *args: Any, **kwargs: Any) -> Any:
        attempt = kwargs.get("attempt")
        hooks.log("collect_start", run_id=inp.run_id, group_index=inp.group_index, attempt=attempt)
        try:
            result = await original_collect(inp, *args, **kwargs)
        except BaseException as exc:
            hooks.log("collect_end", run_id=inp.run_id, group_index=inp.group_index,
                      attempt=attempt, outcome=f"error:{type(exc).__name__}")
            raise
        hooks.log("collect_end", run_id=inp.run_id, group_index=inp.group_index,
                  attempt=attempt, outcome="ok", group_sha256=result.group.sha256)
        return result

    gpu_mod.collect = collect

    original_policy = gpu_mod.GpuActivities.policy

    def policy(self: Any) -> Any:
        knob = {"collect_group": POLICY_LOAD_DELAY, "train_adapter": TRAIN_LOAD_DELAY}.get(_activity_type() or "")
        load_delay = hooks.fire(knob) if knob else None
        if load_delay:
            time.sleep(float(load_delay))
        return _SlowSampling(original_policy(self), hooks)

    gpu_mod.GpuActivities.policy = policy  # type: ignore[method-assign]


def _hook_training(hooks: FaultHooks) -> None:
    """Log training steps/checkpoints/attempts; inject the one-shot training faults and delays."""
    import kiln.core.stages.training as training_mod

    original_train = training_mod.train

    def train(inp: Any, *args: Any, **kwargs: Any) -> Any:
        attempt = _activity_attempt()
        run_id = inp.run_id
        beat = kwargs["heartbeat"]

        def heartbeat(details: dict[str, Any]) -> None:
            beat(details)
            if "step" in details and hooks.fire(TRAIN_FAIL_NOW) is not None:
                hooks.log("train_injected_failure", run_id=run_id, attempt=attempt, step=details["step"])
                raise RuntimeError(f"chaos: injected transient failure after step {details['step']}")
            if "step" in details:
                hooks.log("train_step", run_id=run_id, attempt=attempt, step=details["step"],
                          total_steps=details.get("total_steps"))
                delay = hooks.number(TRAIN_STEP_DELAY)
                if delay > 0:
                    time.sleep(delay)
                if hooks.held(TRAIN_STEP_HOLD, run_id):
                    hooks.log("train_held", run_id=run_id, attempt=attempt, step=details["step"])
                    deadline = time.monotonic() + HOLD_MAX_S
                    while hooks.held(TRAIN_STEP_HOLD, run_id) and time.monotonic() < deadline:
                        time.sleep(0.1)  # the activity's heartbeat ticker keeps it alive
                    hooks.log("train_released", run_id=run_id, attempt=attempt, step=details["step"])
            elif "checkpoint_step" in details:
                hooks.log("train_checkpoint", run_id=run_id, attempt=attempt,
                          step=details["checkpoint_step"])

        kwargs["heartbeat"] = heartbeat
        resume = kwargs.get("resume_checkpoint")
        hooks.log("train_start", run_id=run_id, attempt=attempt, resumed=resume is not None)
        try:
            if resume is not None and hooks.fire(TRAIN_FAIL_RESUMED) is not None:
                raise RuntimeError("chaos: injected transient failure of a resumed attempt")
            setup_delay = hooks.fire(TRAIN_SETUP_DELAY)
            if setup_delay:
                time.sleep(float(setup_delay))
            result = original_train(inp, *args, **kwargs)
        except BaseException as exc:
            hooks.log("train_end", run_id=run_id, attempt=attempt, outcome=f"error:{type(exc).__name__}")
            raise
        hooks.log("train_end", run_id=run_id, attempt=attempt, outcome="ok",
                  steps=result.steps, adapter_sha256=result.adapter_sha256)
        return result

    training_mod.train = train


def _hook_revalidation(hooks: FaultHooks) -> None:
    """Hold revalidation while ``revalidate_hold`` exists (the activity heartbeats meanwhile, so a
    cancel reaches it); log when it starts holding."""
    import activities.control as control_mod

    original_revalidate = control_mod.revalidate

    async def revalidate(store: Any, inp: Any, *args: Any, **kwargs: Any) -> Any:
        if hooks.present(REVALIDATE_HOLD):
            hooks.log("revalidate_held", run_id=inp.run_id)
            deadline = time.monotonic() + PUBLISH_HOLD_MAX_S
            while hooks.present(REVALIDATE_HOLD) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return await original_revalidate(store, inp, *args, **kwargs)

    control_mod.revalidate = revalidate


def _hook_publication(hooks: FaultHooks) -> None:
    """Log every publication attempt; hold it while ``publish_hold`` exists."""
    import activities.control as control_mod

    original_publish = control_mod.publish

    def publish(store: Any, inp: Any, *args: Any, **kwargs: Any) -> Any:
        attempt = _activity_attempt()
        hooks.log("publish_start", run_id=inp.run_id, attempt=attempt)
        deadline = time.monotonic() + PUBLISH_HOLD_MAX_S
        while hooks.present(PUBLISH_HOLD) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            result = original_publish(store, inp, *args, **kwargs)
        except BaseException as exc:
            hooks.log("publish_end", run_id=inp.run_id, attempt=attempt, outcome=f"error:{type(exc).__name__}")
            raise
        hooks.log("publish_end", run_id=inp.run_id, attempt=attempt, outcome="ok")
        while hooks.present(PUBLISH_HOLD_AFTER) and time.monotonic() < deadline + PUBLISH_HOLD_MAX_S:
            time.sleep(0.05)
        return result

    control_mod.publish = publish
