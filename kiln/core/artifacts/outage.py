"""Riding out a storage outage: the one rule by which an S3 call waits for the store to come back.

A worker's store (:meth:`kiln.core.artifacts.store.S3Store.from_settings` with ``outage_wait``) repeats
a call that failed with a *retryable* :class:`~kiln.core.errors.StorageUnavailable` (refused
connection, connect or read timeout, 5xx) after 1, 2, 4, 8 s, then every 15 s, until
:data:`OUTAGE_WAIT_S` (300 s) have passed since the first failure; then the last
error is raised (and the activity's retry policy takes over). Every call the store makes is
idempotent (content-addressed blobs, conditional writes that accept their own bytes, reads), so
repeating one is safe. Activities heartbeat while a store call runs, so the wait is not taken
for a dead worker, and it does not spend an attempt: an S3 restart (2-3 s under ``kiln serve``)
or a longer outage costs a training nothing but the wait.

Only the outermost call waits (a store method that calls another does not nest the waits), and a
store without ``outage_wait`` (the API's: a request answers at once, 503 ``storage_unavailable``)
and best-effort writes (live metrics: :meth:`S3Store.impatient`) never wait.

:func:`probe` is ``/healthz``'s S3 check: one bounded ``HeadBucket`` on a client of its own.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, TypeVar

from kiln.core.errors import StorageUnavailable

log = logging.getLogger("kiln.core.artifacts")

OUTAGE_WAIT_S = 300.0  # a worker's store: how long one call waits out a retryable outage
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 15.0
_Result = TypeVar("_Result")
_depth = threading.local()


def ride_out(
    call: Callable[[], _Result],
    *,
    wait_s: float,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> _Result:
    """``call()``, repeated on a retryable ``StorageUnavailable`` for up to ``wait_s`` seconds
    after its first failure (backoff 1, 2, 4, 8, then 15 s); the last error when time is up."""
    deadline: float | None = None
    delay = FIRST_DELAY_S
    while True:
        try:
            return call()
        except StorageUnavailable as exc:
            now = clock()
            if deadline is None:
                deadline = now + wait_s
            if not exc.retryable or now + delay > deadline:
                raise
            if delay == FIRST_DELAY_S:
                log.warning("S3 unavailable during %s; waiting up to %.0f s for it: %s", what, wait_s, exc.message)
            sleep(delay)
            delay = min(MAX_DELAY_S, delay * 2)


def patient(method: Callable[..., _Result]) -> Callable[..., _Result]:
    """Decorate an ``S3Store`` method so that it rides outages out for ``self.outage_wait_s``
    (the outermost patient call on a thread only)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> _Result:
        if getattr(_depth, "inside", False) or self.outage_wait_s <= 0:
            return method(self, *args, **kwargs)

        def once() -> _Result:
            _depth.inside = True
            try:
                return method(self, *args, **kwargs)
            finally:
                _depth.inside = False

        return ride_out(once, wait_s=self.outage_wait_s, what=method.__name__)

    return wrapper


def probe(store: Any, *, timeout_s: float = 2.0) -> str:
    """``reachable`` when the store answered one ``HeadBucket`` (any HTTP answer: the server is
    up) within about ``timeout_s``, else ``unreachable``. Its own client: 1 try, short timeouts."""
    import botocore.exceptions as bce

    client = store.probe_client(timeout_s)
    try:
        client.head_bucket(Bucket=store.bucket)
    except bce.ClientError:
        return "reachable"
    except Exception:  # noqa: BLE001 - refused, timed out, unresolvable: not reachable now
        return "unreachable"
    return "reachable"
