"""Benchmark: what closing the embedded Temporal costs (its start, and a gRPC round trip).

Alternates the two exposures in one process (``open_to_local_users``: the dev server on the host
loopback; ``owner_only``: in its own user+network namespace behind the gate) and prints, for
each, the median time from start to SERVING and the median of a ``check_health`` round trip
through a connected Temporal client, then the ratios owner_only/open.

    python bench/temporal_isolation.py --repeats 3 --calls 200
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from temporalio.client import Client  # noqa: E402

from kiln.devstack.isolation import OPEN_TO_LOCAL_USERS, OWNER_ONLY, namespaces_available  # noqa: E402
from kiln.devstack.processes import free_port_block  # noqa: E402
from kiln.devstack.temporal import start_temporal  # noqa: E402


async def _round_trips(address: str, calls: int) -> float:
    client = await Client.connect(address)
    await client.service_client.check_health(timeout=timedelta(seconds=5))
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        await client.service_client.check_health(timeout=timedelta(seconds=5))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _one(exposure: str, calls: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        port, ui_port = free_port_block(2, grpc_offset=None)
        started = time.perf_counter()
        proc = start_temporal(Path(tmp) / "t", port=port, ui_port=ui_port, log_dir=Path(tmp), exposure=exposure)
        start_s = time.perf_counter() - started
        try:
            rtt = asyncio.run(_round_trips(f"127.0.0.1:{port}", calls))
        finally:
            proc.stop()
    return start_s, rtt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    if not namespaces_available():
        sys.exit("no unprivileged user+network namespaces here: nothing to compare")
    results: dict[str, list[tuple[float, float]]] = {OPEN_TO_LOCAL_USERS: [], OWNER_ONLY: []}
    for _ in range(args.repeats):
        for exposure in (OPEN_TO_LOCAL_USERS, OWNER_ONLY):
            results[exposure].append(_one(exposure, args.calls))
    medians = {}
    for exposure, rows in results.items():
        start_s = statistics.median(row[0] for row in rows)
        rtt_ms = statistics.median(row[1] for row in rows) * 1000
        medians[exposure] = (start_s, rtt_ms)
        print(f"{exposure:22s} start to SERVING {start_s:6.2f} s   check_health round trip {rtt_ms:6.3f} ms")
    (open_start, open_rtt), (closed_start, closed_rtt) = medians[OPEN_TO_LOCAL_USERS], medians[OWNER_ONLY]
    print(f"owner_only / open: start {closed_start / open_start:.2f}x, round trip {closed_rtt / open_rtt:.2f}x")


if __name__ == "__main__":
    main()
