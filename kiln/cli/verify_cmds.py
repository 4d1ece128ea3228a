"""``kiln openenv verify`` (offline), ``kiln openenv replay`` (live) and
``kiln openenv download`` (a whole run's artifacts, for ``verify --run``).

:func:`register` adds the commands to the ``openenv`` Typer group. Errors print
``error <code>: <message>`` on stderr and exit with status 2.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Optional

import typer

from kiln.core.errors import KilnError

from kiln.cli.console import console, fail as _fail, print_json as _print_json

_VERIFY_CHECKS = (
    "file sizes and sha256 of dataset and replay equal the summary",
    "canonical serialisation of all three files",
    "replay manifest rules (indices, seeds, continuation budget, returns, terminations)",
    "reset plan rebuilt from the replay matches reset_plan_sha256",
    "prompts recomputed from the inspections",
    "rewards, provenance, records and token pieces agree bitwise",
    "trajectories parse to the exchanged actions and observations",
    "stats recomputed from the records",
)


def _row(label: str, value: object) -> None:
    console.print(f"{label:<24}{value}", markup=False, highlight=False)


def _report(make: Callable[[], dict], as_json: bool) -> dict | None:
    """``make()``'s report, or None when it failed (error printed) or was printed as JSON."""
    try:
        report = make()
    except KilnError as error:
        _fail(error)
        return None
    if as_json:
        _print_json(report)
        return None
    return report


def _verify_run(folder: Path, as_json: bool) -> None:
    from kiln.core.rollout.verify.run import verify_run

    report = _report(lambda: verify_run(folder), as_json)
    if report is None:
        return
    console.print("run verified", markup=False, highlight=False)
    _row("run", report["run_id"])
    _row("artifacts", report["artifacts"])
    for prefix, figures in report["bundles"].items():
        _row("bundle", f"{prefix}  {figures['groups']} groups, {figures['rollouts']} rollouts")
    for prefix, evaluation in report["evaluations"].items():
        _row(
            "evaluation",
            f"{prefix}  {evaluation['paired_groups']} paired groups, "
            f"{evaluation['decision']} ({evaluation['outcome']}), evidence recomputed",
        )
    for row in report["iterations"]:
        _row(f"iteration {row['iteration']}", f"sampled by {row['sampled_by'] or 'base'} → {row['adapter_sha256']}")


