"""OpenEnv 0.10 agent harness servers (RFC 005) are refused at inspect with a clear code (issue
41): a real ``HarnessEnvironment`` served by ``openenv`` in production mode (``/harness``) and in
simulation mode, inspected by the library and by ``kiln openenv inspect --json``."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from kiln.core.errors import HarnessUnsupported
from kiln.core.openenv.discovery import inspect_environment
from tests.support.servers import serve_module


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [["--production"], []], ids=["production", "simulation"])
def test_a_harness_server_is_refused_at_inspect(mode: list[str]) -> None:
    with serve_module("tests.support.harness_server", *mode) as url:
        with pytest.raises(HarnessUnsupported) as info:
            asyncio.run(inspect_environment(url))
        from kiln.cli.app import app
        from kiln.cli.help import plain_command

        result = CliRunner().invoke(plain_command(app), ["openenv", "inspect", "--environment", url, "--json"])
    assert info.value.code == "openenv_harness_unsupported"
    assert "HarnessAction" in info.value.message and info.value.details == {"environment_url": url}
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["code"] == "openenv_harness_unsupported"
