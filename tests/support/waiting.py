"""Bounded waits for tests: a workflow result never waits longer than the test can afford.

A bare ``await handle.result()`` waits as long as the workflow may run (up to the 12 h training
timeout); every test waits through :func:`workflow_result` instead (``tests/unit/test_suite_rules``
enforces it).
"""

from __future__ import annotations

import asyncio
from typing import Any

DEFAULT_RESULT_TIMEOUT_S = 240.0


async def workflow_result(handle: Any, timeout_s: float = DEFAULT_RESULT_TIMEOUT_S, **kwargs: Any) -> Any:
    """``await handle.result(**kwargs)``, failing with ``TimeoutError`` after ``timeout_s``."""
    return await asyncio.wait_for(handle.result(**kwargs), timeout_s)


async def run_executions(client: Any, run_id: str, continued: int) -> list[Any]:
    """The executions of workflow ``run_id`` once visibility lists ``continued`` continued-as-new
    ones and the completed last (it catches up within moments; after 10 s, whatever it lists)."""
    executions: list[Any] = []
    for _ in range(50):
        executions = [w async for w in client.list_workflows(f'WorkflowId = "{run_id}"')]
        names = [e.status.name for e in executions]
        if len(executions) == continued + 1 and names.count("CONTINUED_AS_NEW") == continued:
            break
        await asyncio.sleep(0.2)
    return executions
