"""How vLLM's engine processes wait for one another on a CPU, installed by Kiln's vLLM server.

vLLM's engine core and its model worker hand every step to each other through a shared-memory
queue. A reader that has read within the last second busy-waits for the next message
(``SpinCondition.wait`` yields the CPU and returns at once); after a second without one it parks on
a socket. On a GPU machine that spinning costs a spare core. On a small CPU the spinning readers
take the cores that the model's forward, Kiln's collection and the environment need: with a small
model and multi-turn episodes, whose turns reach the engine in waves, Kiln's collection on the
project's 2-core machine spent about half its time waiting (docs/engines.md).

:func:`install` keeps vLLM's busy window and its idle parking and changes only how a reader waits
inside the window: it yields, as vLLM does, for ``YIELD_S`` after its last read (the short gap
between two steps of a busy engine), then sleeps ``NAP_S`` between checks. A message is then seen
at most ``NAP_S`` late, and none is missed: the reader checks the queue itself after every wait, as
it does with vLLM's own.

:func:`free_reserved_cores` follows from it. vLLM's CPU build keeps one core per model worker off
the worker's threads for the engine core and the server, which would spin there. Once they nap,
that core would sit idle, so the worker's forward gets every core (on the project's 2-core machine
vLLM's own generate ran 1.7x faster, docs/engines.md).

Imports only the standard library at import time (this file runs in the engine's virtual
environment, next to ``vllm_server.py``, and in Kiln's for its tests).
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from typing import Any

# vLLM's setting: how many cores its CPU build keeps off the model worker's threads
RESERVED_CORES_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
YIELD_S = 0.005  # yield (vLLM's way) this long after the last read
NAP_S = 0.0005  # then sleep this long between checks, until vLLM's busy window ends


def napping_wait(stock: Callable[..., None]) -> Callable[..., None]:
    """``SpinCondition.wait`` that yields for ``YIELD_S`` after the reader's last read, sleeps
    ``NAP_S`` per call for the rest of vLLM's busy window, and is vLLM's ``stock`` wait after it
    (parking on the notification socket, at most ``timeout_ms``)."""

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        last_read = getattr(self, "last_read", None)
        busy_loop_s = getattr(self, "busy_loop_s", None)
        if last_read is None or busy_loop_s is None:
            return stock(self, timeout_ms)
        since = time.monotonic() - last_read
        if since <= min(YIELD_S, busy_loop_s):
            os.sched_yield()
            return None
        if since <= busy_loop_s:
            time.sleep(NAP_S)
            return None
        return stock(self, timeout_ms)

    wait.kiln_napping = True  # type: ignore[attr-defined]  # marks the patch as installed, once
    return wait


def install() -> bool:
    """Put :func:`napping_wait` in place of vLLM's reader wait, on vLLM's CPU platform only.

    Returns whether it is in place: only when vLLM runs on a CPU and its ``SpinCondition.wait``
    takes exactly ``(self, timeout_ms)``. On a GPU, or on another vLLM layout, nothing changes."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    condition = getattr(shm_broadcast, "SpinCondition", None)
    stock = getattr(condition, "wait", None)
    if condition is None or stock is None:
        return False
    if getattr(stock, "kiln_napping", False):
        return True
    if list(inspect.signature(stock).parameters) != ["self", "timeout_ms"]:
        return False
    condition.wait = napping_wait(stock)
    return True


def free_reserved_cores() -> int:
    """Give vLLM's CPU model worker every core, for processes that wait with :func:`napping_wait`.

    Sets vLLM's ``VLLM_CPU_NUM_OF_RESERVED_CPU`` to 0 unless it is set already (a user's value
    stands). vLLM logs a warning that 0 is below its minimum of one core per worker: that minimum is
    for readers that spin. Returns the number of cores reserved from now on."""
    return int(os.environ.setdefault(RESERVED_CORES_ENV, "0"))


__all__ = ["NAP_S", "RESERVED_CORES_ENV", "YIELD_S", "free_reserved_cores", "install", "napping_wait"]
