"""Follow a run until it ends; the exit code tells the outcome.

On a terminal: a live progress panel. Otherwise (CI, ``| tee``): one line per event — a line is
printed whenever the progress line changes (phase, groups, episodes, training step, …).
Numbers are shown to 4 significant digits. Exit codes: 0 completed, 1 failed, 3 cancelled (and 1
for anything unexpected).

When the workflow's status query times out (no worker answered within the API's query timeout,
e.g. while a worker loads a model) the API answers a stub marked ``query_timed_out``; the follower
keeps showing the last real status and says so once, on stderr ("status query timed out,
retrying"), never a ``phase=unknown`` line.
"""

from __future__ import annotations

import time
from typing import Any, Callable
from urllib.parse import quote

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kiln.cli.console import err_console, link
from kiln.cli.help import OUTPUT

TERMINAL = {"completed", "failed", "cancelled"}
TIMED_OUT_NOTICE = "status query timed out, retrying"
EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 3}
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


def exit_code(status: dict[str, Any]) -> int:
    """0 completed, 1 failed (or unknown), 3 cancelled."""
    return EXIT_CODES.get(str(status.get("state")), 1)


def progress_line(status: dict[str, Any]) -> str:
    """One line: phase, groups, episodes, mean return, training steps."""
    progress = status.get("progress") or {}
    mean = status.get("mean_return")
    parts = [f"phase={status.get('phase')}"]
    if (status.get("iterations_total") or 1) > 1:
        parts.append(f"iteration={status.get('iteration') or 0}/{status['iterations_total']}")
    parts += [
        f"groups={progress.get('groups_completed', 0)}/{progress.get('groups_total', 0)}",
        f"episodes={progress.get('rollouts_completed', 0)}/{progress.get('rollouts_total', 0)}",
    ]
    if mean is not None:
        parts.append(f"mean_return={num(mean)}")
    live = status.get("training_progress") or {}
    training = status.get("training") or {}
    if live.get("step"):
        parts.append(f"train_step={live['step']}/{live.get('total_steps', '?')}")
        for key in ("loss", "kl", "env_ce"):
            if isinstance(live.get(key), (int, float)):
                parts.append(f"{key}={num(float(live[key]))}")
    elif training.get("steps"):
        parts.append(f"train_steps={training['steps']}")
    return "  ".join(parts)


def progress_view(status: dict[str, Any]) -> Group:
    """The live panel: a small key/value table plus the run's warnings."""
    progress = status.get("progress") or {}
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("run", str(status.get("run_id")))
    table.add_row("phase", str(status.get("phase")))
    if (status.get("iterations_total") or 1) > 1:
        curve = status.get("iterations") or []
        table.add_row(
            "iteration",
            f"{status.get('iteration') or 0}/{status['iterations_total']}"
            + ("  returns " + " → ".join(num(r.get("mean_return")) for r in curve[-6:]) if curve else ""),
        )
    table.add_row("groups", f"{progress.get('groups_completed', 0)}/{progress.get('groups_total', 0)}")
    table.add_row(
        "episodes", f"{progress.get('rollouts_completed', 0)}/{progress.get('rollouts_total', 0)}"
    )
    mean = status.get("mean_return")
    table.add_row("mean return", num(mean))
    training = status.get("training") or {}
    live = status.get("training_progress") or {}
    if live.get("step"):
        loss = live.get("loss")
        env_ce = live.get("env_ce")
        table.add_row(
            "training",
            f"step {live['step']}/{live.get('total_steps', '?')}"
            + (f"  loss {num(float(loss))}" if isinstance(loss, (int, float)) else "")
            + (f"  env-CE {num(float(env_ce))}" if isinstance(env_ce, (int, float)) else "")
            + (f"  {num(float(live['tokens_per_s']))} tok/s" if isinstance(live.get("tokens_per_s"), (int, float)) else ""),
        )
    else:
        table.add_row("training step", str(training.get("steps") or "-"))
    evaluation = status.get("environment_evaluation") or {}
    if evaluation:
        eprog = evaluation.get("progress") or {}
        table.add_row(
            "evaluation",
            f"{evaluation.get('state')} {eprog.get('groups_completed', 0)}/{eprog.get('groups_total', 0)} groups"
            + (f"  → {evaluation['decision']}" if evaluation.get("decision") else ""),
        )
    admission = status.get("admission") or {}
    if admission.get("queue_position"):
        table.add_row("queue position", str(admission["queue_position"]))
    warnings = [Text(f"warning: {w}", style="yellow") for w in status.get("warnings") or []]
    return Group(table, *warnings)


def query_timed_out(status: dict[str, Any]) -> bool:
    """A running run's stub status: the workflow did not answer the status query in time."""
    return bool(status.get("query_timed_out")) and status.get("state") not in TERMINAL


class SteadyFetch:
    """``fetch`` that answers the last real status while the status query times out.

    Prints :data:`TIMED_OUT_NOTICE` to ``notices`` once per follow. Before any real status has
    been seen it waits ``poll_s`` and asks again.
    """

    def __init__(self, fetch: Callable[[], dict[str, Any]], notices: Console, poll_s: float) -> None:
        self._fetch = fetch
        self._notices = notices
        self._poll_s = poll_s
        self._last: dict[str, Any] | None = None
        self.noticed = False

    def __call__(self) -> dict[str, Any]:
        while True:
            status = self._fetch()
            if not query_timed_out(status):
                self._last = status
                return status
            if not self.noticed:
                self._notices.print(TIMED_OUT_NOTICE, markup=False, highlight=False)
                self.noticed = True
            if self._last is not None:
                return self._last
            time.sleep(self._poll_s)


