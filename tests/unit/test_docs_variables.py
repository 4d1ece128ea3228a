"""Every ``KILN_*`` variable the settings and the scripts read is documented (the README or a
page of docs/: the settings tables are in docs/operations.md), and
``kiln serve --help`` names the home and port variables with the settings' defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.cli.app import app
from kiln.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_every_kiln_variable_is_documented() -> None:
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    from_settings = {f"KILN_{name.upper()}" for name in Settings.model_fields}
    from_scripts = {v for path in (ROOT / "scripts").rglob("*.sh") for v in re.findall(r"KILN_[A-Z0-9_]+", path.read_text())}
    assert {"KILN_DEMO_ENV_PORT", "KILN_VERBOSE", "KILN_PYTHON", "KILN_HOME"} <= from_scripts
    assert len(from_settings) >= 37
    missing = sorted(v for v in from_settings | from_scripts if f"`{v}`" not in readme)
    assert missing == []


@pytest.mark.timeout(30)
def test_serve_help_lists_the_home_and_port_variables() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    defaults = {name: field.default for name, field in Settings.model_fields.items()}
    assert f"KILN_HOME (default {defaults['home']})" in text
    for name in ("temporal_port", "temporal_ui_port", "s3_port", "api_port"):
        assert f"KILN_{name.upper()} (default {defaults[name]}" in text, name
    assert all(len(line) <= 80 for line in result.output.splitlines())
