"""CLI help at 80 columns: nothing cut, no type labels; one follow flag; one credential flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _every_command() -> list[list[str]]:
    """Every command and group of the CLI, as argv (new commands are covered without a list)."""
    import typer

    from kiln.cli.app import app

    found: list[list[str]] = []

    def walk(command: object, path: list[str]) -> None:
        found.append(path)
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


COMMANDS = _every_command()
SCRIPT = """
import sys
from kiln.cli.app import main
for argv in {argv!r}:
    sys.argv = ["kiln", *argv, "--help"]
    print("=== " + " ".join(argv))
    try:
        main()
    except SystemExit:
        pass
"""


@pytest.fixture(scope="module")
def help_pages() -> dict[str, str]:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT), "TERM": "xterm-256color"}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(argv=COMMANDS)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    pages = {}
    for block in out.split("=== ")[1:]:
        title, _, body = block.partition("\n")
        pages[title] = body
    return pages


@pytest.mark.timeout(180)
def test_help_fits_80_columns_without_cuts_or_type_labels(help_pages: dict[str, str]) -> None:
    assert len(help_pages) == len(COMMANDS) >= 22
    for title, body in help_pages.items():
        assert body.startswith("Usage: kiln"), (title, body[:200])
        for line in body.splitlines():
            assert len(line) <= 80, (title, line)
            assert "…" not in line, (title, line)
            if not line.startswith("Usage:"):
                assert not line.rstrip().endswith("..."), (title, line)
            for label in ("<bool>", "<str>", "<int>", "<float>", "<path>", "<list[str]>", "<choice"):
                assert label not in line, (title, line)
    train = help_pages["openenv train"]
    for flag in ("--thinking-budget-tokens", "--checkpoint-interval", "--constrained-actions",
                 "--environment-reset-options", "--post-eval-min-accuracy", "--report-to"):
        assert flag in train, flag


@pytest.mark.timeout(180)
def test_one_follow_flag_and_one_credential_flag(help_pages: dict[str, str]) -> None:
    for title in ("openenv train", "openenv start", "openenv status", "openenv rollout", "train grpo"):
        page = help_pages[title]
        assert "--follow / --no-follow" in page, title
        assert "[default: follow]" in " ".join(page.split()), title
    for title in ("openenv train", "openenv rollout", "openenv inspect", "openenv replay"):
        assert "--credential-id" in help_pages[title], title
        assert "--credential-env" not in help_pages[title], title  # the old name: a hidden alias


@pytest.mark.timeout(180)
def test_train_help_is_grouped_into_panels_with_the_model_choices(help_pages: dict[str, str]) -> None:
    train = help_pages["openenv train"]
    sections = [line for line in train.splitlines() if line.endswith("options:")]
    assert sections == ["Collection options:", "Policy options:", "Training options:", "Evaluation options:",
                        "Online RL options:", "Output options:", "Other options:"]

    def section_of(flag: str) -> str:
        current = ""
        for line in train.splitlines():
            if line.endswith("options:"):
                current = line
            elif line.strip().startswith(flag + " ") or line.strip() == flag:
                return current
        raise AssertionError(flag)

    assert section_of("--group-size") == "Collection options:"
    assert section_of("--temperature") == "Policy options:"
    assert section_of("--kl-coeff") == "Training options:"
    assert section_of("--eval-groups") == "Evaluation options:"
    assert section_of("--iterations") == "Online RL options:"
    assert section_of("--output-adapter") == "Output options:"
    text = " ".join(train.split())
    # Choices come from the models: named by the field's description, else appended.
    assert "Optimizer of the LoRA weights: adamw or muon." in text
    assert "Choices: none, tensorboard, trackio, wandb." in text and "Choices: auto, on, off." in text
    assert "Choices: muon" not in text
