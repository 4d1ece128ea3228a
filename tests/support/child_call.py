"""Run one test-support function in a child Python process, so a test can use both cores.

``start_child(target, **kwargs)`` starts ``python -m tests.support.child_call`` with the function's
dotted name (``module:function``); its JSON keyword arguments travel in the child's environment
(``CHILD_ARGS_VARIABLE``), never on its command line, where any local user could read a storage
key; the child (one torch thread,
this worktree's code) prints the function's JSON-able result as its last stdout line. Its output
goes to temporary files (a pipe nobody reads while the parent works could fill and stall it). The
child forks from the session's fork server (torch and transformers already imported) when it can.
``child_result`` waits for it (generous timeout: the machine may be loaded) and returns the
result; ``stop_child`` kills a child the test leaves early.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from tests.support.forkserver import DISABLE_VARIABLE, REPO_ROOT, child_base_env, fork_server

CHILD_ARGS_VARIABLE = "KILN_TEST_CHILD_ARGS"


class Child:
    def __init__(self, process: Any, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.process, self.stdout, self.stderr = process, stdout, stderr


def start_child(target: str, **kwargs: Any) -> Child:
    env = {**child_base_env(), CHILD_ARGS_VARIABLE: json.dumps(kwargs)}
    stdout, stderr = tempfile.NamedTemporaryFile(), tempfile.NamedTemporaryFile()  # noqa: SIM115
    argv = [sys.executable, "-m", "tests.support.child_call", target]
    process: Any = None
    if os.environ.get(DISABLE_VARIABLE, "1") != "0":
        process = fork_server().spawn(argv, env=env, cwd=str(REPO_ROOT), stdout=Path(stdout.name),
                                      stderr=Path(stderr.name))
    if process is None:
        process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=stdout, stderr=stderr)
    return Child(process, stdout, stderr)


def _read(stream: IO[bytes]) -> str:
    stream.seek(0)
    return stream.read().decode("utf-8", "replace")


def child_result(child: Child, timeout_s: float = 1500) -> Any:
    try:
        child.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_child(child)
        raise AssertionError(f"the child process did not finish within {timeout_s} s") from None
    assert child.process.returncode == 0, f"child exited {child.process.returncode}: {_read(child.stderr)[-4000:]}"
    return json.loads(_read(child.stdout).strip().splitlines()[-1])


def stop_child(child: Child) -> None:
    """Kill the child if it still runs (a test leaving early), reap it, drop its output files."""
    if child.process.poll() is None:
        child.process.kill()
        child.process.wait()
    child.stdout.close()
    child.stderr.close()


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    module, function = argv[0].split(":")
    result = getattr(importlib.import_module(module), function)(**json.loads(os.environ.pop(CHILD_ARGS_VARIABLE)))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
