"""Rules the test suite holds itself to (issue 14 §9): nothing can hang, nothing has sub-second
timing slack.

- Every test runs under pytest-timeout (a default in pyproject; long ones marked).
- No bare ``await <handle>.result()``: a workflow result is awaited through
  ``tests.support.waiting.workflow_result`` (or ``asyncio.wait_for``), so a stuck run fails the
  test instead of waiting up to the 12 h training timeout.
- No timing assert with less than a second of slack (``< 0.05``-style bounds flake on 2 cores).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
BARE_RESULT = re.compile(r"await\s+(?!asyncio\.wait_for)[\w.\[\]()\"']*\.result\(\s*\)")
# e.g. `assert elapsed < 0.05`, `assert delta <= 0.3`: a timing bound below one second.
SUBSECOND_TIMING = re.compile(
    r"assert\s+[^\n]*(elapsed|took|duration|seconds|_s\b|time\.monotonic\(\)|timestamp\(\)|deadline)"
    r"[^\n]*([<>]=?|[-+])\s*0\.\d+"
)


def _test_sources() -> list[Path]:
    return [p for p in TESTS.rglob("*.py") if p.name != "test_suite_rules.py"]


def test_pytest_timeout_is_configured_for_every_test() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    options = config["tool"]["pytest"]["ini_options"]
    assert int(options["timeout"]) > 0
    assert any(dep.startswith("pytest-timeout") for dep in config["project"]["optional-dependencies"]["test"])
    assert "pytest-timeout==" in (ROOT / "constraints.txt").read_text()


def test_no_bare_workflow_result_waits() -> None:
    offenders = []
    for path in _test_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith(("#", "A bare")) or "``" in line:
                continue  # prose, not code
            if BARE_RESULT.search(line) and "wait_for" not in line:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "use tests.support.waiting.workflow_result:\n" + "\n".join(offenders)


def test_no_subsecond_timing_asserts() -> None:
    offenders = []
    for path in _test_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if SUBSECOND_TIMING.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)
