"""CLI commands that talk to the REST API about persisted runs: runs, status, cancel, artifact,
tasks and preflight (``register(openenv_app)`` adds them to ``kiln openenv``).

They reach the API only through ``kiln.client`` (its HTTP layer and its verified downloads,
``kiln.client.downloads``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from kiln.cli.console import answer, console, err_console, fail, print_json
from kiln.cli.flags import literal_enum
from kiln.cli.follow import FOLLOW_OPT, TERMINAL, exit_code, follow, num, print_outcome
from kiln.client.downloads import download_artifact, download_run_outputs
from kiln.client.http import ApiClient
from kiln.core.contracts import RunRequest
from kiln.core.errors import KilnError
from kiln.core.run_view import RunState, RunSummary

RunStateChoice = literal_enum("RunStateChoice", RunState)

# Manifest names of a rollout run's three local outputs.
ROLLOUT_OUTPUTS = ("rollouts.jsonl", "replay.json", "summary.json")


def api_client() -> ApiClient:
    """The API client of this shell: ``KILN_API_URL`` (or host and port), ``KILN_API_TOKEN``."""
    return ApiClient()


# --------------------------------------------------------------------------------- downloads


def rollout_output_mapping(
    output: Optional[Path], replay_output: Optional[Path], summary_output: Optional[Path]
) -> dict[str, Path]:
    """``--output/--replay-output/--summary-output`` → {manifest name: path} (unset ones skipped)."""
    pairs = zip(ROLLOUT_OUTPUTS, (output, replay_output, summary_output))
    return {name: path for name, path in pairs if path is not None}


def follow_and_download(
    api: ApiClient,
    run_id: str,
    mapping: dict[str, Path],
    *,
    force: bool = False,
    out: Any = None,
    poll_s: float = 1.0,
) -> int:
    """Follow the run to its end, print the outcome, download ``mapping`` if it completed.

    Returns the CLI exit code (0 completed, 1 failed, 3 cancelled, 2 download refused/failed).
    """
    out = out or console
    final = follow(lambda: api.status(run_id), out, poll_s=poll_s)
    code = print_outcome(final, out, api.base_url)
    if code != 0 or not mapping:
        return code
    try:
        for receipt in download_run_outputs(api, run_id, mapping, force=force):
            out.print(f"wrote {receipt['output_path']} ({receipt['bytes']} B, {receipt['sha256']})")
    except KilnError as error:
        err_console.print(f"[red]error[/] {error.code}: {error.message}")
        return 2
    return 0


def task_page_line(catalog: dict[str, Any]) -> str:
    """``split: tasks 1..3 of 3`` (end exclusive), or why the page is empty."""
    split, start, stop, total = catalog["selected_split"], catalog["start"], catalog["stop"], catalog["num_tasks"]
    if total == 0:
        return f"  {split}: no tasks"
    if start >= total:
        return f"  {split}: --start {start} is past the end: the split has {total} task(s) (start 0..{total - 1})"
    return f"  {split}: tasks {start}..{stop - 1} of {total} (0-based, inclusive)"


# --------------------------------------------------------------------------------- commands


# ``runs``: (header, width) per column; the short table fits 80 columns, ``--wide`` shows all.
RUNS_SHORT = (
    ("RUN", 8),
    ("STATE", 15),
    ("KIND", 7),
    ("ADAPTER", 12),
    ("RETURN", -7),
    ("PROMOTED", 8),
    ("STARTED", 11),
)
RUNS_WIDE = (
    ("RUN", 36),
    ("STATE", 9),
    ("KIND", 7),
    ("PHASE", 15),
    ("ADAPTER", 24),
    ("MEAN RETURN", -11),
    ("PROMOTED", 13),
    ("FAILURE", 24),
    ("STARTED", 25),
)


def _fit(text: str, width: int, cut: bool) -> str:
    """``text`` in a column of ``width`` (negative: right-aligned); ``cut``: ``…`` when longer."""
    size = abs(width)
    if cut and len(text) > size:
        text = text[: size - 1] + "…"
    return text.rjust(size) if width < 0 else text.ljust(size)


def _line(columns: tuple[tuple[str, int], ...], values: list[str]) -> str:
    cut = columns is RUNS_SHORT  # --wide never cuts
    return "  ".join(_fit(value, width, cut) for (_, width), value in zip(columns, values)).rstrip()


def promotion_label(run: RunSummary) -> str:
    """yes / no, as status's ``promoted`` says (a promoted run is ``yes`` with or without an
    evaluation); ``not evaluated`` for a completed, unpromoted run published without an evaluation;
    ``-`` else."""
    if run.promoted is True:
        return "yes"
    if run.evaluated is False and run.state == "completed":
        return "not evaluated"
    return "-" if run.promoted is None else ("yes" if run.promoted else "no")


def short_time(iso: str | None) -> str:
    """``MM-DD HH:MM`` (UTC, as the API reports it) of an ISO timestamp."""
    if not iso:
        return "-"
    return f"{iso[5:10]} {iso[11:16]}" if len(iso) >= 16 else iso


def runs_header(wide: bool = False) -> str:
    columns = RUNS_WIDE if wide else RUNS_SHORT
    return _line(columns, [name for name, _ in columns])


def runs_row(run: RunSummary, wide: bool = False) -> str:
    """One ``runs`` line. Short: the phase stands in the state column while the run is running
    (a finished run's phase is its state); ``--wide``: full id, phase, failure code, ISO time."""
    phase = (run.phase or "-") if run.state == "running" else ""
    adapter = run.output_adapter or "-"
    kind = run.kind or "-"
    if wide:
        return _line(
            RUNS_WIDE,
            [
                run.run_id,
                run.state,
                kind,
                phase,
                adapter,
                num(run.mean_return),
                promotion_label(run),
                run.failure_code or "",
                run.started_at or "-",
            ],
        )
    promoted = promotion_label(run)
    return _line(
        RUNS_SHORT,
        [
            run.run_id[:8],
            phase or run.state,
            kind,
            adapter,
            num(run.mean_return),
            "no eval" if promoted == "not evaluated" else promoted,
            short_time(run.started_at),
        ],
    )


def runs_cmd(
    # type checkers cannot see the Enum literal_enum builds at import; typer needs that class
    state: Optional[RunStateChoice] = typer.Option(None, "--state", help="Only runs in this state."),  # type: ignore[valid-type]  # see above
    wide: bool = typer.Option(
        False, "--wide", help="Full run ids and times, phase and failure code (wider than 80 columns)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """List runs, newest first (short ids and times; --wide for full ones)."""
    listing = answer(lambda: api_client().runs(state.value if state is not None else None))
    if as_json:  # the API's own document: {"schema": ..., "runs": [...]}
        print_json(listing)
        return
    runs = listing.runs
    if not runs:
        console.print("no runs")
        return
    console.print(runs_header(wide), markup=False)
    for run in runs:
        console.print(runs_row(run, wide), markup=False)


def status_cmd(
    run_id: str = typer.Argument(..., help="Run id."),
    follow_run: bool = FOLLOW_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
    poll_seconds: float = typer.Option(1.0, "--poll-seconds", min=0.1, help="Polling interval."),
) -> None:
    """Show a run's phase, progress, returns, training and artifacts.

    Exit code of a finished run: 0 completed, 1 failed, 3 cancelled.
    """
    api = api_client()
    try:
        if follow_run:
            status = follow(lambda: api.status(run_id), console, poll_s=poll_seconds, live=not as_json)
        else:
            status = api.status(run_id)
    except KilnError as error:
        fail(error)
        return
    if as_json:
        print_json(status)
        code = exit_code(status)
    else:
        code = print_outcome(status, console, api.base_url)
    if status.state in TERMINAL or status.unclaimed:
        raise typer.Exit(code)


def cancel_cmd(
    run_id: str = typer.Argument(..., help="Run id."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
) -> None:
    """Request cancellation of a running run (exit 2 if it already ended)."""
    status = answer(lambda: api_client().cancel(run_id))
    if as_json:
        print_json(status)
        return
    if status.unclaimed:  # Temporal records the request; nothing acts on it until a worker polls
        console.print(
            f"cancellation requested for {run_id}, but {status.unclaimed}: it takes effect when "
            f"one does (`temporal workflow terminate --workflow-id {run_id}` ends it now)",
            markup=False,
            highlight=False,
        )
        raise typer.Exit(1)
    console.print(f"cancellation requested for {run_id}")


def artifact_cmd(
    run_id: str = typer.Argument(..., help="Run id."),
    name: str = typer.Argument(..., help="Artifact name as listed in the run's manifest."),
    output: Path = typer.Option(..., "--output", "-o", help="File to write."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
    as_json: bool = typer.Option(False, "--json", help="Print the download receipt as JSON."),
) -> None:
    """Download one artifact, verified against the run's manifest (size and SHA-256)."""
    receipt = answer(lambda: download_artifact(api_client(), run_id, name, output, force=force))
    if as_json:
        print_json(receipt)
        return
    console.print(f"wrote {receipt['output_path']} ({receipt['bytes']} B, {receipt['sha256']})")


def tasks_cmd(
    environment: list[str] = typer.Option(..., "--environment", help="Environment base URL (repeatable)."),
    environment_name: Optional[str] = typer.Option(
        None, "--environment-name", help="Environment on a multi-environment server."
    ),
    split: Optional[str] = typer.Option(None, "--split", help="Split to page through (case-insensitive)."),
    start: int = typer.Option(0, "--start", help="First task index."),
    limit: int = typer.Option(50, "--limit", help="Page size (1-200)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Browse an environment's Task API catalog (splits and task rows) through the API."""
    body: dict[str, Any] = {"environment_urls": environment, "start": start, "limit": limit}
    if environment_name is not None:
        body["environment_name"] = environment_name
    if split is not None:
        body["split"] = split
    result = answer(lambda: api_client().tasks(body))
    if as_json:
        print_json(result)
        return
    for item in result["catalogs"]:
        catalog = item["catalog"]
        console.print(
            f"{item['base_url']}  environment {catalog.get('environment_name')}  task api {catalog.get('task_api')}"
        )
        for entry in catalog.get("splits") or []:
            console.print(f"  split {entry.get('name')} ({entry.get('type')})")
        if "selected_split" in catalog:
            console.print(task_page_line(catalog), markup=False, highlight=False)
            for row in catalog.get("tasks") or []:
                text = json.dumps(row, sort_keys=True)
                console.print(f"    {text if len(text) <= 160 else text[:157] + '...'}", markup=False)


def preflight_cmd(
    output_adapter: str = typer.Option(..., "--output-adapter", help="Adapter the run will train."),
    adapter: str = typer.Option(
        RunRequest.model_fields["adapter"].default, "--adapter", help="Behavior adapter (base = the base model)."
    ),
    model: Optional[str] = typer.Option(
        RunRequest.model_fields["model"].default,
        "--model",
        help="Served model the run will name (default: the workers' default model).",
    ),
    training_config: Optional[Path] = typer.Option(None, "--training-config", help="JSON file of GRPO/ECHO settings."),
    contract_output: Optional[Path] = typer.Option(
        None, "--contract-output", help="Write the sealed contract (the run request's training_contract) here."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the preflight receipt as JSON."),
) -> None:
    """Seal a training contract: effective config with defaults and the behaviour policy identity."""
    body: dict[str, Any] = {"adapter": adapter, "output_adapter": output_adapter}
    if model is not None:
        body["model"] = model
    try:
        if training_config is not None:
            body["training_config"] = json.loads(training_config.read_text())
        receipt = api_client().preflight(body)
    except (OSError, ValueError) as err:
        fail(KilnError(f"cannot read --training-config: {err}", code="openenv_invalid_request"))
        return
    except KilnError as error:
        fail(error)
        return
    if contract_output is not None:
        contract_output.write_text(json.dumps(receipt["contract"], indent=2, sort_keys=True) + "\n")
    if as_json:
        print_json(receipt)
        return
    policy = receipt["behavior_policy"]
    console.print(f"output adapter   {receipt['contract']['output_adapter']}")
    console.print(f"base adapter     {receipt['contract'].get('base_adapter') or 'base'}")
    console.print(f"behaviour policy {json.dumps(policy, sort_keys=True)}", markup=False)
    console.print(f"effective config {json.dumps(receipt['effective_config'], sort_keys=True)}", markup=False)
    console.print(f"capacity reserved {receipt['capacity_reserved']}")


COMMANDS = (
    ("runs", runs_cmd),
    ("status", status_cmd),
    ("cancel", cancel_cmd),
    ("artifact", artifact_cmd),
    ("tasks", tasks_cmd),
    ("preflight", preflight_cmd),
)


def register(openenv_app: typer.Typer) -> None:
    """Add runs, status, cancel, artifact, tasks and preflight to ``kiln openenv``."""
    for name, command in COMMANDS:
        openenv_app.command(name)(command)
