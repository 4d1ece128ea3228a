"""The reader wait the vLLM server installs on vLLM's CPU platform (kiln/core/policy/vllm_cpu_wait.py):
yield right after a read, sleep for the rest of vLLM's busy window, vLLM's own wait after it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kiln.core.policy import vllm_cpu_wait

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Every yield, sleep and stock wait the napping wait makes, in order (nothing really waits)."""
    seen: list[tuple] = []
    monkeypatch.setattr(vllm_cpu_wait.os, "sched_yield", lambda: seen.append(("yield",)))
    monkeypatch.setattr(vllm_cpu_wait.time, "sleep", lambda s: seen.append(("sleep", s)))
    return seen


def _wait(calls: list[tuple]):
    def stock(self, timeout_ms=None):
        calls.append(("stock", self.name, timeout_ms))
    return vllm_cpu_wait.napping_wait(stock)


def _reader(name: str, read_ago_s: float, busy_loop_s: float = 1.0) -> SimpleNamespace:
    return SimpleNamespace(name=name, last_read=time.monotonic() - read_ago_s, busy_loop_s=busy_loop_s)


def test_a_reader_yields_right_after_a_read(calls: list[tuple]) -> None:
    assert _wait(calls)(_reader("r", 0.0), 5000) is None
    assert calls == [("yield",)]


def test_a_reader_sleeps_a_nap_later_in_vllms_busy_window(calls: list[tuple]) -> None:
    wait = _wait(calls)
    wait(_reader("r", 0.1), 5000)
    wait(_reader("r", 0.9), None)
    assert calls == [("sleep", vllm_cpu_wait.NAP_S), ("sleep", vllm_cpu_wait.NAP_S)]
    assert vllm_cpu_wait.NAP_S == 0.0005 and vllm_cpu_wait.YIELD_S == 0.005


def test_after_the_busy_window_vllms_own_wait_parks_the_reader_with_its_timeout(calls: list[tuple]) -> None:
    wait = _wait(calls)
    wait(_reader("idle", 1.5), 5000)
    wait(_reader("no-window", 0.002, busy_loop_s=0.0), 7)  # a reader vLLM gave no busy window
    assert calls == [("stock", "idle", 5000), ("stock", "no-window", 7)]


def test_an_object_without_reader_state_gets_vllms_own_wait(calls: list[tuple]) -> None:
    _wait(calls)(SimpleNamespace(name="writer"), 3)
    assert calls == [("stock", "writer", 3)]


def test_the_napping_wait_is_marked_so_a_second_install_keeps_it() -> None:
    assert vllm_cpu_wait.napping_wait(lambda self, timeout_ms=None: None).kiln_napping is True


def test_install_changes_nothing_where_vllm_is_absent() -> None:
    """Kiln's own venv has no vLLM: nothing to patch (the server's venv is checked by the vllm
    integration tests, whose /health reports ``reader_wait``)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert vllm_cpu_wait.install() is False
    else:  # pragma: no cover - only where vLLM is importable in Kiln's own venv
        pytest.skip("vLLM is importable here")


def test_napping_readers_free_the_core_vllm_reserves_unless_the_user_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert vllm_cpu_wait.free_reserved_cores() == 0
    assert vllm_cpu_wait.os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "3")
    assert vllm_cpu_wait.free_reserved_cores() == 3
    assert vllm_cpu_wait.os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "3"
