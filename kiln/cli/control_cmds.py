"""CLI commands that talk to the REST API about persisted runs: runs, status, cancel, artifact,
tasks and preflight (``register(openenv_app)`` adds them to ``kiln openenv``).

Artifact downloads trust nothing but the run's current manifest: its bytes must hash to the digest
the run recorded, the artifact's URL is the canonical path built from the declared name, and the
declared size and SHA-256 are rechecked on the streamed bytes. Bytes are staged beside the target,
fsynced, and published atomically (never over an existing file unless forced); a failed download
leaves no file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Optional

import typer

from kiln.artifacts.manifest import verified_manifest
from kiln.cli.api_client import ApiClient, artifact_path
from kiln.cli.console import console, err_console, fail, print_json  # noqa: F401
from kiln.cli.flags import literal_enum
from kiln.cli.follow import FOLLOW_OPT, TERMINAL, exit_code, follow, num, print_outcome
from kiln.contracts import RunRequest
from kiln.errors import ArtifactIntegrityFailed, ArtifactNotFound, KilnError
from kiln.run_view import RunState, RunSummary

RunStateChoice = literal_enum("RunStateChoice", RunState)

DOWNLOAD_RECEIPT_SCHEMA = "kiln.openenv-artifact-download.v1"
MAX_DOWNLOAD_BYTES = 256 * 1024 * 1024
_CHUNK = 256 * 1024
# Manifest names of a rollout run's three local outputs.
ROLLOUT_OUTPUTS = ("rollouts.jsonl", "replay.json", "summary.json")

class OutputExists(KilnError):
    code = "openenv_artifact_output_exists"
    http_status = 409


def api_client() -> ApiClient:
    """The API client for ``KILN_API_URL`` (token from ``KILN_API_TOKEN``)."""
    from kiln.settings import load_settings

    settings = load_settings()
    token = getattr(settings, "api_token", None)
    if token is not None and hasattr(token, "get_secret_value"):
        token = token.get_secret_value()
    return ApiClient(settings.resolved_api_url, token=token or None)


# --------------------------------------------------------------------------------- downloads


def current_manifest(api: ApiClient, run_id: str) -> dict[str, Any]:
    """The run's manifest, checked against the manifest digest the run itself recorded."""
    status = api.status(run_id)
    if status.manifest is None:
        raise ArtifactNotFound(
            f"run {run_id} is {status.state} and has published no artifacts",
            hint="artifacts appear when the run completes",
        )
    return verified_manifest(api.manifest_bytes(run_id), run_id, status.manifest.sha256)


