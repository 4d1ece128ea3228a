"""Trackers read back offline (TensorBoard, trackio, wandb), group figures, episode rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from api.page_data import episode_rows, page, split_reasoning
from kiln.core.errors import TrackerUnavailable
from kiln.core.telemetry.live import group_event
from kiln.core.telemetry.trackers import open_tracker, scalars_of

ROOT = Path(__file__).resolve().parents[2]
EVENTS = [
    {"kind": "group", "label": "group", "group_index": 0, "mean_return": 0.5, "invalid_action_rate": 0.25,
     "episode_latency_ms": 12.0},
    {"kind": "group", "label": "group", "group_index": 1, "mean_return": 1.5, "invalid_action_rate": 0.0,
     "episode_latency_ms": 10.0},
    *({"kind": "train_step", "step": s, "loss": 1.0 / s, "policy_loss": -0.1 * s, "env_ce": 3.0, "kl": 0.01 * s,
       "clip_fraction": 0.0, "grad_norm": 0.5, "learning_rate": 1e-4, "tokens_per_s": 100.0 * s}
      for s in range(1, 6)),
]


def test_group_figures() -> None:
    event = group_event(label="group", group_index=3, seed=7, returns=[1.0, 0.0, 2.0, 1.0], steps=10,
                        invalid_actions=2, wall_s=1.5, concurrency=2)
    assert event["mean_return"] == 1.0 and event["episodes"] == 4
    assert event["invalid_action_rate"] == 2 / 12
    assert event["episode_latency_ms"] == 750.0  # two waves of two episodes in 1.5 s
    assert scalars_of(event) == (3, {"group/mean_return": 1.0, "group/invalid_action_rate": 2 / 12,
                                     "group/episode_latency_ms": 750.0})


@pytest.mark.timeout(60)
def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = open_tracker("tensorboard", run_id="tb-run", home=tmp_path, config={})
    for event in EVENTS:
        tracker.log(event)
    tracker.close()
    acc = EventAccumulator(str(tmp_path / "trackers" / "tb-run" / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert [e.value for e in loss] == pytest.approx([1.0 / s for s in range(1, 6)])
    assert [e.value for e in acc.Scalars("train/tokens_per_s")] == [100.0, 200.0, 300.0, 400.0, 500.0]
    assert [(e.step, e.value) for e in acc.Scalars("group/mean_return")] == [(0, 0.5), (1, 1.5)]


@pytest.mark.timeout(120)
def test_trackio_and_wandb_offline_read_back(tmp_path: Path) -> None:
    """In a child process (trackio reads TRACKIO_DIR at import; wandb starts its own service)."""
    script = f"""
import json, os
from pathlib import Path
from kiln.core.telemetry.trackers import open_tracker
events = json.loads({json.dumps(json.dumps(EVENTS))})
for kind in ("trackio", "wandb"):
    tracker = open_tracker(kind, run_id=kind + "-run", home=Path({str(tmp_path)!r}), config={{"epochs": 1}})
    for event in events:
        tracker.log(event)
    tracker.close()
from trackio.sqlite_storage import SQLiteStorage
print("LOGS " + json.dumps(SQLiteStorage.get_logs("kiln", "trackio-run")))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_MODE": "offline"}
    env.pop("WANDB_API_KEY", None)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    logs = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("LOGS "))[5:])
    losses = [(row["step"], row["train/loss"]) for row in logs if "train/loss" in row]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5]
    assert [value for _, value in losses] == pytest.approx([1.0 / s for s in range(1, 6)])
    rewards = [row["group/mean_return"] for row in logs if "group/mean_return" in row]
    assert rewards == [0.5, 1.5]
    # wandb offline: one run file under the run's tracker folder, holding the logged keys.
    runs = list((tmp_path / "trackers" / "wandb-run" / "wandb").glob("offline-run-*/run-wandb-run.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()
    assert b"train/loss" in data and b"group/mean_return" in data and b"train/kl" in data


def test_unknown_tracker_is_a_kiln_error(tmp_path: Path) -> None:
    assert open_tracker("none", run_id="x", home=tmp_path, config={}) is None
    with pytest.raises(TrackerUnavailable) as err:
        open_tracker("mlflow", run_id="x", home=tmp_path, config={})
    assert err.value.code == "tracker_unavailable"


def test_reasoning_split_and_episode_paging() -> None:
    assert split_reasoning("<think>count is 3\nneed 8</think>\n{\"amount\": 5}") == ("count is 3\nneed 8", '{"amount": 5}')
    assert split_reasoning('{"amount": 1}') == ("", '{"amount": 1}')
    rollouts = json.dumps({"messages": [], "completions": [
        {"trajectory": [{"kind": "action", "content": "<think>go</think>{\"amount\":2}"},
                        {"kind": "observation", "content": "Count is 2"}]}]}).encode()
    replay = json.dumps({"groups": [{"group_index": 0, "seed": 9,
                                     "reset_observation": {"observation": {"count": 0}, "reward": None, "done": False},
                                     "candidates": [
        {"candidate_index": 0, "episode_return": 1.0, "termination": "done", "exchanges": [
            {"action": {"amount": 2}, "result": {"kind": "observation",
                                                  "observation": {"observation": {"count": 2}, "reward": 1.0}}}]}]}]}).encode()
    rows = episode_rows(rollouts, replay)
    assert rows == [{"group_index": 0, "candidate_index": 0, "seed": 9, "reset_observation": '{"count":0}',
                     "episode_return": 1.0, "termination": "done",
                     "turns": [{"turn": 1, "observation": '{"count":2}', "reasoning": "go",
                                "action": '{"amount":2}', "reward": 1.0}]}]
    assert page(rows * 7, 5, 5)["episodes"] == rows * 2 and page(rows * 7, 5, 5)["total"] == 7
