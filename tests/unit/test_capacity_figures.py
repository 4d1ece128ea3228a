"""A run's capacity figures (``environment_capacity`` in status): one group's report and their
sum over the run; the per-run session counts of a long-lived worker stay bounded."""

from __future__ import annotations

from kiln.core.openenv.capacity import MAX_HOLDERS, CapacityBook, group_capacity, merge_capacity


def test_refusals_and_waves_add_up_and_the_most_held_is_the_largest() -> None:
    first = group_capacity(1, 1, 1, 2)
    second = group_capacity(1, None, 0, 3)
    assert merge_capacity(None, first) == first
    assert merge_capacity(first, second) == {
        "sessions_granted_max": 1, "max_sessions_advertised": 1, "refusals": 1, "waves": 5,
    }
    assert merge_capacity(merge_capacity(first, second), group_capacity(2, 4, 2, 1)) == {
        "sessions_granted_max": 2, "max_sessions_advertised": 4, "refusals": 3, "waves": 6,
    }


def test_held_sessions_are_counted_per_run() -> None:
    book = CapacityBook()
    book.granted("ws://e/ws", "run-a")
    book.granted("ws://e/ws", "run-b")
    book.released("ws://e/ws", "run-a")
    book.granted("ws://e/ws", "run-a")
    assert book.held_max("ws://e/ws", "run-a") == 1 and book.held_max("ws://e/ws", "run-b") == 1
    assert book.snapshot("ws://e/ws")["sessions_granted_max"] == 2  # the worker's own total


def test_a_long_lived_worker_forgets_idle_runs_first() -> None:
    book = CapacityBook()
    book.granted("ws://e/ws", "busy")  # still held: never forgotten
    for n in range(MAX_HOLDERS + 10):
        book.granted("ws://e/ws", f"run-{n}")
        book.released("ws://e/ws", f"run-{n}")
    assert len(book._by_holder) <= MAX_HOLDERS + 1
    assert book.held_max("ws://e/ws", "busy") == 1
    assert book.held_max("ws://e/ws", f"run-{MAX_HOLDERS + 9}") == 1