def manifest_entry(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    for entry in manifest["artifacts"]:
        if entry["name"] == name:
            return entry
    raise ArtifactNotFound(
        f"run {manifest['run_id']} declares no artifact named {name!r}",
        hint="declared: " + ", ".join(e["name"] for e in manifest["artifacts"]),
    )


def _check_target(output: Path, force: bool) -> None:
    if output.is_dir():
        raise OutputExists(f"{output} is a directory", hint="give a file path to --output")
    if output.exists() and not force:
        raise OutputExists(f"{output} already exists", hint="pass --force to replace it")


def _check_headers(response: Any, entry: dict[str, Any]) -> None:
    headers = response.headers
    problems = []
    if headers.get("content-length") != str(entry["bytes"]):
        problems.append(f"Content-Length {headers.get('content-length')!r} != {entry['bytes']}")
    if headers.get("etag") != f'"{entry["sha256"]}"':
        problems.append(f"ETag {headers.get('etag')!r} != the manifest digest")
    if "no-store" not in (headers.get("cache-control") or ""):
        problems.append("Cache-Control lacks no-store")
    if (headers.get("x-content-type-options") or "").lower() != "nosniff":
        problems.append("X-Content-Type-Options is not nosniff")
    if (headers.get("content-encoding") or "identity").lower() != "identity":
        problems.append(f"Content-Encoding {headers.get('content-encoding')!r} is not identity")
    if problems:
        raise ArtifactIntegrityFailed(
            f"artifact {entry['name']!r}: the response does not match the manifest: " + "; ".join(problems)
        )


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(staged: Path, output: Path, force: bool) -> None:
    """Atomically move ``staged`` to ``output`` (``link`` refuses an existing target)."""
    if force:
        os.replace(staged, output)
    else:
        try:
            os.link(staged, output)
        except FileExistsError:
            raise OutputExists(f"{output} already exists", hint="pass --force to replace it") from None
        staged.unlink()
    _fsync_dir(output.parent)


def download_entry(
    api: ApiClient, run_id: str, entry: dict[str, Any], output: Path, *, force: bool = False
) -> dict[str, Any]:
    """Stream one manifest entry to ``output``, verified; returns the download receipt."""
    output = Path(output).absolute()
    _check_target(output, force)
    if entry["bytes"] > MAX_DOWNLOAD_BYTES:
        raise ArtifactIntegrityFailed(f"artifact {entry['name']!r} is over the 256 MiB download limit")
    source = artifact_path(run_id, entry["name"])
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.parent / f".{output.name}.{uuid.uuid4().hex[:12]}.part"
    try:
        hasher = hashlib.sha256()
        seen = 0
        with api.stream(source) as response, open(staged, "xb") as fh:
            if response.status_code != 200:
                raise ArtifactIntegrityFailed(f"GET {source} answered HTTP {response.status_code}")
            _check_headers(response, entry)
            for chunk in response.iter_raw(_CHUNK):
                seen += len(chunk)
                if seen > entry["bytes"]:
                    raise ArtifactIntegrityFailed(
                        f"artifact {entry['name']!r}: more bytes than the manifest's {entry['bytes']}"
                    )
                hasher.update(chunk)
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        digest = "sha256:" + hasher.hexdigest()
        if seen != entry["bytes"] or digest != entry["sha256"]:
            raise ArtifactIntegrityFailed(
                f"artifact {entry['name']!r}: received {seen} bytes hashing to {digest}, "
                f"the manifest declares {entry['bytes']} bytes and {entry['sha256']}"
            )
        _publish(staged, output, force)
    finally:
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
    return {
        "schema": DOWNLOAD_RECEIPT_SCHEMA,
        "run_id": run_id,
        "kind": entry["name"],
        "source_url": source,
        "output_path": str(output),
        "sha256": entry["sha256"],
        "bytes": entry["bytes"],
    }


def download_artifact(
    api: ApiClient, run_id: str, name: str, output: Path, *, force: bool = False
) -> dict[str, Any]:
    """Download artifact ``name`` of ``run_id`` to ``output`` (verified, atomic)."""
    _check_target(Path(output), force)
    entry = manifest_entry(current_manifest(api, run_id), name)
    return download_entry(api, run_id, entry, Path(output), force=force)


def download_run_outputs(
    api: ApiClient, run_id: str, mapping: dict[str, Path], *, force: bool = False
) -> list[dict[str, Any]]:
    """Download several artifacts (manifest name → local path) from one manifest.

    Every target is checked before any byte is fetched, so a refused overwrite downloads nothing.
    """
    targets = {name: Path(path) for name, path in mapping.items()}
    for path in targets.values():
        _check_target(path, force)
    manifest = current_manifest(api, run_id)
    entries = {name: manifest_entry(manifest, name) for name in targets}
    return [download_entry(api, run_id, entries[name], targets[name], force=force) for name in targets]


def download_run(api: ApiClient, run_id: str, folder: Path, *, force: bool = False) -> list[dict[str, Any]]:
    """``manifest.json`` and every artifact of ``run_id`` into ``folder`` at their manifest names
    (each verified, atomic). Every target is checked before any byte is fetched."""
    folder = Path(folder)
    manifest = current_manifest(api, run_id)
    targets = [(entry, folder / entry["name"]) for entry in manifest["artifacts"]]
    for entry, path in targets:
        if ".." in Path(entry["name"]).parts or Path(entry["name"]).is_absolute():
            raise ArtifactIntegrityFailed(f"artifact name {entry['name']!r} escapes the run folder")
        _check_target(path, force)
    _check_target(folder / "manifest.json", force)
    receipts = [download_entry(api, run_id, entry, path, force=force) for entry, path in targets]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_bytes(api.manifest_bytes(run_id))
    return receipts


def rollout_output_mapping(
    output: Optional[Path], replay_output: Optional[Path], summary_output: Optional[Path]
) -> dict[str, Path]:
    """``--output/--replay-output/--summary-output`` → {manifest name: path} (unset ones skipped)."""
    pairs = zip(ROLLOUT_OUTPUTS, (output, replay_output, summary_output))
    return {name: path for name, path in pairs if path is not None}


def follow_and_download(
    api: ApiClient, run_id: str, mapping: dict[str, Path], *, force: bool = False,
    out: Any = None, poll_s: float = 1.0,
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
    ("RUN", 8), ("STATE", 15), ("KIND", 7), ("ADAPTER", 12), ("RETURN", -7), ("PROMOTED", 8), ("STARTED", 11),
)
RUNS_WIDE = (("RUN", 36), ("STATE", 9), ("KIND", 7), ("PHASE", 15), ("ADAPTER", 24), ("MEAN RETURN", -11),
             ("PROMOTED", 13), ("FAILURE", 24), ("STARTED", 25))


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
        return _line(RUNS_WIDE, [
            run.run_id, run.state, kind, phase, adapter, num(run.mean_return),
            promotion_label(run), run.failure_code or "", run.started_at or "-",
        ])
    promoted = promotion_label(run)
    return _line(RUNS_SHORT, [
        run.run_id[:8], phase or run.state, kind, adapter, num(run.mean_return),
        "no eval" if promoted == "not evaluated" else promoted, short_time(run.started_at),
    ])


def runs_cmd(
    state: Optional[RunStateChoice] = typer.Option(None, "--state", help="Only runs in this state."),
    wide: bool = typer.Option(False, "--wide", help="Full run ids and times, phase and failure code (wider than 80 columns)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """List runs, newest first (short ids and times; --wide for full ones)."""
    try:
        runs = api_client().runs(state.value if state is not None else None)
    except KilnError as error:
        fail(error)
        return
    if as_json:
        print_json(runs)
        return
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
    if status.state in TERMINAL:
        raise typer.Exit(code)


def cancel_cmd(
    run_id: str = typer.Argument(..., help="Run id."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
) -> None:
    """Request cancellation of a running run (exit 2 if it already ended)."""
    try:
        status = api_client().cancel(run_id)
    except KilnError as error:
        fail(error)
        return
    if as_json:
        print_json(status)
        return
    console.print(f"cancellation requested for {run_id}")


def artifact_cmd(
    run_id: str = typer.Argument(..., help="Run id."),
    name: str = typer.Argument(..., help="Artifact name as listed in the run's manifest."),
    output: Path = typer.Option(..., "--output", "-o", help="File to write."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
    as_json: bool = typer.Option(False, "--json", help="Print the download receipt as JSON."),
) -> None:
    """Download one artifact, verified against the run's manifest (size and SHA-256)."""
    try:
        receipt = download_artifact(api_client(), run_id, name, output, force=force)
    except KilnError as error:
        fail(error)
        return
    if as_json:
        print_json(receipt)
        return
    console.print(f"wrote {receipt['output_path']} ({receipt['bytes']} B, {receipt['sha256']})")


def tasks_cmd(
    environment: list[str] = typer.Option(..., "--environment", help="Environment base URL (repeatable)."),
    environment_name: Optional[str] = typer.Option(None, "--environment-name", help="Environment on a multi-environment server."),
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
    try:
        result = api_client().tasks(body)
    except KilnError as error:
        fail(error)
        return
    if as_json:
        print_json(result)
        return
    for item in result["catalogs"]:
        catalog = item["catalog"]
        console.print(f"{item['base_url']}  environment {catalog.get('environment_name')}  "
                      f"task api {catalog.get('task_api')}")
        for entry in catalog.get("splits") or []:
            console.print(f"  split {entry.get('name')} ({entry.get('type')})")
        if "selected_split" in catalog:
            console.print(task_page_line(catalog), markup=False, highlight=False)
            for row in catalog.get("tasks") or []:
                text = json.dumps(row, sort_keys=True)
                console.print(f"    {text if len(text) <= 160 else text[:157] + '...'}", markup=False)


def preflight_cmd(
    output_adapter: str = typer.Option(..., "--output-adapter", help="Adapter the run will train."),
    adapter: str = typer.Option(RunRequest.model_fields["adapter"].default, "--adapter", help="Behavior adapter (base = the base model)."),
    model: Optional[str] = typer.Option(RunRequest.model_fields["model"].default, "--model", help="Served model the run will name (default: the workers' default model)."),
    training_config: Optional[Path] = typer.Option(None, "--training-config", help="JSON file of GRPO/ECHO settings."),
    contract_output: Optional[Path] = typer.Option(None, "--contract-output", help="Write the sealed contract (the run request's training_contract) here."),
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
