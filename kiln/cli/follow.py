"""Follow a run until it ends, with a live progress line; the exit code tells the outcome."""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console

TERMINAL = {"completed", "failed", "cancelled"}
EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 3}


def progress_line(status: dict[str, Any]) -> str:
    progress = status.get("progress") or {}
    mean = status.get("mean_return")
    parts = [
        f"phase={status.get('phase')}",
        f"groups={progress.get('groups_completed', 0)}/{progress.get('groups_total', 0)}",
        f"episodes={progress.get('rollouts_completed', 0)}/{progress.get('rollouts_total', 0)}",
    ]
    if mean is not None:
        parts.append(f"mean_return={mean:.3f}")
    training = status.get("training") or {}
    if training.get("steps"):
        parts.append(f"train_steps={training['steps']}")
    return "  ".join(parts)


def follow(
    fetch: Callable[[], dict[str, Any]],
    console: Console,
    *,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    started = time.monotonic()
    last = ""
    with console.status("waiting for the run…") as spinner:
        while True:
            status = fetch()
            line = progress_line(status)
            if line != last:
                spinner.update(line)
                last = line
            if status.get("state") in TERMINAL:
                return status
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                return status
            time.sleep(poll_s)


def print_outcome(status: dict[str, Any], console: Console) -> int:
    state = status.get("state")
    console.print(f"run      {status.get('run_id')}")
    if status.get("temporal_ui"):
        console.print(f"web ui   {status['temporal_ui']}")
    console.print(f"state    {state}")
    stats = status.get("rollout_stats") or {}
    if stats:
        console.print(
            f"episodes {stats.get('rollouts')}  mean return {stats.get('mean_episode_return'):.3f}  "
            f"min {stats.get('min_episode_return')}  max {stats.get('max_episode_return')}  "
            f"done {stats.get('done_count')}  invalid actions {stats.get('invalid_model_action_count')}"
        )
    elif status.get("mean_return") is not None:
        console.print(f"mean return so far {status['mean_return']:.3f}")
    training = status.get("training")
    if training:
        if training.get("trained"):
            console.print(
                f"training {training.get('steps')} steps, final loss {training.get('final_loss')}, "
                f"adapter {training.get('adapter_sha256')}"
            )
        else:
            console.print(f"training skipped: {training.get('skip_reason')}")
    for warning in status.get("warnings") or []:
        console.print(f"[yellow]warning[/] {warning}")
    manifest = status.get("manifest")
    if manifest:
        console.print(f"manifest {manifest['uri']}  ({manifest['sha256']})")
        for artifact in status.get("artifacts") or []:
            console.print(f"  {artifact['name']:<34} {artifact['uri']}  {artifact['bytes']} B")
    failure = status.get("failure")
    if failure:
        console.print(f"[red]failed[/] {failure.get('code')} at {failure.get('stage')}: {failure.get('message')}")
        if failure.get("hint"):
            console.print(f"hint: {failure['hint']}")
    return EXIT_CODES.get(str(state), 1)
