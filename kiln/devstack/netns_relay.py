"""The closed embedded Temporal's gate: runs inside Temporal's own user+network namespace.

``kiln serve`` starts this file (standard library only, so it starts fast) as
``unshare -rn python -I netns_relay.py ...`` with two things made before the namespace existed:

- the listening sockets on the host's loopback (the frontend and Web UI ports Kiln uses), which
  keep answering on the host although this process now lives in another network namespace;
- an open ``/proc/net/tcp`` of the host, which keeps listing the host's sockets.

Here it brings up the namespace's ``lo``, starts the Temporal dev server bound to that private
loopback (the same port numbers, which exist only in the namespace), and for each connection
accepted on a host port looks up the connecting socket's owner uid in the host's table: the
allowed uid (the home's owner) is relayed to the same port inside, any other uid is reset at once,
before a byte is read, and named in one line of the log (``<home>/logs/temporal.log``). Temporal
is this process's child with ``PR_SET_PDEATHSIG``: it cannot outlive the gate. SIGTERM is passed to Temporal and waited for, so history is flushed.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys

LOOPBACK = "127.0.0.1"
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
PR_SET_PDEATHSIG = 1
CHUNK = 1 << 16


def bring_up_loopback() -> None:
    """Set ``lo`` up in this (new) network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _hex_endpoint(host: str, port: int) -> str:
    """An IPv4 endpoint as ``/proc/net/tcp`` writes it (address in host byte order, hex)."""
    packed = socket.inet_aton(host)
    return f"{struct.unpack('=I', packed)[0]:08X}:{port:04X}"


def peer_uid(table_fd: int, peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The uid owning the socket at ``peer`` connected to ``local``, from the host's TCP table."""
    want_local, want_remote = _hex_endpoint(*peer), _hex_endpoint(*local)
    os.lseek(table_fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        chunk = os.read(table_fd, CHUNK)
        if not chunk:
            break
        chunks.append(chunk)
    for line in b"".join(chunks).decode("ascii", errors="replace").splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7 and fields[1] == want_local and fields[2] == want_remote:
            return int(fields[7])
    return None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until its end, then pass the end on (a half-close where possible)."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()
    except OSError:
        writer.close()


class Gate:
    """Accept on a host listener; relay the allowed uid's connections to the namespace's port."""

    def __init__(self, listener: socket.socket, table_fd: int, allowed_uid: int) -> None:
        self.listener = listener
        self.table_fd = table_fd
        self.allowed_uid = allowed_uid
        self.port = int(listener.getsockname()[1])

    async def serve(self) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._handle, sock=self.listener, limit=CHUNK)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        peer = writer.get_extra_info("peername")
        uid = peer_uid(self.table_fd, (peer[0], int(peer[1])), (LOOPBACK, self.port)) if peer else None
        if uid != self.allowed_uid:
            print(f"[kiln gate] refused a connection from uid {uid} to port {self.port}", flush=True)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, at once
            writer.close()
            return
        try:
            inner_reader, inner_writer = await asyncio.open_connection(LOOPBACK, self.port, limit=CHUNK)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pump(reader, inner_writer), _pump(inner_reader, writer))
        finally:
            writer.close()
            inner_writer.close()


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


async def run(args: argparse.Namespace, argv: list[str]) -> int:
    table_fd = args.tcp_table_fd
    gates = [Gate(socket.socket(fileno=fd), table_fd, args.allow_uid) for fd in (args.listen_fd or [])]
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, close_fds=True)
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(None, child.wait)

    def pass_on(sig: int) -> None:
        if child.poll() is None:
            child.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pass_on, sig)
    servers = [await gate.serve() for gate in gates]
    code = await done
    for server in servers:
        server.close()
    return int(code)


def probe() -> int:
    """What the gate needs inside the namespace: ``lo`` up, and a bind on its 127.0.0.1."""
    bring_up_loopback()
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        sock.listen()
        with socket.create_connection(sock.getsockname(), timeout=5):
            pass
    return 0


def main(raw: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if raw is None else raw)
    if raw == ["--probe"]:
        return probe()
    split = raw.index("--")
    parser = argparse.ArgumentParser(prog="netns_relay")
    parser.add_argument("--allow-uid", type=int, required=True)
    parser.add_argument("--tcp-table-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, action="append")
    args = parser.parse_args(raw[:split])
    bring_up_loopback()
    return asyncio.run(run(args, raw[split + 1 :]))


if __name__ == "__main__":
    sys.exit(main())
