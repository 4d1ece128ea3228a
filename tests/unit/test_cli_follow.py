"""``--follow`` when stdout is not a terminal: one plain line per event, 4 significant digits."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kiln.cli.control_cmds import runs_header, runs_row
from kiln.cli.follow import follow, num, print_outcome, progress_line, progress_view

DIGEST = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"


def _status(phase: str, groups: int, state: str = "running", **extra: object) -> dict:
    return {"run_id": "r1", "state": state, "phase": phase,
            "progress": {"groups_completed": groups, "groups_total": 2, "rollouts_completed": 2 * groups,
                         "rollouts_total": 4}, **extra}


def test_number_format() -> None:
    assert num(0.45233768224716187) == "0.4523"
    assert num(1234567.0) == "1.235e+06"
    assert num(3) == "3" and num(None) == "-" and num(2.5) == "2.5"


@pytest.mark.timeout(30)
def test_follow_prints_one_line_per_event_when_not_a_terminal() -> None:
    sequence = [
        _status("collecting", 0),
        _status("collecting", 0),  # no change: no line
        _status("collecting", 1, mean_return=0.6666666),
        _status("training", 2, mean_return=0.75, training_progress={"step": 3, "total_steps": 8, "loss": 0.45233768224716187, "kl": 0.0, "env_ce": 11.123456}),
        _status("completed", 2, state="completed", mean_return=0.75),
    ]
    calls = iter(sequence)
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    final = follow(lambda: next(calls), console, poll_s=0.0)
    assert final["state"] == "completed"
    lines = out.getvalue().splitlines()
    assert lines == [
        "phase=collecting  groups=0/2  episodes=0/4",
        "phase=collecting  groups=1/2  episodes=2/4  mean_return=0.6667",
        "phase=training  groups=2/2  episodes=4/4  mean_return=0.75  train_step=3/8  loss=0.4523  kl=0  env_ce=11.12",
        "phase=completed  groups=2/2  episodes=4/4  mean_return=0.75",
    ]


def test_outcome_has_no_highlighting_and_short_numbers() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, highlight=False, width=200)
    status = _status("completed", 2, state="completed", mean_return=0.75,
                     training={"trained": True, "steps": 8, "final_loss": 0.45233768224716187, "adapter_sha256": DIGEST})
    assert print_outcome(status, console) == 0
    text = out.getvalue()
    assert "final loss 0.4523," in text
    assert DIGEST in text  # printed whole, not split by colour codes
    assert "\x1b[1;36m" not in text and "\x1b[32m" not in text  # rich's number/string highlighter


def test_runs_table_has_a_header_and_adapter_and_mean_return() -> None:
    header = runs_header()
    assert header.split() == ["RUN", "STATE", "KIND", "PHASE", "ADAPTER", "MEAN", "RETURN", "PROMOTED", "STARTED"]
    row = runs_row({"run_id": "0" * 36, "state": "completed", "kind": "train", "phase": "completed",
                    "output_adapter": "counter-agent", "mean_return": 2.6666666, "promoted": True,
                    "started_at": "2026-12-01T00:00:00+00:00"})
    assert row.split() == ["0" * 36, "completed", "train", "counter-agent", "2.667", "yes", "2026-12-01T00:00:00+00:00"]
    running = runs_row({"run_id": "1" * 36, "state": "running", "kind": "rollout", "phase": "collecting"})
    assert running.split()[:4] == ["1" * 36, "running", "rollout", "collecting"]
    assert len(header) == len(row) - len("2026-12-01T00:00:00+00:00") + len("STARTED")


def test_online_runs_show_the_iteration_and_the_curve() -> None:
    status = _status("training", 8, mean_return=3.5, iteration=3, iterations_total=4,
                     iterations=[{"iteration": 1, "mean_return": 2.4375}, {"iteration": 2, "mean_return": 3.125}])
    assert progress_line(status).startswith("phase=training  iteration=3/4  groups=8/")
    out = io.StringIO()
    Console(file=out, force_terminal=False, width=200).print(progress_view(status))
    assert "3/4  returns 2.438 → 3.125" in out.getvalue()
