"""The README's first run, four ways, run as pasted against a real stack: Temporal dev server,
SeaweedFS, in-process control + gpu workers with the tiny model, the API over uvicorn and the
counter example environment. Only the addresses are swapped for the test stack's (the README's
default ports, the task queue and the workflow id): the CLI, curl, Python and Temporal CLI blocks
each start a run that completes. ``Client()`` in the Python block finds the API by KILN_API_URL."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from kiln.client import Client
from tests.integration.test_api_helpers import serve_api
from tests.support.kiln_workers import running_workers

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".venv" / "bin"


def readme_blocks() -> dict[str, str]:
    """The fenced blocks of "A first run, four ways", keyed by the bold word before each."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## A first run, four ways\n", 1)[1].split("\n## ", 1)[0]
    blocks = {}
    for name, body in re.findall(r"\*\*(\w[\w ]*?)\*\*.*?```(?:bash|python)\n(.*?)```", section, flags=re.S):
        blocks[name] = body
    return blocks


def _shell(script: str, env: dict[str, str], timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.mark.timeout(30)
def test_the_readme_has_the_four_ways_and_says_where_the_commands_live() -> None:
    blocks = readme_blocks()
    assert sorted(blocks) == ["CLI", "Python", "Temporal CLI", "curl"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("# Kiln\n\n```bash\nbash scripts/demo.sh   #")
    assert "live in `.venv/bin`" in readme
    assert 150 <= len(readme.splitlines()) <= 250


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_every_first_run_block_completes_a_run(
    kiln_settings: Any, counter_env_url: str, temporal_server: str
) -> None:
    settings = kiln_settings()
    blocks = readme_blocks()
    workflow_id = f"my-first-run-{uuid.uuid4().hex[:6]}"

    def swap(text: str, api: str) -> str:
        return (text.replace("http://127.0.0.1:8990", counter_env_url).replace("http://127.0.0.1:8780", api)
                .replace("127.0.0.1:7233", temporal_server).replace("kiln-control", settings.control_task_queue)
                .replace("my-first-run", workflow_id))

    async with running_workers(settings):
        with serve_api(settings) as api, Client(api) as kiln:
            env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
            env.update(PYTHONPATH=str(ROOT), KILN_API_URL=api, PATH=f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}",
                       HF_HUB_OFFLINE="1")
            ended: dict[str, str] = {}

            # CLI: submits, follows, exits 0 on completed.
            done = await asyncio.to_thread(_shell, swap(blocks["CLI"], api), env)
            assert done.returncode == 0, done.stdout + done.stderr
            ended["CLI"] = re.search(r"^run\s+(\S+)$", done.stdout, flags=re.M).group(1)  # type: ignore[union-attr]

            # curl: the answer is the run; the second command with its run id.
            submit, status = blocks["curl"].split("\ncurl -s ", 1)
            answer = json.loads((await asyncio.to_thread(_shell, swap(submit, api), env)).stdout)
            assert answer["state"] == "running" and answer["kind"] == "rollout"
            run_id = answer["run_id"]
            final = await asyncio.to_thread(kiln.wait, run_id, poll_s=0.5, timeout_s=300)
            again = await asyncio.to_thread(_shell, swap("curl -s " + status, api).replace("RUN_ID", run_id), env)
            assert json.loads(again.stdout)["state"] == final.state == "completed"
            ended["curl"] = run_id

            # Python: Client() from KILN_API_URL; rollout waits; prints id, state, mean return.
            done = await asyncio.to_thread(
                subprocess.run, [str(BIN / "python"), "-c", swap(blocks["Python"], api)], cwd=ROOT, env=env,
                capture_output=True, text=True, timeout=300,
            )
            assert done.returncode == 0, done.stderr
            run_id, state, mean = done.stdout.split()
            assert state == "completed" and float(mean) == (await asyncio.to_thread(kiln.status, run_id)).rollout_stats[
                "mean_episode_return"]
            ended["Python"] = run_id

            # Temporal CLI: starts the workflow under the chosen id; `kiln openenv status` follows it to 0.
            done = await asyncio.to_thread(_shell, swap(blocks["Temporal CLI"], api), env)
            assert done.returncode == 0, done.stdout + done.stderr
            assert f"run      {workflow_id}" in done.stdout
            ended["Temporal CLI"] = workflow_id

            for way, run_id in ended.items():
                view = await asyncio.to_thread(kiln.status, run_id)
                assert (way, view.state, view.progress.rollouts_completed) == (way, "completed", 4)
            assert len(set(ended.values())) == 4
