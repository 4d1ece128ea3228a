"""The chaos worker process: install the fault hooks, then run Kiln's own workers.

``python -m tests.support.chaos worker control|gpu|all`` (see ``__main__.py``) calls
``workers.__main__.main([role])`` with the same settings, workers and defaults.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.support.chaos.faults import HOOKS_ENV, FaultHooks, install_hooks

def worker_main(argv: list[str]) -> None:
    """``python -m tests.support.chaos worker ROLE``: install hooks, then run Kiln's workers."""
    if len(argv) != 2 or argv[0] != "worker":
        print("usage: python -m tests.support.chaos worker control|gpu|all", file=sys.stderr)
        raise SystemExit(2)
    role = argv[1]
    install_hooks(role, FaultHooks(Path(os.environ[HOOKS_ENV])))
    from workers.__main__ import main

    main([role])
