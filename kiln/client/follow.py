"""The one follow loop: successive real views of a run until it ends.

``Client.follow``/``wait``/``AsyncClient.follow`` and the CLI's ``--follow`` (live panel or one line
per change) all stand on :func:`watch`. A placeholder view (no worker answered the status query in
time, ``RunView.timed_out``) is never yielded: the caller keeps the last real one, and
``on_timed_out`` is told once per follow. Before any real view has been seen it waits and asks
again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from kiln.core.run_view import RunView


def follow_ends(view: RunView) -> bool:
    """The run ended, or it waits for a worker that nothing runs (``RunView.unclaimed``)."""
    return view.terminal or bool(view.unclaimed)


def watch(
    fetch: Callable[[], RunView],
    *,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    on_timed_out: Callable[[], None] | None = None,
) -> Iterator[RunView]:
    """Each real view ``fetch`` answers, ``poll_s`` apart; the last one yielded is the one that
    ended the follow (:func:`follow_ends`), or the latest when ``timeout_s`` passed first."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    told = False
    while True:
        view = fetch()
        if view.timed_out and not view.unclaimed:
            if not told and on_timed_out is not None:
                on_timed_out()
            told = True
        else:
            yield view
            if follow_ends(view):
                return
        if deadline is not None and time.monotonic() > deadline:
            return
        time.sleep(poll_s)


__all__ = ["follow_ends", "watch"]
