"""Experiment trackers on the gpu worker: ``report_to = none | tensorboard | trackio | wandb``.

Each tracker receives the run's metric events (groups first, then training steps) and writes
them locally, fully offline:

- ``tensorboard``: event files under ``<KILN_HOME>/trackers/<run_id>/tensorboard`` (written with
  tensorboard's own event writer and protos, no TensorFlow or torch needed);
- ``trackio``: project ``kiln``, run name = run id, in trackio's local database under
  ``$TRACKIO_DIR`` (default ``<KILN_HOME>/trackio``);
- ``wandb``: offline mode (``WANDB_MODE=offline``), files under ``<KILN_HOME>/trackers/<run_id>``;
  sync later with ``wandb sync``.

Tracker packages are imported here only, when a run asks for one. A tracker that cannot start
raises ``TrackerUnavailable`` (code ``tracker_unavailable``) before training begins.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

from kiln.core.errors import TrackerUnavailable

REPORT_TO = ("none", "tensorboard", "trackio", "wandb")
STEP_TAGS = ("loss", "policy_loss", "env_ce", "kl", "clip_fraction", "grad_norm", "learning_rate", "tokens_per_s")
GROUP_TAGS = ("mean_return", "invalid_action_rate", "episode_latency_ms")


class Tracker(Protocol):
    def log(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars_of(event: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(step, {tag: value}) of one event; groups log under ``group/``, steps under ``train/``."""
    if event.get("kind") == "group":
        prefix = "group" if event.get("label") == "group" else str(event.get("label", "eval")).replace(" ", "_")
        values = {f"{prefix}/{t}": event.get(t) for t in GROUP_TAGS}
        step = int(event.get("group_index", 0))
    else:
        values = {f"train/{t}": event.get(t) for t in STEP_TAGS}
        step = int(event.get("step", 0))
    return step, {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


class TensorBoardTracker:
    def __init__(self, log_dir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = EventFileWriter(str(log_dir))

    def log(self, event: dict[str, Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        step, values = scalars_of(event)
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()]
        )
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class TrackioTracker:
    def __init__(self, run_id: str, config: dict[str, Any]) -> None:
        import trackio

        self._run = trackio.init(
            project="kiln", name=run_id, config=config, embed=False, auto_log_gpu=False, auto_log_cpu=False
        )

    def log(self, event: dict[str, Any]) -> None:
        step, values = scalars_of(event)
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class WandbTracker:
    def __init__(self, run_id: str, log_dir: Path, config: dict[str, Any]) -> None:
        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._run = wandb.init(
            mode="offline", project="kiln", name=run_id, id=run_id, dir=str(log_dir), config=config, reinit="create_new"
        )

    def log(self, event: dict[str, Any]) -> None:
        _step, values = scalars_of(event)
        self._run.log(values)

    def close(self) -> None:
        self._run.finish()


def tracker_dir(home: Path, run_id: str) -> Path:
    return Path(home) / "trackers" / run_id


def open_tracker(report_to: str, *, run_id: str, home: Path, config: dict[str, Any]) -> Tracker | None:
    """The tracker a run asked for (None for ``none``); ``TrackerUnavailable`` if it can't start."""
    if report_to == "none":
        return None
    if report_to not in REPORT_TO:
        raise TrackerUnavailable(f"report_to {report_to!r} is not one of {', '.join(REPORT_TO)}")
    os.environ.setdefault("TRACKIO_DIR", str(Path(home) / "trackio"))
    try:
        if report_to == "tensorboard":
            return TensorBoardTracker(tracker_dir(home, run_id) / "tensorboard")
        if report_to == "trackio":
            return TrackioTracker(run_id, config)
        return WandbTracker(run_id, tracker_dir(home, run_id), config)
    except ImportError as err:
        raise TrackerUnavailable(
            f"report_to {report_to!r} needs the {report_to} package on the gpu worker",
            hint="pip install 'kiln[trackers]' on the gpu workers",
        ) from err
