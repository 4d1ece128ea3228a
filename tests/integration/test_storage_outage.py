"""S3 outages against a real SeaweedFS: a frozen store (SIGSTOP: it accepts connections and
answers nothing) fails a call with a retryable ``storage_unavailable`` in bounded time and
``/healthz``'s probe calls it unreachable; a worker's store (``outage_wait``) waits an outage out
longer than the old training retry budget (about 7.5 s) and then succeeds."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.core.artifacts.outage import OUTAGE_WAIT_S, probe, ride_out
from kiln.core.artifacts.store import S3Store
from kiln.core.errors import StorageUnavailable
from kiln.core.settings import Settings
from tests.support.stack import start_test_seaweedfs

BUCKET = "kiln-outage"
OUTAGE_S = 12.0  # longer than TRAIN_RETRY's old three attempts (2 s + 4 s backoff, ~7.5 s measured)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory) -> Iterator[tuple[object, str, str, str]]:
    proc, endpoint, ak, sk = start_test_seaweedfs(tmp_path_factory.mktemp("s3-outage"), bucket=BUCKET)
    try:
        yield proc, endpoint, ak, sk
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        proc.stop()


class Frozen:
    """SIGSTOP the store's process group; SIGCONT on leaving (or after ``thaw_after_s``)."""

    def __init__(self, proc, thaw_after_s: float | None = None) -> None:  # noqa: ANN001
        self.pid = proc.pid
        self.thaw_after_s = thaw_after_s
        self.thawed_at: float | None = None
        self._timer: threading.Timer | None = None

    def thaw(self) -> None:
        if self.thawed_at is None:
            os.killpg(self.pid, signal.SIGCONT)
            self.thawed_at = time.monotonic()

    def __enter__(self) -> "Frozen":
        os.killpg(self.pid, signal.SIGSTOP)
        self.frozen_at = time.monotonic()
        if self.thaw_after_s is not None:
            self._timer = threading.Timer(self.thaw_after_s, self.thaw)
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.thaw()


def _store(seaweed, **kwargs) -> S3Store:  # noqa: ANN001
    _, endpoint, ak, sk = seaweed
    return S3Store(endpoint=endpoint, access_key=ak, secret_key=sk, bucket=BUCKET, **kwargs)


@pytest.mark.timeout(120)
def test_a_frozen_store_fails_a_read_retryably_in_bounded_time(seaweed) -> None:  # noqa: ANN001
    store = _store(seaweed, connect_timeout_s=1, read_timeout_s=2, max_attempts=2)
    ref = store.put_blob(b"frozen-read-probe" * 100)
    assert probe(store, timeout_s=1) == "reachable"
    with Frozen(seaweed[0]):
        started = time.monotonic()
        with pytest.raises(StorageUnavailable) as info:
            store.get_bytes(ref)
        failed_after = time.monotonic() - started
        assert info.value.retryable is True and info.value.code == "storage_unavailable"
        assert seaweed[1] in info.value.message and seaweed[3] not in info.value.message
        # Bound: 2 tries x (read timeout 2 s) plus botocore's backoff; a hang would run to the test timeout.
        assert failed_after < 12, failed_after
        started = time.monotonic()
        assert probe(store, timeout_s=1) == "unreachable"
        assert time.monotonic() - started < 6
    assert store.get_bytes(ref) == b"frozen-read-probe" * 100
    assert probe(store, timeout_s=1) == "reachable"


@pytest.mark.timeout(180)
def test_a_workers_store_waits_out_an_outage_longer_than_the_old_retry_budget(seaweed, tmp_path: Path) -> None:  # noqa: ANN001
    _, endpoint, ak, sk = seaweed
    settings = Settings(home=tmp_path, s3_endpoint=endpoint, s3_access_key=ak, s3_secret_key=sk, s3_bucket=BUCKET)
    assert S3Store.from_settings(settings, outage_wait=True).outage_wait_s == OUTAGE_WAIT_S == 300
    assert S3Store.from_settings(settings).outage_wait_s == 0  # the API's store answers at once
    worker_store = _store(seaweed, connect_timeout_s=1, read_timeout_s=2, outage_wait_s=90)
    data = os.urandom(200_000)
    with Frozen(seaweed[0], thaw_after_s=OUTAGE_S) as frozen:
        ref = worker_store.put_blob(data)  # a checkpoint upload during the outage
        done = time.monotonic()
    assert frozen.thawed_at is not None and done >= frozen.thawed_at  # it returned after the store came back
    assert done - frozen.frozen_at >= OUTAGE_S
    assert worker_store.get_bytes(ref) == data
    # Best-effort writes do not wait: the impatient view fails at once (within one call's bound).
    with Frozen(seaweed[0]):
        started = time.monotonic()
        with pytest.raises(StorageUnavailable):
            worker_store.impatient().put_key("live/probe", b"x")
        assert time.monotonic() - started < 12


def test_ride_out_backs_off_and_gives_up_after_its_bound() -> None:
    calls: list[float] = []
    slept: list[float] = []
    now = [0.0]

    def failing() -> None:
        calls.append(now[0])
        raise StorageUnavailable("S3 storage at http://s3 is unavailable (get)")

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    with pytest.raises(StorageUnavailable):
        ride_out(failing, wait_s=60, what="get", sleep=sleep, clock=lambda: now[0])
    assert slept == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0]  # 60 s in all; one more would pass the bound
    assert calls == [0.0, 1.0, 3.0, 7.0, 15.0, 30.0, 45.0, 60.0]
    # A refusal that will repeat (wrong credentials) is raised at once.
    refused: list[int] = []

    def denied() -> None:
        refused.append(1)
        raise StorageUnavailable("S3 refused the credentials", retryable=False)

    with pytest.raises(StorageUnavailable):
        ride_out(denied, wait_s=60, what="put", sleep=sleep, clock=lambda: now[0])
    assert refused == [1]
    # Success after two failures returns the value.
    attempts = iter([StorageUnavailable("down"), StorageUnavailable("down"), None])

    def flaky() -> str:
        error = next(attempts)
        if error is not None:
            raise error
        return "stored"

    assert ride_out(flaky, wait_s=60, what="put", sleep=sleep, clock=lambda: now[0]) == "stored"
