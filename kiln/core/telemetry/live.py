"""The live metrics stream of a run: written to S3 by the gpu worker as the run goes.

Layout under ``runs/<run_id>/live/`` (mutable keys, one writer each):

- ``progress.json``: the latest training step (the API merges it into the run's status);
- ``train.jsonl``: every training step so far, one JSON object a line;
- ``groups/<label>-<group_index>.json``: one group's figures, written when the group is stored;
- ``iterations/<k>.json``: one online-RL iteration's row of the learning curve (kind ``iteration``:
  mean return, invalid-action rate, loss, KL, held-out return when evaluated).

Writes of the training stream are throttled to one every ``interval_s`` (0.5 s by default) and
always flushed at the end, so a status read sees a step within about a second of it happening.
The published ``metrics.jsonl`` artifact is :func:`metrics_jsonl` at publication time. These
figures carry wall-clock values (tokens/s, latency): they are never part of a digest.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable, Iterable

METRICS_SCHEMA = "kiln.run-metrics.v1"
STEP_FIELDS = (
    "loss",
    "policy_loss",
    "env_ce",
    "kl",
    "clip_fraction",
    "grad_norm",
    "learning_rate",
    "tokens_per_s",
)
GROUP_FIELDS = ("mean_return", "invalid_action_rate", "episode_latency_ms")


def live_prefix(run_id: str) -> str:
    return f"runs/{run_id}/live/"


def progress_key(run_id: str) -> str:
    return live_prefix(run_id) + "progress.json"


def train_key(run_id: str) -> str:
    return live_prefix(run_id) + "train.jsonl"


def group_key(run_id: str, label: str, group_index: int) -> str:
    slug = "".join(ch if ch.isalnum() else "_" for ch in label)
    return live_prefix(run_id) + f"groups/{slug}-{group_index:06d}.json"


def iteration_row_key(run_id: str, iteration: int) -> str:
    return live_prefix(run_id) + f"iterations/{iteration:06d}.json"


def _clean(value: Any) -> Any:
    """JSON-safe numbers: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps({k: _clean(v) for k, v in obj.items()}, sort_keys=True).encode("utf-8")


def step_event(details: dict[str, Any], *, learning_rate: float | None) -> dict[str, Any]:
    """One training step's figures from the trainer's progress callback."""
    event: dict[str, Any] = {"kind": "train_step", "step": int(details["step"])}
    event["total_steps"] = details.get("total_steps")
    for name in STEP_FIELDS:
        event[name] = details.get(name)
    if event["learning_rate"] is None:
        event["learning_rate"] = learning_rate
    event["time"] = time.time()
    return event


def group_event(
    *,
    label: str,
    group_index: int,
    seed: int,
    returns: list[float],
    steps: int,
    invalid_actions: int,
    wall_s: float,
    concurrency: int,
) -> dict[str, Any]:
    """One stored group's figures: mean return, invalid-action rate, episode latency.

    Invalid-action rate = episodes ended by an invalid model action per action taken. Episode
    latency = the group's wall time per wave of ``concurrency`` episodes (episodes of a wave run
    side by side).
    """
    waves = max(1, math.ceil(len(returns) / max(1, concurrency)))
    return {
        "kind": "group",
        "label": label,
        "group_index": group_index,
        "seed": seed,
        "episodes": len(returns),
        "steps": steps,
        "mean_return": sum(returns) / len(returns) if returns else None,
        "invalid_action_rate": invalid_actions / max(1, steps + invalid_actions),
        "episode_latency_ms": round(wall_s * 1000.0 / waves, 3),
        "time": time.time(),
    }


class TrainStream:
    """Training steps of one run → ``train.jsonl`` + ``progress.json`` (throttled), plus sinks.

    ``sinks`` (e.g. a tracker) receive every event unthrottled. A failing S3 write never fails
    training: the stream is best effort; the receipt stays the record of truth.
    """

    def __init__(
        self,
        store: Any,
        run_id: str,
        *,
        interval_s: float = 0.5,
        sinks: Iterable[Callable[[dict[str, Any]], None]] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.interval_s = interval_s
        self.sinks = list(sinks)
        self._clock = clock
        # A retried attempt keeps the steps its predecessor streamed (readers keep the last line
        # of each step, so re-run steps replace the old ones).
        self._lines: list[bytes] = self._previous_lines()
        self._latest: dict[str, Any] | None = None
        self._flushed_at = -math.inf
        self._lock = threading.Lock()
        self.write_errors = 0

    def _previous_lines(self) -> list[bytes]:
        try:
            raw = self.store.get_key(train_key(self.run_id)) or b""
        except Exception:  # noqa: BLE001 - best effort
            return []
        return [line for line in raw.splitlines() if line.strip()]

    def emit(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._lines.append(_line(event))
            self._latest = event
            due = self._clock() - self._flushed_at >= self.interval_s
        for sink in self.sinks:
            sink(event)
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._latest is None:
                return
            body = b"\n".join(self._lines) + b"\n"
            latest = _line({**self._latest, "lines": len(self._lines)})
            self._flushed_at = self._clock()
        try:
            self.store.put_key(train_key(self.run_id), body, action="put live metrics")
            self.store.put_key(progress_key(self.run_id), latest, action="put live progress")
        except Exception:  # noqa: BLE001 - the stream is best effort
            self.write_errors += 1


def put_group(store: Any, run_id: str, event: dict[str, Any]) -> None:
    """Store one group's figures (idempotent: a retried group overwrites its own key)."""
    try:
        store.put_key(group_key(run_id, event["label"], event["group_index"]), _line(event), action="put live group")
    except Exception:  # noqa: BLE001 - best effort, never fails collection
        pass


def put_iteration(store: Any, run_id: str, row: dict[str, Any]) -> None:
    """Store one iteration's curve row (idempotent: a retried store overwrites its own key)."""
    try:
        store.put_key(iteration_row_key(run_id, int(row["iteration"])), _line(row), action="put live iteration")
    except Exception:  # noqa: BLE001 - best effort, like every live figure
        pass


def read_progress(store: Any, run_id: str) -> dict[str, Any] | None:
    """The latest training step of ``run_id``, or None."""
    raw = store.get_key(progress_key(run_id))
    return json.loads(raw) if raw else None


def read_events(store: Any, run_id: str) -> list[dict[str, Any]]:
    """Every event of the run: groups (by label, index), training steps (by iteration, step), then
    the iterations' curve rows (by iteration)."""
    groups = [json.loads(raw) for raw in store.get_keys(store.list_keys(live_prefix(run_id) + "groups/")) if raw]
    groups.sort(key=lambda e: (e.get("label") != "group", e.get("label", ""), e.get("group_index", 0)))
    raw = store.get_key(train_key(run_id)) or b""
    steps = [json.loads(line) for line in raw.splitlines() if line.strip()]
    # A resumed attempt re-emits steps: the last line of each (iteration, step) wins.
    by_step = {(int(e.get("iteration") or 1), int(e["step"])): e for e in steps}
    rows = [json.loads(raw) for raw in store.get_keys(store.list_keys(live_prefix(run_id) + "iterations/")) if raw]
    rows.sort(key=lambda e: e["iteration"])
    return groups + [by_step[s] for s in sorted(by_step)] + rows


def metrics_jsonl(store: Any, run_id: str) -> bytes:
    """The ``metrics.jsonl`` artifact: a header line, then every event."""
    lines = [_line({"schema": METRICS_SCHEMA, "run_id": run_id})]
    lines.extend(_line(event) for event in read_events(store, run_id))
    return b"\n".join(lines) + b"\n"
