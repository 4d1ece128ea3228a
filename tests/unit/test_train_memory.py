"""The training process's memory readings (kiln.core.train.memory) against the kernel's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.train.memory import MemoryMarks, process_memory, read_status, reset_peak


@pytest.mark.timeout(30)
def test_status_lines_are_read_in_bytes(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nThreads:\t3\n")
    assert read_status(status) == {"VmHWM": 204800 * 1024, "VmRSS": 102400 * 1024}
    assert read_status(tmp_path / "absent") == {}


@pytest.mark.timeout(30)
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_the_peak_is_reset_and_then_counts_what_the_process_touches():
    if not reset_peak():
        pytest.skip("this kernel refuses clear_refs")
    marks = MemoryMarks.before_load()
    assert marks.peak_reset and marks.rss_before_load is not None
    block = bytearray(64 << 20)  # 64 MiB, zero-filled: every page touched
    marks.loaded()
    del block
    marks.ended()
    figures = marks.figures()
    assert figures["base_load_peak_bytes"] >= 60 << 20  # the block, within the kernel's page accounting
    assert figures["base_load_peak_bytes"] == figures["hwm_after_load_bytes"] - figures["rss_before_load_bytes"]
    # the kernel batches its per-thread page counters: a reading may lag by a few pages
    assert figures["training_peak_bytes"] >= figures["base_load_peak_bytes"] - (1 << 20)
    assert reset_peak() and read_status()["VmHWM"] < marks.hwm_after_load  # the freed block left the peak
    described = process_memory(marks, None)
    assert described is not None and described["source"] == "/proc/self/status" and described["peak_reset"]
    assert process_memory(None, None) is None
