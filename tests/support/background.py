"""Heavy, self-contained computations of selected tests, run by one child process that starts
when the session begins.

The first tests of a whole-suite run (the chaos package) mostly wait: on worker deaths, heartbeat
timeouts and restarts, with about one core idle. A test marked ``@pytest.mark.background(NAME)``
has its computation (a function of the session's tiny model, counter environment and servers that
shares no state with other tests) done then by one child Python process with one torch thread
(:mod:`tests.support.child_call`), which runs the selected jobs one after another on that idle
core and writes each job's JSON result to a file as it finishes; the test waits for its file and
asserts on it. Run alone, such a test simply waits for the child.

A job is ``NAME -> (target, kwargs(request, work_dir))``: ``target`` is ``module:function`` (mostly
a function beside its test), called with those keyword arguments. ``tests/conftest.py`` starts the
selected jobs and kills the child at the session's end if it still runs (the processes it starts
die with it: the fork server's children by PDEATHSIG, a test gpu worker when its parent is gone).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from tests.support.child_call import Child, start_child

# The learning test's iterations (tests/integration/test_online_learning.py).
LEARNING_ITERATIONS = 6
LEARNING_EVALUATE_FROM = 2
LEARNING_RANGES = (0, 200)
POLL_S = 0.5


def _tiny(request: Any) -> str:
    return str(request.getfixturevalue("tiny_model_dir"))


def four_iteration_settings(jobs: Any) -> dict[str, str]:
    """The ``Settings`` fields (as strings) of the four-iteration online run's job: its own home
    and task queues on the session's Temporal and SeaweedFS (the test reads its artifacts with them)."""
    return json.loads((jobs.work / "four-iteration-settings.json").read_text())


def _four_iteration_run(request: Any, work: Path) -> dict[str, Any]:
    from tests.support.kiln_workers import CHILD_WORKER_FIELDS, settings_for_tests

    settings = settings_for_tests(request.getfixturevalue("temporal_server"), request.getfixturevalue("s3_server"),
                                  Path(_tiny(request)), work / "four-iterations" / "kiln-home")
    values = {name: str(getattr(settings, name)) for name in (*CHILD_WORKER_FIELDS, "home")}
    (work / "four-iteration-settings.json").write_text(json.dumps(values))
    return {"settings": values, "url": request.getfixturevalue("counter_env_url")}


# In the order the child runs them: by when a whole-suite run reaches their tests (the learning and
# online-run tests come first in tests/integration, the sampling and rebuild ones in tests/unit).
JOBS: dict[str, tuple[str, Callable[[Any, Path], dict[str, Any]]]] = {
    "online_learning": ("tests.support.online_loop:learning_ranges",
                        lambda request, work: {
                            "url": request.getfixturevalue("counter_env_url"), "model_path": _tiny(request),
                            "work": str(work / "learning"), "seed_starts": list(LEARNING_RANGES),
                            "iterations": LEARNING_ITERATIONS, "evaluate_from": LEARNING_EVALUATE_FROM}),
    "four_iteration_run": ("tests.integration.test_online_rl:four_iteration_run", _four_iteration_run),
    "echo_comparison": ("tests.integration.test_train_counter:echo_comparison",
                        lambda request, work: {"url": request.getfixturevalue("counter_env_url"),
                                               "model_path": _tiny(request), "work": str(work / "echo")}),
    "tiny_model_rebuild": ("tests.support.models:tiny_model_digests",
                           lambda request, work: {"out_dir": str(work / "tiny-again")}),
    "union_samples": ("tests.unit.test_policy_grammar_schema:union_samples",
                      lambda request, work: {"model_path": _tiny(request)}),
    "constrained_validity": ("tests.unit.test_policy_constrained:validity_samples",
                             lambda request, work: {"model_path": _tiny(request)}),
}


class BackgroundJobs:
    """The session's background child and the folder its results land in."""

    def __init__(self, names: list[str], request: Any, work: Path) -> None:
        self.names, self.work = names, work
        self.child: Child | None = None
        if names:
            jobs = [{"name": name, "target": JOBS[name][0], "kwargs": JOBS[name][1](request, work)}
                    for name in JOBS if name in names]
            self.child = start_child("tests.support.background:run_jobs", jobs=jobs, out_dir=str(work))

    def result(self, name: str, timeout_s: float) -> Any:
        """Job ``name``'s result, waiting for it; fails with the child's error if it failed."""
        assert self.child is not None and name in self.names, f"background job {name} was not started"
        done, failed = self.work / f"{name}.json", self.work / f"{name}.error"
        deadline = time.monotonic() + timeout_s
        while not done.exists():
            if failed.exists():
                raise AssertionError(f"background job {name} failed:\n{failed.read_text()[-4000:]}")
            if self.child.process.poll() is not None and not done.exists():
                self.child.stderr.seek(0)
                raise AssertionError(f"the background child exited ({self.child.process.returncode}) before "
                                     f"{name}: {self.child.stderr.read().decode('utf-8', 'replace')[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"background job {name} did not finish within {timeout_s} s")
            time.sleep(POLL_S)
        return json.loads(done.read_text())


def run_jobs(jobs: list[dict[str, Any]], out_dir: str) -> None:
    """The child's body: each job in turn, its result written to ``out_dir/NAME.json`` (renamed
    into place when complete) or its traceback to ``NAME.error``."""
    import importlib

    for job in jobs:
        target = Path(out_dir) / f"{job['name']}.json"
        try:
            module, function = job["target"].split(":")
            result = getattr(importlib.import_module(module), function)(**job["kwargs"])
            partial = target.with_suffix(".partial")
            partial.write_text(json.dumps(result))
            os.replace(partial, target)
        except Exception:  # noqa: BLE001 - reported to the waiting test, the next job still runs
            target.with_suffix(".error").write_text(traceback.format_exc())
