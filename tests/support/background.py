"""Heavy, self-contained computations of selected tests, started in a child process when the
session begins.

The first tests of a whole-suite run (the chaos package) mostly wait: on worker deaths, heartbeat
timeouts and restarts, with about one core idle. A test marked ``@pytest.mark.background(NAME)``
has its computation (a function of the session's tiny model and counter environment, no shared
state) started then, in one child Python process with one torch thread
(:mod:`tests.support.child_call`), so it runs on that idle core; the test itself waits for the
child's JSON result and asserts on it. Run alone, such a test simply waits for its child.

Each job is ``NAME -> start(request, work_dir) -> Child``; ``tests/conftest.py`` starts the jobs of
the selected tests and stops any child still running at the session's end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from tests.support.child_call import Child, start_child

# The learning test's iterations (tests/integration/test_online_learning.py).
LEARNING_ITERATIONS = 6
LEARNING_EVALUATE_FROM = 2
LEARNING_RANGES = (0, 200)


def _online_learning(request: Any, work: Path) -> Child:
    return start_child("tests.support.online_loop:learning_ranges_in_child",
                       url=request.getfixturevalue("counter_env_url"),
                       model_path=str(request.getfixturevalue("tiny_model_dir")), work=str(work),
                       seed_starts=list(LEARNING_RANGES), iterations=LEARNING_ITERATIONS,
                       evaluate_from=LEARNING_EVALUATE_FROM)


def _tiny_model_rebuild(request: Any, work: Path) -> Child:
    return start_child("tests.support.models:tiny_model_digests_in_child", out_dir=str(work / "tiny-again"))


JOBS: dict[str, Callable[[Any, Path], Child]] = {
    "online_learning": _online_learning,
    "tiny_model_rebuild": _tiny_model_rebuild,
}
