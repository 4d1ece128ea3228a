"""Follow a run until it ends; the exit code tells the outcome.

On a terminal: a live progress panel. Otherwise (CI, ``| tee``): one line per event — a line is
printed whenever the progress line changes (phase, groups, episodes, training step, …).
Numbers are shown to 4 significant digits. Exit codes: 0 completed, 1 failed, 3 cancelled (and 1
for anything unexpected).

The loop is ``kiln.client.follow.watch`` (the Python client's too). When the workflow's status
query times out (no worker answered within the API's query timeout, e.g. while a worker loads a
model) the API answers a placeholder view (``status_source`` history, ``RunView.timed_out``); the
follower keeps showing the last real status and says so once, on stderr ("status query timed out,
retrying"), never a ``phase=unknown`` line. A run no worker has picked up, on a task queue no
worker polls (``RunView.unclaimed``), ends the follow with that message and exit code 1.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable
from urllib.parse import quote

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kiln.cli.console import err_console, link
from kiln.cli.help import OUTPUT
from kiln.client.follow import watch
from kiln.core.errors import UNCLAIMED_HINT
from kiln.core.run_status import Progress
from kiln.core.run_view import RunView, TrainingProgress

TERMINAL = {"completed", "failed", "cancelled", "terminated"}
TIMED_OUT_NOTICE = "status query timed out, retrying"
EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 3, "terminated": 4}
# One --follow/--no-follow, one default, on every command that submits or shows a run.
FOLLOW_DEFAULT = True
FOLLOW_HELP = "Follow the run until it ends (one line per event when not a terminal)."
FOLLOW_OPT = typer.Option(FOLLOW_DEFAULT, "--follow/--no-follow", rich_help_panel=OUTPUT, help=FOLLOW_HELP)


def num(value: Any) -> str:
    """A number to 4 significant digits (ints as they are); ``-`` for none."""
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def exit_code(status: RunView) -> int:
    """0 completed, 1 failed (or unknown), 3 cancelled, 4 terminated through Temporal."""
    return EXIT_CODES.get(status.state, 1)


def _counts(progress: Progress) -> tuple[str, str]:
    return (
        f"{progress.groups_completed}/{progress.groups_total}",
        f"{progress.rollouts_completed}/{progress.rollouts_total}",
    )


def _live_figures(live: TrainingProgress) -> list[tuple[str, float]]:
    """The training step's loss, KL and env-CE that are known."""
    return [
        (key, value)
        for key, value in (("loss", live.loss), ("kl", live.kl), ("env_ce", live.env_ce))
        if value is not None
    ]


def progress_line(status: RunView) -> str:
    """One line: phase, groups, episodes, mean return, training steps."""
    groups, episodes = _counts(status.progress)
    parts = [f"phase={status.phase}"]
    if (status.iterations_total or 1) > 1:
        parts.append(f"iteration={status.iteration or 0}/{status.iterations_total}")
    parts += [f"groups={groups}", f"episodes={episodes}"]
    if status.mean_return is not None:
        parts.append(f"mean_return={num(status.mean_return)}")
    live = status.training_progress
    if live is not None and live.step:
        parts.append(f"train_step={live.step}/{num(live.total_steps) if live.total_steps else '?'}")
        parts += [f"{key}={num(float(value))}" for key, value in _live_figures(live)]
    elif status.training is not None and status.training.steps:
        parts.append(f"train_steps={status.training.steps}")
    return "  ".join(parts)


def progress_view(status: RunView) -> Group:
    """The live panel: a small key/value table plus the run's warnings."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("run", status.run_id)
    table.add_row("phase", status.phase)
    if (status.iterations_total or 1) > 1:
        curve = status.iterations
        table.add_row(
            "iteration",
            f"{status.iteration or 0}/{status.iterations_total}"
            + ("  returns " + " → ".join(num(r.mean_return) for r in curve[-6:]) if curve else ""),
        )
    groups, episodes = _counts(status.progress)
    table.add_row("groups", groups)
    table.add_row("episodes", episodes)
    table.add_row("mean return", num(status.mean_return))
    live = status.training_progress
    if live is not None and live.step:
        figures = dict(_live_figures(live))
        table.add_row(
            "training",
            f"step {live.step}/{live.total_steps or '?'}"
            + (f"  loss {num(float(figures['loss']))}" if "loss" in figures else "")
            + (f"  env-CE {num(float(figures['env_ce']))}" if "env_ce" in figures else "")
            + (f"  {num(float(live.tokens_per_s))} tok/s" if live.tokens_per_s is not None else ""),
        )
    else:
        table.add_row("training step", str((status.training.steps if status.training else 0) or "-"))
    evaluation = status.environment_evaluation
    if evaluation is not None:
        done, _ = _counts(evaluation.progress)
        table.add_row(
            "evaluation",
            f"{evaluation.state} {done} groups" + (f"  → {evaluation.decision}" if evaluation.decision else ""),
        )
    if status.admission is not None and status.admission.queue_position:
        table.add_row("queue position", str(status.admission.queue_position))
    warnings = [Text(f"warning: {w}", style="yellow") for w in status.warnings]
    return Group(table, *warnings)


def follow(
    fetch: Callable[[], RunView],
    console: Console,
    *,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    live: bool = True,
    notices: Console | None = None,
) -> RunView:
    """Follow with ``kiln.client.follow.watch`` until the run ends (or waits for a worker nothing
    runs, or ``timeout_s``); returns the last real status. On a terminal: the live panel; else one
    line per change; ``live=False``: silent. ``notices`` (default: stderr) gets the one "status
    query timed out" line."""
    told = notices or err_console

    def timed_out() -> None:
        told.print(TIMED_OUT_NOTICE, markup=False, highlight=False)

    views = watch(fetch, poll_s=poll_s, timeout_s=timeout_s, on_timed_out=timed_out)
    status = next(views, None)
    if status is None:  # ``timeout_s`` passed before any worker answered
        return fetch()
    if not live:
        for later in views:
            status = later
        return status
    if not console.is_terminal:
        last = None
        for seen in itertools.chain([status], views):
            status = seen
            line = progress_line(status)
            if line != last:
                console.print(line, markup=False, highlight=False)
                console.file.flush()
                last = line
        return status
    with Live(progress_view(status), console=console, refresh_per_second=4, transient=True) as view:
        for status in views:
            view.update(progress_view(status))
    return status


