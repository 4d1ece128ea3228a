"""``kiln openenv inspect`` shows the schema the policy is shown and constrained by: for an MCP tool
server (``tests.support.tool_servers``, real ``openenv``) the union of one call per tool, each
naming its tool and carrying that tool's own arguments, not the generic call form it advertises."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from tests.support.servers import free_port, serve_app_process
from tests.support.tool_servers import TOOL_SCHEMAS

pytestmark = pytest.mark.timeout(180)


def test_inspect_shows_the_per_tool_union() -> None:
    from kiln.cli.app import app
    from kiln.cli.help import plain_command

    port = free_port()
    argv = [sys.executable, "-m", "tests.support.tool_servers", "--port", str(port)]
    with serve_app_process(argv, port=port, startup_timeout_s=120) as url:
        as_json = CliRunner().invoke(plain_command(app), ["openenv", "inspect", "--environment", url, "--json"])
        as_text = CliRunner().invoke(plain_command(app), ["openenv", "inspect", "--environment", url])
    assert as_json.exit_code == 0, as_json.output
    inspection = json.loads(as_json.stdout)
    union = inspection["policy_action_schema"]["anyOf"]
    calls = [v for v in union if "tool_name" in v.get("properties", {})]
    assert [c["properties"]["tool_name"] for c in calls] == [{"type": "string", "const": n} for n in TOOL_SCHEMAS]
    definitions = inspection["policy_action_schema"].get("$defs", {})
    for call, name in zip(calls, TOOL_SCHEMAS):
        arguments = call["properties"]["arguments"]
        if "$ref" in arguments:  # a tool whose schema has its own definitions is moved to $defs
            arguments = definitions[arguments["$ref"].rsplit("/", 1)[-1]]
        arguments = json.dumps(arguments)
        for argument in TOOL_SCHEMAS[name].get("properties", {}):
            assert f'"{argument}"' in arguments, (name, argument)
    assert '"const": "move"' not in json.dumps(inspection["schema"]["action"])  # the advertised form is generic
    assert as_text.exit_code == 0, as_text.output
    assert "policy action schema" in as_text.stdout and '"call move"' in as_text.stdout
