"""Who may reach the embedded Temporal: its exposure, and the namespace that closes it.

The Temporal dev server has no TLS or auth flags, and loopback ports are shared by every local
user. Where unprivileged user and network namespaces exist (``unshare -rn`` works), the
embedded Temporal runs inside a namespace of its own and the gate in :mod:`netns_relay` lets only
the home's owner through on the usual host ports (``owner_only``). Elsewhere, or with
``KILN_TEMPORAL_ISOLATION=off``, it binds the host loopback as before (``open_to_local_users``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from kiln.devstack.processes import LOOPBACK

OWNER_ONLY = "owner_only"
OPEN_TO_LOCAL_USERS = "open_to_local_users"
RELAY_SCRIPT = Path(__file__).with_name("netns_relay.py")
PROBE_TIMEOUT_S = 10.0
# A probe that times out proves nothing (a loaded machine, a cold cache): it is run once more with
# this longer bound before the mechanism counts as missing and Temporal opens to local users.
PROBE_RETRY_TIMEOUT_S = 30.0


@lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """True when this user can make a user+network namespace here with ``lo`` up and a loopback
    bind in it, as the gate needs (probed once per process, by running the gate's ``--probe``)."""
    unshare = shutil.which("unshare")
    if unshare is None or not os.access("/proc/net/tcp", os.R_OK):  # the gate reads owners there
        return False
    for timeout_s in (PROBE_TIMEOUT_S, PROBE_RETRY_TIMEOUT_S):
        try:
            done = subprocess.run(
                [unshare, "-rn", sys.executable, "-I", str(RELAY_SCRIPT), "--probe"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            continue  # slow, not refused: once more, with the longer bound
        except OSError:
            return False
        return done.returncode == 0
    return False


def choose_exposure(isolation: str) -> str:
    """The exposure the embedded Temporal will have under the ``KILN_TEMPORAL_ISOLATION`` setting."""
    if isolation == "auto" and namespaces_available():
        return OWNER_ONLY
    return OPEN_TO_LOCAL_USERS


@dataclass
class Gated:
    """A command wrapped to run in its own namespace behind the owner-only gate.

    ``fds`` (the host TCP table and listeners) go to the child; :meth:`close` closes them here after.
    """

    argv: list[str]
    table_fd: int
    listeners: list[socket.socket] = field(default_factory=list)

    @property
    def fds(self) -> tuple[int, ...]:
        return (self.table_fd, *(sock.fileno() for sock in self.listeners))

    def close(self) -> None:
        for sock in self.listeners:
            sock.close()
        self.listeners = []
        if self.table_fd >= 0:
            os.close(self.table_fd)
            self.table_fd = -1


def gated(argv: list[str], ports: list[int], *, allow_uid: int) -> Gated:
    """Wrap ``argv`` (binding ``ports`` on 127.0.0.1) to run namespaced, reached only by ``allow_uid``.

    The host listeners are bound here, so a port clash fails now with ``OSError``.
    """
    listeners: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((LOOPBACK, port))
            sock.listen(128)
            sock.set_inheritable(True)
        table = os.open("/proc/net/tcp", os.O_RDONLY)
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    os.set_inheritable(table, True)
    wrapper = [
        str(shutil.which("unshare") or "unshare"),
        "-rn",
        sys.executable,
        "-I",
        str(RELAY_SCRIPT),
        "--allow-uid",
        str(allow_uid),
        "--tcp-table-fd",
        str(table),
        *(arg for sock in listeners for arg in ("--listen-fd", str(sock.fileno()))),
        "--",
        *argv,
    ]
    return Gated(argv=wrapper, table_fd=table, listeners=listeners)