def download_cmd(
    run_id: str = typer.Argument(..., help="The run whose published artifacts to download."),
    folder: Path = typer.Argument(..., help="Folder to write manifest.json and every artifact into."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files."),
    as_json: bool = typer.Option(False, "--json", help="Print the download receipts as JSON."),
) -> None:
    """Download a run's manifest and every artifact it lists (each size and SHA-256 rechecked);
    `kiln openenv verify --run FOLDER` then verifies the whole run offline."""
    from kiln.cli.control_cmds import api_client
    from kiln.client.downloads import download_run

    try:
        receipts = download_run(api_client(), run_id, folder, force=force)
    except KilnError as error:
        _fail(error)
        return
    if as_json:
        _print_json({"run_id": run_id, "folder": str(folder), "files": receipts})
        return
    console.print(f"downloaded {len(receipts)} artifacts of {run_id} into {folder}", markup=False, highlight=False)


def verify_cmd(
    summary: Optional[Path] = typer.Option(
        None, "--summary", help="Rollout summary JSON (summary.json or X.rollout-summary.json)."
    ),
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="Dataset JSONL (default: beside the summary)."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Replay JSON (default: beside the summary)."),
    run: Optional[Path] = typer.Option(
        None, "--run", help="A whole run downloaded with `kiln openenv download` (instead of --summary)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the verification report as JSON."),
) -> None:
    """Verify a rollout bundle offline (no network): digests, replay rules, prompts, rewards.
    With --run: every artifact against the manifest, every bundle (each iteration's of an
    online-RL run), and the on-policy chain from iteration to iteration."""
    from kiln.core.rollout.verify import verify_bundle

    if (summary is None) == (run is None):
        _fail(
            KilnError(
                "give exactly one of --summary FILE or --run FOLDER",
                code="openenv_invalid_request",
                hint="--summary verifies one bundle; --run verifies a downloaded run",
            )
        )
        return
    if run is not None:
        _verify_run(run, as_json)
        return
    assert summary is not None
    report = _report(lambda: verify_bundle(summary, dataset_path=dataset, replay_path=replay), as_json)
    if report is None:
        return
    console.print("bundle verified", markup=False, highlight=False)
    _row("summary", report["summary_path"])
    _row("dataset", f"{report['dataset_path']}  {report['dataset_sha256']}")
    _row("replay", f"{report['replay_path']}  {report['replay_sha256']}")
    _row("groups", report["groups"])
    _row("rollouts", report["rollouts"])
    _row("environment exchanges", report["environment_exchanges"])
    console.print("checked:", markup=False, highlight=False)
    for check in _VERIFY_CHECKS:
        console.print(f"  ✓ {check}", markup=False, highlight=False)


def replay_cmd(
    summary: Path = typer.Option(..., "--summary", help="Rollout summary JSON of the bundle to replay."),
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="Dataset JSONL (default: beside the summary)."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Replay JSON (default: beside the summary)."),
    ignore: list[str] = typer.Option(
        [],
        "--ignore",
        help="A step or state field not to compare in this replay (result.observation.X or "
        "final_state.X; * one segment, ** any number). Repeatable; reported apart from the "
        "bundle's own replay_ignore.",
    ),
    concurrency: int = typer.Option(4, "--concurrency", min=1, max=256, help="Candidates replayed at once."),
    credential_id: list[str] = typer.Option(
        [],
        "--credential-id",
        help="Per environment, in order: its credential id from KILN_CREDENTIALS, or '-' for none.",
    ),
    credential_env: list[str] = typer.Option([], "--credential-env", hidden=True),  # old name
    as_json: bool = typer.Option(False, "--json", help="Print the replay report as JSON."),
) -> None:
    """Verify offline, then replay every recorded action live and require identical answers."""
    from kiln.core.openenv.credentials import parse_credential_env_args, read_token_from_env
    from kiln.core.openenv.urls import normalize_url, require_allowed_host
    from kiln.core.rollout.replay_live import replay_bundle
    from kiln.core.rollout.verify import load_bundle
    from kiln.core.settings import load_settings

    try:
        bundle = load_bundle(summary, dataset_path=dataset, replay_path=replay)
        allow_remote = load_settings().allow_remote_environments
        for inspection in bundle.summary["environments"]:
            require_allowed_host(normalize_url(inspection["identity"]["base_url"]), allow_remote=allow_remote)
        environments = bundle.summary["environments"]
        if credential_id:
            from kiln.core.openenv.credential_config import resolve_bearer_token

            ids = parse_credential_env_args(credential_id, len(environments), flag="--credential-id", validate=False)
            credentials = load_settings().credentials
            tokens = [
                resolve_bearer_token(credentials, cid, env["identity"]["base_url"])
                for cid, env in zip(ids, environments)
            ]
        else:
            names = parse_credential_env_args(credential_env, len(environments))
            tokens = [None if name is None else read_token_from_env(name) for name in names]
        report = asyncio.run(
            replay_bundle(
                summary,
                dataset_path=dataset,
                replay_path=replay,
                concurrency=concurrency,
                credentials=tokens,
                ignore=ignore,
            )
        )
    except KilnError as error:
        _fail(error)
        return
    if as_json:
        _print_json(report)
        return
    console.print("replay matched the recording", markup=False, highlight=False)
    _row("replay", report["replay_sha256"])
    _row("environments", f"{report['environments']} (identity re-inspected, unchanged)")
    _row("groups", report["groups"])
    _row("rollouts", report["rollouts"])
    _row("  prefix only", report["environment_prefix_only_rollouts"])
    _row("environment exchanges", report["environment_exchanges"])
    for url, figures in report["environment_capacity"].items():
        _row("capacity refusals", f"{figures['refusals']} ({url})")
    for item in report.get("excluded_fields", []):
        _row("not compared", f"{item['field']} (environment {item['environment_index']}: {item['reason']})")


def register(openenv_app: typer.Typer) -> None:
    """Add ``download``, ``verify`` and ``replay`` to ``openenv_app``."""
    openenv_app.command("download")(download_cmd)
    openenv_app.command("verify")(verify_cmd)
    openenv_app.command("replay")(replay_cmd)