def run_page_url(api_url: str, run_id: str) -> str:
    """The API's page of one run: ``<api>/runs/<run id>``."""
    return f"{api_url.rstrip('/')}/runs/{quote(run_id, safe='')}"


def print_links(status: RunView, console: Console, api_url: str | None, pad: int = 9) -> None:
    """The run's Web UI and run page links, each one whole line (never wrapped)."""
    if status.temporal_ui:
        console.print(f"{'web ui':<{pad}}{link(status.temporal_ui)}")
    if api_url and status.run_id:
        console.print(f"{'run page':<{pad}}{link(run_page_url(api_url, status.run_id))}")


def print_outcome(status: RunView, console: Console, api_url: str | None = None) -> int:
    """Print the run's outcome (stats, training, artifacts, failure); returns the exit code.

    ``api_url`` adds the run page link (``<api>/runs/<id>``) next to the Web UI link.
    """
    state = status.state
    console.print(f"run      {status.run_id}")
    print_links(status, console, api_url)
    console.print(f"state    {state}")
    console.print(f"progress {progress_line(status)}")
    stats = status.rollout_stats or {}
    if stats and stats["mean_episode_return"] is not None:  # the figures of kiln.core.rollout.bundle
        console.print(
            f"episodes {stats['rollouts']}  mean return {num(stats['mean_episode_return'])}  "
            f"min {num(stats['min_episode_return'])}  max {num(stats['max_episode_return'])}  "
            f"done {stats['done_count']}  invalid actions {stats['invalid_model_action_count']}"
            + (
                f"  context exhausted {stats['context_exhausted_count']} (of {stats.get('context_tokens')} tokens)"
                if stats.get("context_exhausted_count")
                else ""
            )
        )
    elif status.mean_return is not None:
        console.print(f"mean return so far {num(status.mean_return)}")
    training = status.training
    if training is not None:
        if training.trained:
            console.print(
                f"training {training.steps} steps, final loss {num(training.final_loss)}, "
                f"adapter {training.adapter_sha256}"
            )
        else:
            console.print(f"training skipped: {training.skip_reason}")
    evaluation = status.environment_evaluation
    if evaluation is not None and evaluation.evidence:
        evidence = evaluation.evidence
        console.print(
            f"held-out evaluation ({evidence['paired_groups']} seed groups): mean return "
            f"base {num(evidence['baseline_mean_return'])} -> adapter {num(evidence['candidate_mean_return'])} "
            f"(wins {evidence['improved_groups']}, losses {evidence['regressed_groups']}, ties {evidence['tied_groups']}, "
            f"sign-test p={evidence['exact_sign_test_p_value']:.4g})"
        )
        # The verdict names the outcome itself ("Promoted: …", "Rejected: …"): said once.
        console.print(f"gate     {evaluation.verdict or f'{evaluation.decision} → {evaluation.outcome}'}")
        world = evaluation.world_model  # kiln.core.evaluation.receipt's world-model block
        if world and world["world_model_gain"] is not None:
            console.print(
                f"world model: observation CE base {num(world['base_mean_env_ce'])} -> adapter "
                f"{num(world['candidate_mean_env_ce'])} (gain {num(world['world_model_gain'])})"
            )
    post = status.post_evaluation
    if post is not None:
        base = post.baseline_accuracy
        console.print(
            f"post-eval {post.suite}: accuracy {num(post.candidate_accuracy)}"
            + (f" (base {num(base)})" if base is not None else "")
            + f" → {post.gate_outcome}: {post.reason}"
        )
    for warning in status.warnings:
        console.print(f"[yellow]warning[/] {warning}")
    if status.manifest is not None:
        console.print(f"manifest {status.manifest.uri}  ({status.manifest.sha256})")
        for artifact in status.artifacts:
            console.print(f"  {artifact.name:<34} {artifact.uri}  {artifact.bytes} B")
    failure = status.failure
    if status.termination is not None:
        ended = status.termination
        console.print(f"[red]terminated[/] at {ended.stage} by {ended.identity}: {ended.reason}", highlight=False)
    elif failure is not None:
        console.print(f"[red]failed[/] {failure.code} at {failure.stage}: {failure.message}")
    if failure is not None and failure.hint:
        console.print(f"hint: {failure.hint}")
    if state == "cancelled":
        console.print("[yellow]cancelled[/]")
    if status.unclaimed and state == "running":
        console.print(f"[red]waiting[/] {status.unclaimed}", highlight=False)
        console.print(f"hint: {UNCLAIMED_HINT}", highlight=False)
    return exit_code(status)
