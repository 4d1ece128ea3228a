"""The chaos worker process: install the fault hooks, then run Kiln's own workers.

``python -m tests.support.chaos worker control|gpu|all`` (see ``__main__.py``) calls
``workers.__main__.main([role])`` with the same settings, workers and defaults.

With ``KILN_CHAOS_GO`` set (a path), the process is a *spare*: it does its imports (what a worker
does before it polls), then waits for that file to appear before it calls ``main``, so a test can
start a fresh worker without paying the imports of a cold Python process at that moment. A spare
whose parent (the test process) is gone exits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.support.chaos.faults import HOOKS_ENV, FaultHooks, install_hooks

GO_ENV = "KILN_CHAOS_GO"


def worker_main(argv: list[str]) -> None:
    """``python -m tests.support.chaos worker ROLE``: install hooks, then run Kiln's workers."""
    if len(argv) != 2 or argv[0] != "worker":
        print("usage: python -m tests.support.chaos worker control|gpu|all", file=sys.stderr)
        raise SystemExit(2)
    role = argv[1]
    install_hooks(role, FaultHooks(Path(os.environ[HOOKS_ENV])))
    from workers.__main__ import main

    go = os.environ.get(GO_ENV)
    if go:
        _wait_for_go(Path(go))
    main([role])


def _wait_for_go(go: Path) -> None:
    """A spare's wait: until ``go`` exists (then run), or until its parent is gone (then exit)."""
    import time

    parent = os.getppid()
    print("spare ready", flush=True)
    while not go.exists():
        if os.getppid() != parent:
            raise SystemExit(0)
        time.sleep(0.05)
