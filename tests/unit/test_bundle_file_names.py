"""A bundle is its summary (issue 41): verify and replay find the dataset and replay from the
summary's own name (``X.summary.json`` / ``X.rollout-summary.json`` pair with ``X.rollouts.jsonl``
and ``X.replay.json``; any summary with ``rollouts.jsonl``/``replay.json``) or from ``--dataset``/
``--replay`` on both commands; a file renamed after collection fails naming the expected file and
the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli.app import app
from kiln.cli.help import plain_command
from kiln.core.rollout.verify import VerificationFailed, verify_bundle
from kiln.core.rollout.verify.files import verify_command
from tests.unit.test_verify_support import real_bundle

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def bundle(tiny_model_dir: Path) -> dict[str, bytes]:
    return real_bundle(tiny_model_dir)


def _write(folder: Path, bundle: dict[str, bytes], names: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for key, name in names.items():
        (folder / name).write_bytes(bundle[key])
    return folder / names["summary.json"]


def test_stemmed_names_pair_by_themselves(bundle: dict[str, bytes], tmp_path: Path) -> None:
    summary = _write(tmp_path, bundle, {"rollouts.jsonl": "after.rollouts.jsonl", "replay.json": "after.replay.json",
                                        "summary.json": "after.summary.json"})
    report = verify_bundle(summary)
    assert report["dataset_path"] == str(tmp_path / "after.rollouts.jsonl")
    assert report["replay_path"] == str(tmp_path / "after.replay.json")
    assert verify_command(summary, tmp_path / "after.rollouts.jsonl", tmp_path / "after.replay.json") is None


def test_renamed_files_fail_naming_the_file_and_the_option(bundle: dict[str, bytes], tmp_path: Path) -> None:
    summary = _write(tmp_path, bundle, {"rollouts.jsonl": "data.jsonl", "replay.json": "trace.json",
                                        "summary.json": "after.summary.json"})
    with pytest.raises(VerificationFailed) as info:
        verify_bundle(summary)
    message = info.value.message
    assert "expected after.rollouts.jsonl or rollouts.jsonl" in message and "--dataset FILE" in message
    assert info.value.details["file"] == "dataset" and info.value.details["field"] == "path"
    with pytest.raises(VerificationFailed) as info:
        verify_bundle(summary, dataset_path=tmp_path / "data.jsonl")
    assert "expected after.replay.json or replay.json" in info.value.message and "--replay FILE" in info.value.message
    assert verify_command(summary, tmp_path / "data.jsonl", tmp_path / "trace.json") == (
        f"kiln openenv verify --summary {summary} --dataset {tmp_path / 'data.jsonl'} --replay {tmp_path / 'trace.json'}")

    cli = plain_command(app)
    refused = CliRunner().invoke(cli, ["openenv", "verify", "--summary", str(summary), "--json"])
    assert refused.exit_code == 2 and "--dataset FILE" in json.loads(refused.stdout)["error"]["message"]
    passed = CliRunner().invoke(cli, ["openenv", "verify", "--summary", str(summary), "--dataset",
                                      str(tmp_path / "data.jsonl"), "--replay", str(tmp_path / "trace.json"), "--json"])
    assert passed.exit_code == 0, passed.output
    assert json.loads(passed.stdout)["replay_path"] == str(tmp_path / "trace.json")
    # replay takes the same options: with them it gets past the offline verification to the
    # environment (gone here: a transport error, not a missing-file one); without them it names the file
    replay = CliRunner().invoke(cli, ["openenv", "replay", "--summary", str(summary), "--json"])
    assert replay.exit_code == 2 and "--dataset FILE" in json.loads(replay.stdout)["error"]["message"]
    replay = CliRunner().invoke(cli, ["openenv", "replay", "--summary", str(summary), "--dataset",
                                      str(tmp_path / "data.jsonl"), "--replay", str(tmp_path / "trace.json"), "--json"])
    error = json.loads(replay.stdout)["error"]
    assert error["code"] != "openenv_verification_failed", error