def follow(
    fetch: Callable[[], dict[str, Any]],
    console: Console,
    *,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    live: bool = True,
    notices: Console | None = None,
) -> dict[str, Any]:
    """Poll ``fetch`` until the run is terminal (or ``timeout_s``); returns the last status.

    ``notices`` (default: stderr) gets the one "status query timed out" line.
    """
    fetch = SteadyFetch(fetch, notices or err_console, poll_s)
    started = time.monotonic()
    status = fetch()
    if not live:
        while status.get("state") not in TERMINAL:
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                break
            time.sleep(poll_s)
            status = fetch()
        return status
    if not console.is_terminal:
        return _follow_lines(fetch, status, console, poll_s=poll_s, started=started, timeout_s=timeout_s)
    with Live(progress_view(status), console=console, refresh_per_second=4, transient=True) as view:
        while status.get("state") not in TERMINAL:
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                break
            time.sleep(poll_s)
            status = fetch()
            view.update(progress_view(status))
    return status


def _follow_lines(
    fetch: Callable[[], dict[str, Any]],
    status: dict[str, Any],
    console: Console,
    *,
    poll_s: float,
    started: float,
    timeout_s: float | None,
) -> dict[str, Any]:
    """Not a terminal: print the progress line each time it changes (flushed at once)."""
    last = None
    while True:
        line = progress_line(status)
        if line != last:
            console.print(line, markup=False, highlight=False)
            console.file.flush()
            last = line
        if status.get("state") in TERMINAL:
            return status
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            return status
        time.sleep(poll_s)
        status = fetch()


def run_page_url(api_url: str, run_id: str) -> str:
    """The API's page of one run: ``<api>/runs/<run id>``."""
    return f"{api_url.rstrip('/')}/runs/{quote(run_id, safe='')}"


def print_links(status: dict[str, Any], console: Console, api_url: str | None, pad: int = 9) -> None:
    """The run's Web UI and run page links, each one whole line (never wrapped)."""
    if status.get("temporal_ui"):
        console.print(f"{'web ui':<{pad}}{link(status['temporal_ui'])}")
    if api_url and status.get("run_id"):
        console.print(f"{'run page':<{pad}}{link(run_page_url(api_url, str(status['run_id'])))}")


def print_outcome(status: dict[str, Any], console: Console, api_url: str | None = None) -> int:
    """Print the run's outcome (stats, training, artifacts, failure); returns the exit code.

    ``api_url`` adds the run page link (``<api>/runs/<id>``) next to the Web UI link.
    """
    state = status.get("state")
    console.print(f"run      {status.get('run_id')}")
    print_links(status, console, api_url)
    console.print(f"state    {state}")
    console.print(f"progress {progress_line(status)}")
    stats = status.get("rollout_stats") or {}
    if stats and stats.get("mean_episode_return") is not None:
        console.print(
            f"episodes {stats.get('rollouts')}  mean return {num(stats.get('mean_episode_return'))}  "
            f"min {num(stats.get('min_episode_return'))}  max {num(stats.get('max_episode_return'))}  "
            f"done {stats.get('done_count')}  invalid actions {stats.get('invalid_model_action_count')}"
        )
    elif status.get("mean_return") is not None:
        console.print(f"mean return so far {num(status['mean_return'])}")
    training = status.get("training")
    if training:
        if training.get("trained"):
            console.print(
                f"training {training.get('steps')} steps, final loss {num(training.get('final_loss'))}, "
                f"adapter {training.get('adapter_sha256')}"
            )
        else:
            console.print(f"training skipped: {training.get('skip_reason')}")
    evaluation = status.get("environment_evaluation")
    if evaluation and evaluation.get("evidence"):
        evidence = evaluation["evidence"]
        console.print(
            f"held-out evaluation ({evidence['paired_groups']} seed groups): mean return "
            f"base {num(evidence['baseline_mean_return'])} -> adapter {num(evidence['candidate_mean_return'])} "
            f"(wins {evidence['improved_groups']}, losses {evidence['regressed_groups']}, ties {evidence['tied_groups']}, "
            f"sign-test p={evidence['exact_sign_test_p_value']:.4g})"
        )
        console.print(f"gate     {evaluation.get('decision')} → {evaluation.get('outcome')}: {evaluation.get('verdict')}")
        world = evaluation.get("world_model") or {}
        if world.get("world_model_gain") is not None:
            console.print(
                f"world model: observation CE base {num(world['base_mean_env_ce'])} -> adapter "
                f"{num(world['candidate_mean_env_ce'])} (gain {num(world['world_model_gain'])})"
            )
    post = status.get("post_evaluation")
    if post:
        base = post.get("baseline_accuracy")
        console.print(
            f"post-eval {post['suite']}: accuracy {num(post['candidate_accuracy'])}"
            + (f" (base {num(base)})" if isinstance(base, (int, float)) else "")
            + f" → {post['gate_outcome']}: {post['reason']}"
        )
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
    if state == "cancelled":
        console.print("[yellow]cancelled[/]")
    return exit_code(status)
