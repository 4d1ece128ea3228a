"""``kiln openenv verify`` through Typer: human table, --json report, exit 2 with the error code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kiln.cli.verify_cmds import register
from tests.unit.test_verify_support import real_bundle, write_bundle


@pytest.fixture(scope="module")
def bundle(tiny_model_dir: Path) -> dict[str, bytes]:
    return real_bundle(tiny_model_dir)


@pytest.fixture()
def app() -> typer.Typer:
    openenv_app = typer.Typer(no_args_is_help=True)
    register(openenv_app)
    return openenv_app


def test_verify_json_report(app: typer.Typer, bundle: dict[str, bytes], tmp_path: Path) -> None:
    summary = write_bundle(tmp_path, bundle)
    result = CliRunner().invoke(app, ["verify", "--summary", str(summary), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["schema"] == "kiln.openenv-verification.v1"
    assert (report["groups"], report["rollouts"]) == (3, 6)


def test_verify_human_table(app: typer.Typer, bundle: dict[str, bytes], tmp_path: Path) -> None:
    summary = write_bundle(tmp_path, bundle)
    result = CliRunner().invoke(app, ["verify", "--summary", str(summary)])
    assert result.exit_code == 0, result.output
    assert "bundle verified" in result.stdout
    assert "rollouts                6" in result.stdout
    assert "stats recomputed from the records" in result.stdout


def test_verify_failure_prints_code_and_exits_2(app: typer.Typer, bundle: dict[str, bytes], tmp_path: Path) -> None:
    summary = write_bundle(tmp_path, {**bundle, "rollouts.jsonl": bundle["rollouts.jsonl"] + b"\n"})
    result = CliRunner().invoke(app, ["verify", "--summary", str(summary)])
    assert result.exit_code == 2
    assert "openenv_verification_failed" in result.stderr
    assert "summary field dataset_bytes" in result.stderr
    assert result.stdout == ""


def test_verify_explicit_dataset_and_replay(app: typer.Typer, bundle: dict[str, bytes], tmp_path: Path) -> None:
    (tmp_path / "s.json").write_bytes(bundle["summary.json"])
    (tmp_path / "d.jsonl").write_bytes(bundle["rollouts.jsonl"])
    (tmp_path / "r.json").write_bytes(bundle["replay.json"])
    args = ["verify", "--summary", str(tmp_path / "s.json"), "--dataset", str(tmp_path / "d.jsonl"),
            "--replay", str(tmp_path / "r.json"), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["replay_path"] == str(tmp_path / "r.json")
