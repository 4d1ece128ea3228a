"""The activity options table: every activity is in it, a dead worker is noticed within a minute
at the default heartbeat timeout, every schedule-to-close leaves retry budget, and the table in
docs/durability.md says what the code does."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from temporalio import activity

from activities.control import ControlActivities
from activities.gpu import GpuActivities
from workflows.options import GROUP_HEARTBEAT, OPTIONS as BY_ACTIVITY

OPTIONS = {activity.__name__: options for activity, options in BY_ACTIVITY.items()}  # by activity name

DOC = Path(__file__).resolve().parents[2] / "docs" / "durability.md"


def _activity_names(cls: type) -> set[str]:
    names = set()
    for value in vars(cls).values():
        definition = activity._Definition.from_callable(value) if callable(value) else None
        if definition is not None and definition.name:
            names.add(definition.name)
    return names


def test_every_activity_has_options_and_nothing_else_does() -> None:
    assert _activity_names(ControlActivities) | _activity_names(GpuActivities) == set(OPTIONS)
    # keyed by the activity method itself (the caller's argument and result types come from it)
    assert BY_ACTIVITY[ControlActivities.admit_run] is OPTIONS["admit_run"]
    assert BY_ACTIVITY[GpuActivities.train_adapter].queue == "train"
    assert len(BY_ACTIVITY) == len(OPTIONS) == 16


def test_a_dead_worker_is_noticed_within_a_minute_at_the_default_heartbeat() -> None:
    bounds = {name: opts.recovery_bound(GROUP_HEARTBEAT) for name, opts in OPTIONS.items()}
    assert max(bounds.values()) <= timedelta(minutes=1), bounds
    # world_model_gain and post_evaluate once waited 12 h, index_groups 30 min.
    for name in ("world_model_gain", "post_evaluate", "index_groups", "train_adapter", "collect_group"):
        assert OPTIONS[name].heartbeat, name


def test_whatever_may_run_over_a_minute_heartbeats() -> None:
    for name, opts in OPTIONS.items():
        assert opts.heartbeat or opts.start_to_close <= timedelta(seconds=15), name


def test_every_schedule_to_close_leaves_retry_budget() -> None:
    for name, opts in OPTIONS.items():
        assert opts.retry_budget_ok(), name
        assert opts.schedule_to_close > opts.start_to_close, name


def test_the_retry_budget_rule_rejects_a_budget_equal_to_one_attempt() -> None:
    from dataclasses import replace

    opts = OPTIONS["index_groups"]
    assert not replace(opts, schedule_to_close=opts.start_to_close).retry_budget_ok()
    train = OPTIONS["train_adapter"]
    assert not replace(train, schedule_to_close=train.start_to_close * 3).retry_budget_ok()


def _human(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


def test_the_documented_options_table_matches_the_code() -> None:
    text = DOC.read_text()
    for name, opts in OPTIONS.items():
        attempts = opts.retry.maximum_attempts or "unlimited"
        row = (
            f"| `{name}` | {opts.queue} | {_human(opts.start_to_close)} | {_human(opts.schedule_to_close)} "
            f"| {attempts} | {'yes' if opts.heartbeat else 'no'} | {_human(opts.recovery_bound(GROUP_HEARTBEAT))} |"
        )
        assert row in text, row
